#!/usr/bin/env python3
"""Writes the golden file of kiln's MoE golden test (tests/data/golden/qwen3_moe_tiny.safetensors).

As scripts/make_golden.py does for the dense model, with transformers' Qwen3MoeForCausalLM:
a tiny model built from a config, eager attention and eager experts, float32 on the CPU,
deterministic algorithms, one forward per document of the same packed batch. Layer 0 is
a dense SwiGLU (mlp_only_layers = [0]), layer 1 sparse: 8 experts, top 2, norm_topk_prob.

The objective includes the load-balancing loss exactly as transformers defines it
(output_router_logits: load_balancing_loss_func over the router logits of the whole
batch, times router_aux_loss_coef). With one sparse layer that loss is top_k times the
Switch form kiln computes per layer (E sum_i f_i P_i with f_i a share of the T k choices,
where transformers divides by T), so kiln's model.moe.aux_loss = top_k x
router_aux_loss_coef gives the same objective; kiln's importer maps it so.

Tensors, besides make_golden.py's (input_ids, targets, cu_seqlens, logits, every
parameter and grad.<name>, in the checkpoint's per-expert names):
    loss        F32 [1]   cross-entropy alone (sum over targets != -1 / their count)
    aux_loss    F32 [1]   load_balancing_loss_func of the batch (before the coefficient)
    total_loss  F32 [1]   loss + router_aux_loss_coef x aux_loss: what the gradients are of
    route_margin F32 [1]  the smallest gap between a token's k-th and (k+1)-th router
                          probability: how far every routing choice is from a tie

Usage: python3 scripts/make_golden_moe.py --out tests/data/golden
"""

import argparse
import hashlib
import json
import os
import platform
import sys
import tempfile

import torch
import torch.nn.functional as F
import transformers
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from make_golden import BOS, DOCUMENTS, EOS, NORM_GAIN_STD, VOCAB, WEIGHT_STD, _version, make_batch, save

EXPERTS, TOP_K, EXPERT_HIDDEN, DENSE_LAYERS = 8, 2, 32, [0]
AUX_COEF = 0.05  # transformers' router_aux_loss_coef; kiln's aux_loss is TOP_K x this
SEED = 8  # every expert gets a token (one gets 1); the closest routing choice is 4e-3 from a tie


def make_config():
    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, hidden_act="silu", max_position_embeddings=256, rms_norm_eps=1e-6,
        attention_bias=False, attention_dropout=0.0, use_sliding_window=False, tie_word_embeddings=True,
        use_cache=False, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=258, dtype="float32",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=EXPERT_HIDDEN, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=DENSE_LAYERS, output_router_logits=True,
        router_aux_loss_coef=AUX_COEF)
    assert config.rope_parameters["rope_theta"] == 10000.0, config.rope_parameters
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # the per-expert loop: no grouped kernel
    return config


def build_model(config):
    model = Qwen3MoeForCausalLM(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(SEED)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in sorted(params):
            noise = torch.randn(params[name].shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                params[name].copy_(1.0 + NORM_GAIN_STD * noise)
            else:
                assert name.endswith(("proj.weight", "embed_tokens.weight", "lm_head.weight", "mlp.gate.weight",
                                      "experts.gate_up_proj", "experts.down_proj")), name
                params[name].copy_(WEIGHT_STD * noise)
    return model


def checkpoint_tensors(model):
    """Each parameter and its gradient under the checkpoint's names: the module's fused
    experts (gate_up_proj [E, 2I, H]: gate rows then up rows; down_proj [E, H, I]) split per
    expert, as transformers' own save_pretrained writes them (checked below)."""
    out = {}
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        pairs = [(name, p.detach(), p.grad.detach())]
        if name.endswith("experts.gate_up_proj"):
            base, i = name[: -len("gate_up_proj")], p.shape[1] // 2
            pairs = []
            for e in range(p.shape[0]):
                pairs += [(f"{base}{e}.gate_proj.weight", p[e, :i].detach(), p.grad[e, :i]),
                          (f"{base}{e}.up_proj.weight", p[e, i:].detach(), p.grad[e, i:])]
        elif name.endswith("experts.down_proj"):
            base = name[: -len("down_proj")]
            pairs = [(f"{base}{e}.down_proj.weight", p[e].detach(), p.grad[e]) for e in range(p.shape[0])]
        for n, value, grad in pairs:
            out[n] = value.clone().contiguous()
            out["grad." + n] = grad.clone().contiguous()
    return out


def check_names_against_save_pretrained(model, tensors, work):
    """transformers' own checkpoint of the model holds exactly these names and values."""
    from safetensors.torch import load_file
    model.save_pretrained(work)
    saved = load_file(os.path.join(work, "model.safetensors"))
    params = {k: v for k, v in tensors.items() if not k.startswith("grad.")}
    assert sorted(saved) == sorted(params), (sorted(set(saved) ^ set(params)))
    for k, v in saved.items():
        assert torch.equal(v, params[k]), k


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "data", "golden"))
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    print(f"python {platform.python_version()} torch {torch.__version__} transformers {transformers.__version__} "
          f"safetensors {_version('safetensors')} numpy {_version('numpy')}")
    print(f"command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")

    config = make_config()
    model = build_model(config)
    docs, input_ids, targets, cu_seqlens = make_batch()
    logits_per_doc, router_per_doc = [], []
    for doc in docs:
        ids = torch.tensor([doc], dtype=torch.long)
        out = model(input_ids=ids, position_ids=torch.arange(len(doc))[None], use_cache=False,
                    output_router_logits=True)
        logits_per_doc.append(out.logits[0])
        assert len(out.router_logits) == 1, "one sparse layer"
        router_per_doc.append(out.router_logits[0])
    logits = torch.cat(logits_per_doc)
    router_logits = torch.cat(router_per_doc)  # [N, E] of the sparse layer, the whole batch
    t = targets.long()
    count = int((t != -1).sum())
    loss = F.cross_entropy(logits, t, ignore_index=-1, reduction="sum") / count
    aux = load_balancing_loss_func((router_logits,), EXPERTS, TOP_K, None)
    total = loss + config.router_aux_loss_coef * aux
    model.zero_grad(set_to_none=True)
    total.backward()

    probs = torch.softmax(router_logits.detach(), dim=-1).sort(dim=-1, descending=True).values
    margin = float((probs[:, TOP_K - 1] - probs[:, TOP_K]).min())
    loads = torch.bincount(router_logits.detach().topk(TOP_K, dim=-1).indices.reshape(-1), minlength=EXPERTS)

    tensors = {"input_ids": input_ids, "targets": targets, "cu_seqlens": cu_seqlens,
               "logits": logits.detach().contiguous(), "loss": loss.detach().reshape(1),
               "aux_loss": aux.detach().reshape(1), "total_loss": total.detach().reshape(1),
               "route_margin": torch.tensor([margin])}
    checkpoint = checkpoint_tensors(model)
    with tempfile.TemporaryDirectory() as work:
        check_names_against_save_pretrained(model, checkpoint, work)
    tensors.update(checkpoint)

    metadata = {
        "config": json.dumps(json.loads(config.to_json_string(use_diff=False)), sort_keys=True),
        "attn_implementation": "eager", "experts_implementation": "eager",
        "transformers_version": transformers.__version__, "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "generator": "scripts/make_golden_moe.py: Qwen3MoeForCausalLM, eager attention and experts, float32 on the "
        "CPU, torch.use_deterministic_algorithms(True); one forward per document; total_loss = cross-entropy mean + "
        "router_aux_loss_coef x load_balancing_loss_func(router logits of the whole batch); gradients of total_loss",
        "seed": str(SEED),
        "init": f"weights (router and experts too) {WEIGHT_STD} * N(0,1); RMSNorm gains 1 + {NORM_GAIN_STD} * N(0,1); "
        "one torch.Generator seeded with 'seed', module parameters in sorted-name order",
        "documents": json.dumps(DOCUMENTS, ensure_ascii=False),
        "kiln_aux_loss": repr(TOP_K * AUX_COEF),
    }
    path = os.path.join(args.out, "qwen3_moe_tiny.safetensors")
    save(tensors, metadata, path)

    digest = hashlib.sha256()
    for key in sorted(tensors):
        digest.update(key.encode() + tensors[key].contiguous().numpy().tobytes())
    grad_abs = sum(float(v.double().abs().sum()) for k, v in tensors.items() if k.startswith("grad."))
    print(f"[moe] params={sum(p.numel() for p in model.parameters())} tokens={input_ids.numel()} counted={count} "
          f"experts={EXPERTS} top_k={TOP_K} expert load={loads.tolist()} route margin={margin:.4f}")
    print(f"[moe] loss={float(loss.detach()):.9f} aux_loss={float(aux.detach()):.9f} total_loss={float(total.detach()):.9f}")
    print(f"[moe] checksum: sum(logits)={float(logits.detach().double().sum()):.9f} sum|grad|={grad_abs:.9f} "
          f"tensors_sha256={digest.hexdigest()}")
    print(f"[moe] wrote {path} ({os.path.getsize(path)} bytes, {len(tensors)} tensors)")


if __name__ == "__main__":
    main()

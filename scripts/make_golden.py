#!/usr/bin/env python3
"""Writes the golden files of kiln's golden model test (tests/data/golden/).

An independent implementation -- transformers' Qwen3ForCausalLM, eager attention,
float32 on the CPU, deterministic algorithms -- runs a tiny model, built from a config
(never from the hub), on a packed batch of byte-level documents, and records the
inputs, logits, loss, every parameter and every parameter gradient:

    input_ids   I32 [N]        documents concatenated; BOS=256 ... EOS=257 each
    targets     I32 [N]        next token within a document, -1 at each document end
    cu_seqlens  I32 [S+1]      document boundaries, as kiln's SeqInfo holds them
    logits      F32 [N, 259]   the model run PER DOCUMENT (positions restart at 0)
    loss        F32 [1]        sum of cross-entropy over targets != -1 / their count
    <hf name>   F32            every parameter ("model.layers.0.self_attn.q_proj.weight")
    grad.<hf name> F32         d loss / d parameter

Two variants: tied and untied input/output embeddings. __metadata__ holds the config
(JSON), the library versions and how the file was made.

Usage: python3 scripts/make_golden.py --out tests/data/golden
(needs torch and transformers >= 4.51 with Qwen3; runs on the CPU in seconds).
"""

import argparse
import hashlib
import inspect
import json
import os
import platform
import sys

import torch
import torch.nn.functional as F
import transformers
from transformers import Qwen3Config, Qwen3ForCausalLM

BOS, EOS, VOCAB = 256, 257, 259
# Byte-level documents of different lengths (7, 13, 3, 21 tokens with BOS/EOS), with a
# few multi-byte UTF-8 characters so ids above 127 appear.
DOCUMENTS = ["Hello", "déjà vu!!", "x", "byte-level tokens!!"]
WEIGHT_STD = 0.15  # linears and embedding: projections of unit-RMS inputs come out O(1)
NORM_GAIN_STD = 0.1  # RMSNorm gains 1 + 0.1 * N(0, 1), so the gains are exercised
VARIANTS = [("tied", True, 0), ("untied", False, 1)]  # (name, tie_word_embeddings, seed)


def make_config(tied):
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="silu",
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        attention_bias=False,
        attention_dropout=0.0,
        use_sliding_window=False,
        tie_word_embeddings=tied,
        use_cache=False,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=258,
    )
    # transformers 5 names the parameter dtype; 4.x named it torch_dtype.
    if "dtype" in inspect.signature(Qwen3Config.__init__).parameters:
        kwargs["dtype"] = "float32"
    else:
        kwargs["torch_dtype"] = "float32"
    # transformers 5 takes rope_parameters; 4.x takes rope_theta (and may reject the other).
    try:
        config = Qwen3Config(**kwargs, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    except TypeError:
        config = None
    if config is None or getattr(config, "rope_parameters", None) is None:
        config = Qwen3Config(**kwargs, rope_theta=10000.0)
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
    assert theta == 10000.0, f"rope theta not applied: {theta}"
    assert rope.get("rope_type", "default") == "default", rope
    assert config.tie_word_embeddings == tied
    config._attn_implementation = "eager"
    return config


def build_model(config, seed):
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    model.eval()  # no dropout (attention_dropout is 0 anyway)
    if config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight, "embeddings not tied"
    else:
        assert model.lm_head.weight is not model.model.embed_tokens.weight
    # Deterministic weights, independent of transformers' own init: one generator, in
    # sorted-name order.
    gen = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in sorted(params):
            p = params[name]
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + NORM_GAIN_STD * noise)
            else:
                assert name.endswith("proj.weight") or name.endswith("embed_tokens.weight") or name == "lm_head.weight", name
                p.copy_(WEIGHT_STD * noise)
    return model


def make_batch():
    docs = [[BOS] + list(text.encode("utf-8")) + [EOS] for text in DOCUMENTS]
    ids, targets, cu = [], [], [0]
    for doc in docs:
        ids += doc
        targets += doc[1:] + [-1]
        cu.append(cu[-1] + len(doc))
    return docs, torch.tensor(ids, dtype=torch.int32), torch.tensor(targets, dtype=torch.int32), torch.tensor(cu, dtype=torch.int32)


def run_variant(name, tied, seed, out_dir):
    config = make_config(tied)
    model = build_model(config, seed)
    docs, input_ids, targets, cu_seqlens = make_batch()

    # One forward per document: batch 1, no padding, causal only, positions from 0.
    logits_per_doc = []
    for doc in docs:
        ids = torch.tensor([doc], dtype=torch.long)
        pos = torch.arange(len(doc), dtype=torch.long)[None]
        out = model(input_ids=ids, position_ids=pos, use_cache=False)
        logits_per_doc.append(out.logits[0])
    logits = torch.cat(logits_per_doc, dim=0)  # [N, vocab]
    assert logits.shape == (input_ids.numel(), VOCAB) and logits.dtype == torch.float32

    # One scalar over the whole packed batch: sum over counted positions / their count.
    t = targets.long()
    count = int((t != -1).sum())
    loss = F.cross_entropy(logits, t, ignore_index=-1, reduction="sum") / count
    model.zero_grad(set_to_none=True)
    loss.backward()
    loss_value = float(loss.detach())

    tensors = {
        "input_ids": input_ids,
        "targets": targets,
        "cu_seqlens": cu_seqlens,
        "logits": logits.detach().contiguous(),
        "loss": loss.detach().reshape(1).contiguous(),
    }
    for pname, p in model.named_parameters():  # shared (tied) parameters appear once
        assert p.grad is not None, f"no gradient for {pname}"
        assert torch.isfinite(p.grad).all(), f"non-finite gradient for {pname}"
        tensors[pname] = p.detach().clone().contiguous()
        tensors["grad." + pname] = p.grad.detach().clone().contiguous()
    if not tied:
        assert "lm_head.weight" in tensors
    else:
        assert "lm_head.weight" not in tensors

    metadata = {
        "config": json.dumps(json.loads(config.to_json_string(use_diff=False)), sort_keys=True),
        "attn_implementation": config._attn_implementation,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "generator": "scripts/make_golden.py: Qwen3ForCausalLM, eager attention, float32 on the CPU, "
        "torch.use_deterministic_algorithms(True); one forward per document (batch 1, positions from 0); "
        "loss = sum of cross-entropy over targets != -1 / their count",
        "seed": str(seed),
        "init": f"linear and embedding weights {WEIGHT_STD} * N(0,1); RMSNorm gains 1 + {NORM_GAIN_STD} * N(0,1); "
        "one torch.Generator seeded with 'seed', parameters in sorted-name order",
        "documents": json.dumps(DOCUMENTS, ensure_ascii=False),
        "loss": repr(loss_value),
    }

    path = os.path.join(out_dir, f"qwen3_tiny_{name}.safetensors")
    save(tensors, metadata, path)

    # Over names and bytes in sorted order (the file's own bytes vary: the library writes
    # __metadata__ from a hash map, in no fixed order).
    digest = hashlib.sha256()
    for key in sorted(tensors):
        digest.update(key.encode() + tensors[key].contiguous().numpy().tobytes())
    digest = digest.hexdigest()
    grad_abs = sum(float(v.double().abs().sum()) for k, v in tensors.items() if k.startswith("grad."))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[{name}] tie_word_embeddings={tied} seed={seed} params={n_params} tokens={input_ids.numel()} "
          f"documents={len(docs)} counted={count}")
    print(f"[{name}] loss={loss_value:.9f} ({loss_value!r})")
    print(f"[{name}] checksum: sum(logits)={float(tensors['logits'].double().sum()):.9f} "
          f"sum|grad|={grad_abs:.9f} tensors_sha256={digest}")
    print(f"[{name}] wrote {path} ({os.path.getsize(path)} bytes, {len(tensors)} tensors)")
    return loss_value


def save(tensors, metadata, path):
    tmp = path + ".tmp"
    try:
        from safetensors.torch import save_file
        save_file(tensors, tmp, metadata=metadata)
    except ImportError:  # the format by hand: sorted header, 8-byte padded, then data
        write_safetensors(tensors, metadata, tmp)
    os.replace(tmp, path)


def write_safetensors(tensors, metadata, path):
    names = {torch.float32: "F32", torch.int32: "I32", torch.int64: "I64", torch.float64: "F64"}
    header, blobs, offset = {}, [], 0
    for key in sorted(tensors):
        data = tensors[key].contiguous().numpy().tobytes()
        header[key] = {"dtype": names[tensors[key].dtype], "shape": list(tensors[key].shape),
                       "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + b"".join(blobs))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "data", "golden"),
                        help="output folder (default tests/data/golden)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # CPU reductions in one fixed order
    torch.set_default_dtype(torch.float32)
    print(f"python {platform.python_version()} torch {torch.__version__} transformers {transformers.__version__} "
          f"safetensors {_version('safetensors')} numpy {_version('numpy')}")
    print(f"command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
    for name, tied, seed in VARIANTS:
        run_variant(name, tied, seed, args.out)


def _version(module):
    try:
        return __import__(module).__version__
    except ImportError:
        return "absent"


if __name__ == "__main__":
    main()

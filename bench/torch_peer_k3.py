#!/usr/bin/env python3
"""The PyTorch peer of seed 001's K3-mini model as kiln builds it (configs/presets/
k3-mini-primary.toml), for eager vs torch.compile timings beside `kiln bench`: Kimi Delta
Attention in three of four layers (bench/torch_peer_kda.py: chunked delta rule in plain
torch), NoPE MLA in the fourth (docs/mla.md), Block Attention Residuals (docs/attn-res.md),
a dense SwiGLU first layer then LatentMoE (docs/latent-moe.md) with a shared expert, the
balance and z losses, a tied head. Parameter names map one to one onto kiln's (load_kiln).
The bench's rows are independent sequences: documents packed in a row are not modelled.

The experts run with torch._grouped_mm (bf16 operands) on a CUDA sm90 device, else in a loop
over experts in the activations' dtype (the CPU checks; graph breaks under compile).

Modes (bench/torch_peer.py's run): eager; compile, torch.compile of the whole model (one
graph: at 4096 tokens each of the 12 KDA layers unrolls its 64-chunk loop, forward and
backward); compile_blocks, regional compilation (Model.compile_regions): the attention and
MLP sublayers, the depth mix and the head + loss compiled apart, one graph per kind reused
by every layer of that kind (6 graphs with the grouped experts), the AttnRes bookkeeping
eager between them; compile_blocks_eager_scan, the same with KDA's chunk loop run eagerly
(out of the graphs: 64 small steps a layer at 4096 tokens) should its unrolling compile
too slowly.

    python3 bench/torch_peer_k3.py --config configs/presets/k3-mini-primary.toml --modes eager,compile_blocks
Checks: bench/torch_peer_k3_check.py.
"""
import argparse
import json
import os
import re

import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_peer import DenseMlp, RMSNorm, load_config, run
import torch_peer_kda
from torch_peer_kda import KdaMixer
from torch_peer_moe import MoeMlp, grouped

# torch._grouped_mm is for Hopper (sm90); decided once, a constant under torch.compile.
# TORCH_PEER_GROUPED=1 takes it on the CPU too (its fallback; widths multiples of 8), so a
# CPU run compiles the graphs the GPU does (the loop over experts breaks them).
GROUPED = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
GROUPED_ON_CPU = os.environ.get("TORCH_PEER_GROUPED") == "1"

# Keys beyond torch_peer's, with kiln's defaults (src/config/config.h).
EXTRA = dict(model=dict(attention="gqa", alt_attention="", alt_attention_layers="", attn_res_block=0,
                        tie_embeddings=True),
             moe=dict(latent_width=0, z_loss=0.0),
             kda=dict(heads=0, head_dim=0, conv_kernel=4, gate_rank=0),
             mla=dict(kv_rank=0, qk_head_dim=0, v_head_dim=0))


class MlaMixer(nn.Module):
    """NoPE MLA: q = Wq x, c = RMSNorm(Wkva x), k = Wkb c, v = Wvb c, causal softmax attention."""

    def __init__(self, c):
        super().__init__()
        m, d = c["mla"], c["hidden"]
        self.h = c["heads"]
        self.dqk, self.dv = m["qk_head_dim"] or c["head_dim"], m["v_head_dim"] or c["head_dim"]
        r = m["kv_rank"] or d // 4
        self.q_proj = nn.Linear(d, self.h * self.dqk, bias=False)
        self.kv_a_proj = nn.Linear(d, r, bias=False)
        self.kv_a_layernorm = RMSNorm(r, c["norm_eps"])
        self.k_b_proj = nn.Linear(r, self.h * self.dqk, bias=False)
        self.v_b_proj = nn.Linear(r, self.h * self.dv, bias=False)
        self.o_proj = nn.Linear(self.h * self.dv, d, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        latent = self.kv_a_layernorm(self.kv_a_proj(x))
        q = self.q_proj(x).view(b, t, self.h, self.dqk).transpose(1, 2)
        k = self.k_b_proj(latent).view(b, t, self.h, self.dqk).transpose(1, 2)
        v = self.v_b_proj(latent).view(b, t, self.h, self.dv).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.dqk ** -0.5)
        return self.o_proj(a.transpose(1, 2).reshape(b, t, -1))


class LatentMoe(MoeMlp):
    """torch_peer_moe's router, shared expert and balance loss; the routed experts on
    z = W_down x (width L), their weighted sum lifted by W_up; plus the router z-loss."""

    def __init__(self, c):
        super().__init__(c)
        m, d = c["moe"], c["hidden"]
        e, f, lat = m["experts"], m["expert_hidden"], m["latent_width"]
        assert lat > 0, "torch_peer_k3: model.moe.latent_width must be > 0"
        self.gate_up = nn.Parameter(torch.randn(e, 2 * f, lat) * 0.02)  # expert e: gate rows, then up rows
        self.down = nn.Parameter(torch.randn(e, lat, f) * 0.02)
        self.latent_down_proj = nn.Linear(d, lat, bias=False)
        self.latent_up_proj = nn.Linear(lat, d, bias=False)

    def experts(self, z, offsets):
        """Rows z [n, L] grouped by expert (offsets: each expert's end row) -> [n, L]."""
        if (z.is_cuda and GROUPED) or GROUPED_ON_CPU:
            gate, up = grouped(z, self.gate_up, offsets).chunk(2, -1)
            return grouped(F.silu(gate) * up, self.down, offsets)
        return self.experts_loop(z, offsets)

    @torch.compiler.disable  # data-dependent row counts: eager, not one recompile per count
    def experts_loop(self, z, offsets):
        out, start = [], 0
        for e, end in enumerate(offsets.tolist()):
            gate, up = F.linear(z[start:end], self.gate_up[e].to(z.dtype)).chunk(2, -1)
            out.append(F.linear(F.silu(gate) * up, self.down[e].to(z.dtype)))
            start = end
        return torch.cat(out)

    def forward(self, x):
        b, t, d = x.shape
        e, k = self.m["experts"], self.m["top_k"]
        h = x.reshape(-1, d)
        with torch.autocast(x.device.type, enabled=False):
            wide = torch.float64 if h.dtype == torch.float64 else torch.float32  # fp32 router logits
            logits = F.linear(h.to(wide), self.router.to(wide))
            ids, weights, probs = self.route(logits)
        z = self.latent_down_proj(h)
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.zeros(e, dtype=torch.int32, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))
        y = self.experts(z[order // k], counts.cumsum(0, dtype=torch.int32))
        pairs = torch.empty_like(y)
        pairs[order] = y
        routed = (pairs.view(-1, k, pairs.shape[-1]).to(weights.dtype) * weights.unsqueeze(-1)).sum(1)
        out = self.latent_up_proj(routed.to(z.dtype))
        if self.shared_gate_up is not None:
            g, u = self.shared_gate_up(h).chunk(2, -1)
            out = out + self.shared_down(F.silu(g) * u)
        aux = 0.0
        if self.m["aux_loss"] > 0:
            share = counts.to(probs.dtype) / flat.numel()
            aux = self.m["aux_loss"] * e * (share * probs.mean(0)).sum()
        if self.m["z_loss"] > 0:
            aux = aux + self.m["z_loss"] * logits.logsumexp(-1).pow(2).mean()
        return out.to(x.dtype).view(b, t, d), aux


def mixer_kind(c, i):
    """model.attention, or model.alt_attention on the alt_attention_layers ("every:N": the
    layers with (i + 1) % N == 0, "first:N")."""
    pattern = c["alt_attention_layers"] if c["alt_attention"] else ""
    if pattern.startswith("every:"):
        alt = (i + 1) % int(pattern.split(":")[1]) == 0
    elif pattern.startswith("first:"):
        alt = i < int(pattern.split(":")[1])
    else:
        assert not pattern, f"torch_peer_k3: alt_attention_layers {pattern!r} (only every:N, first:N)"
        alt = False
    kind = c["alt_attention"] if alt else c["attention"]
    assert kind in ("kda", "mla"), f"torch_peer_k3: token mixer {kind!r} (kda, mla)"
    return kind


def dense_layer(c, i):
    pattern = c["alt_mlp_layers"] if c["alt_mlp"] else ""
    assert not pattern or pattern.startswith("first:"), f"torch_peer_k3: alt_mlp_layers {pattern!r} (only first:N)"
    return c["mlp"] != "moe" or (pattern and i < int(pattern.split(":")[1]))


def mix(v, query, eps):
    """Block AttnRes' mix over depth: softmax_s(query . RMSNorm(V_s)) weighted sum of the V_s,
    v = the sources stacked [S, B, T, d] (the wide stream)."""
    keys = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    a = (keys * query.to(v.dtype)).sum(-1, keepdim=True).softmax(0)
    return (a * v).sum(0)


def attn_sublayer(blk, x):
    return blk.mixer(blk.attn_norm(x))


def mlp_sublayer(blk, x):
    return blk.mlp(blk.mlp_norm(x))


def head_loss(norm, weight, x, targets):
    """The final norm, the tied head and the mean next-token cross entropy."""
    logits = F.linear(norm(x).to(weight.dtype), weight)
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def compiled_mix():
    """mix under torch.compile with the source count S dynamic: one graph for every depth."""
    fn = torch.compile(mix)

    def call(v, query, eps):
        torch._dynamo.mark_dynamic(v, 0)
        return fn(v, query, eps)
    return call


class Block(nn.Module):
    def __init__(self, c, i):
        super().__init__()
        d, eps = c["hidden"], c["norm_eps"]
        self.attn_norm, self.mlp_norm = RMSNorm(d, eps), RMSNorm(d, eps)
        self.mixer = KdaMixer(c) if mixer_kind(c, i) == "kda" else MlaMixer(c)
        self.mlp = DenseMlp(d, c["ffn_hidden"]) if dense_layer(c, i) else LatentMoe(c)
        # Layer 0's attention reads the embedding alone: no query (docs/attn-res.md).
        self.attn_query = nn.Parameter(torch.zeros(d)) if i > 0 else None
        self.mlp_query = nn.Parameter(torch.zeros(d))


class Model(nn.Module):
    def __init__(self, c):
        super().__init__()
        assert c["tie_embeddings"] and c["attn_res_block"] > 0, "torch_peer_k3: a tied head and model.attn_res_block > 0"
        self.c = c
        torch_peer_kda.EAGER_SCAN = False  # until this model's compile_regions(eager_scan=True)
        self.embed = nn.Embedding(c["vocab_size"], c["hidden"])
        self.blocks = nn.ModuleList(Block(c, i) for i in range(c["layers"]))
        self.norm = RMSNorm(c["hidden"], c["norm_eps"])
        self.final_query = nn.Parameter(torch.zeros(c["hidden"]))
        # The regions compile_regions compiles one by one; plain functions (eager) until then.
        self.regions = dict(attn=attn_sublayer, mlp=mlp_sublayer, mix=mix, head=head_loss)
        for m in self.modules():  # kiln's N(0, init_std) for the matrices (the loss starts near ln V)
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def compile_regions(self, eager_scan=False):
        """Regional compilation (run's compile_blocks): each sublayer kind, the depth mix and
        the head + loss compiled on their own, so the 12 KDA layers share one graph (as do the
        4 MLA, the 15 LatentMoE and every mix) instead of one graph of the whole model; the
        AttnRes bookkeeping between them runs eagerly. eager_scan: KDA's loop over chunks is
        left out of the graphs (run eagerly between them) rather than unrolled."""
        torch_peer_kda.EAGER_SCAN = eager_scan
        self.regions = dict(attn=torch.compile(attn_sublayer), mlp=torch.compile(mlp_sublayer),
                            mix=compiled_mix(), head=torch.compile(head_loss))

    def mixed(self, ids):
        """The final mix over depth (before the final norm) and the MoE layers' summed losses."""
        s, eps, r = self.c["attn_res_block"], self.c["norm_eps"], self.regions
        wide = torch.float64 if self.embed.weight.dtype == torch.float64 else torch.float32
        emb = self.embed(ids).to(wide)
        done, partial, aux = [], None, 0.0
        sublayers = [(blk, which) for blk in self.blocks for which in ("attn", "mlp")]
        for j, (blk, which) in enumerate(sublayers):
            query = blk.attn_query if which == "attn" else blk.mlp_query
            x = emb if j == 0 else r["mix"](torch.stack([emb] + done + ([partial] if j % s else [])), query, eps)
            if which == "attn":
                out = r["attn"](blk, x)
            else:
                out, layer_aux = r["mlp"](blk, x)
                aux = aux + layer_aux
            partial = out.to(wide) if j % s == 0 else partial + out.to(wide)
            if (j + 1) % s == 0:
                done.append(partial)
                partial = None
        sources = [emb] + done + ([partial] if partial is not None else [])
        return r["mix"](torch.stack(sources), self.final_query, eps), aux

    def hidden(self, ids):
        """The final norm's output and the MoE layers' summed losses."""
        x, aux = self.mixed(ids)
        return self.norm(x), aux

    def logits(self, ids):
        h, aux = self.hidden(ids)
        return F.linear(h.to(self.embed.weight.dtype), self.embed.weight), aux

    def forward(self, ids, targets):
        x, aux = self.mixed(ids)
        return self.regions["head"](self.norm, self.embed.weight, x, targets) + aux


def counts(c):
    """(total, active) parameters, built on the meta device; active weighs each routed
    expert by top_k / experts, as `kiln plan`."""
    with torch.device("meta"):
        model = Model(c)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if re.search(r"mlp\.(gate_up|down)$", n)
                  and p.dim() == 3)
    m = c["moe"]
    return total, total - experts + experts * m["top_k"] // m["experts"]


def load_kiln(model, path):
    """Loads a kiln model folder's model.safetensors (kiln's names) into the peer."""
    from safetensors.torch import load_file
    kiln = load_file(f"{path}/model.safetensors")
    state = {n: t.clone() for n, t in model.state_dict().items()}
    filled = set()

    def put(name, value, rows=None):
        target = state[name]
        if rows is None:
            target.copy_(value.view(target.shape))
        else:
            target[rows].copy_(value)
        filled.add(name)

    for key, t in kiln.items():
        if key == "embed.weight" or key == "final_norm.weight" or key == "attn_res.final_query":
            put({"final_norm.weight": "norm.weight", "attn_res.final_query": "final_query"}.get(key, key), t)
            continue
        layer, rest = re.fullmatch(r"layers\.(\d+)\.(.+)", key).groups()
        p = f"blocks.{layer}."
        mixer = re.fullmatch(r"(kda|mla)\.(.+)", rest)
        expert = re.fullmatch(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", rest)
        shared = re.fullmatch(r"mlp\.(shared_experts\.)?(gate|up|down)_proj\.weight", rest)
        if rest.startswith("attn_res."):
            put(p + rest.split(".")[1], t)
        elif mixer:
            name = mixer.group(2)
            name = name[:-len(".weight")] if re.fullmatch(r"(q|k|v)_conv1d\.weight|o_norm\.weight", name) else name
            put(p + "mixer." + name, t)
        elif expert:
            e, which = int(expert.group(1)), expert.group(2)
            f = t.shape[0] if which != "down" else 0
            if which == "down":
                put(p + "mlp.down", t, e)
            else:
                state[p + "mlp.gate_up"][e, (0 if which == "gate" else f):][:f].copy_(t)
                filled.add(p + "mlp.gate_up")
        elif shared:
            pre = p + "mlp." + ("shared_" if shared.group(1) else "")
            which = shared.group(2)
            if which == "down":
                put(pre + "down.weight", t)
            else:
                f = t.shape[0]
                state[pre + "gate_up.weight"][(0 if which == "gate" else f):][:f].copy_(t)
                filled.add(pre + "gate_up.weight")
        elif rest == "mlp.gate.weight":
            put(p + "mlp.router", t)
        else:
            put(p + rest, t)  # norms, latent projections
    missing = {n for n, _ in model.named_parameters()} - filled
    assert not missing, f"torch_peer_k3: {path} lacks {sorted(missing)[:5]}"
    model.load_state_dict(state)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--modes", default="eager,compile")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args()
    c = load_config(a.config, a.set, EXTRA)
    for mode in a.modes.split(","):
        print(json.dumps(dict(model=c, **run(c, mode, a.dtype, a.steps, a.warmup, Model))), flush=True)


if __name__ == "__main__":
    main()

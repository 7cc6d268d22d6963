#!/usr/bin/env python3
"""The PyTorch peer of `kiln bench`: the same Qwen3-style model (RMSNorm, GQA with q/k
RMSNorm and rotate_half RoPE, SwiGLU or the sparse MLP of model.mlp = "moe", tied head)
trained on the same token layout (batch x seq of random ids), timed eager and under
torch.compile (the whole model, or block by block: compile_blocks), with SDPA (causal,
GQA), fused AdamW and bf16 autocast (or plain fp32). Prints one JSON line per mode.
--float8 tensorwise | rowwise (bf16 only) swaps the dense Linears for torchao's float8
training ones before compiling (bench/torch_peer_float8.py); the JSON's "float8" says which.

The sparse MLP (bench/torch_peer_moe.py) routes as kiln does (softmax_topk or
sigmoid_bias, fp32 router logits), sorts the token copies by expert and runs the experts
with torch._grouped_mm on bf16 operands (in both dtypes: the grouped kernel is bf16 only).

    python3 bench/torch_peer.py --config configs/bench-124m.toml --modes eager,compile,compile_blocks
    python3 bench/torch_peer.py --config configs/bench-moe-1b.toml
    PYTHONPATH=.whl/torchao python3 bench/torch_peer.py --config configs/bench-0.6b.toml --modes compile --float8 rowwise
"""
import argparse
import json
import math
import sys
import time
import tomllib

import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F

import torch_peer_float8
from torch_peer_moe import MoeMlp, moe_defaults


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DenseMlp(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.gate_up = nn.Linear(d, 2 * f, bias=False)
        self.down = nn.Linear(f, d, bias=False)

    def forward(self, x):
        g, u = self.gate_up(x).chunk(2, -1)
        return self.down(F.silu(g) * u), 0.0


class Block(nn.Module):
    def __init__(self, c, sparse):
        super().__init__()
        d, h, kv, hd, f, eps = c["hidden"], c["heads"], c["kv_heads"], c["head_dim"], c["ffn_hidden"], c["norm_eps"]
        self.h, self.kv, self.hd = h, kv, hd
        self.attn_norm, self.mlp_norm = RMSNorm(d, eps), RMSNorm(d, eps)
        self.qkv = nn.Linear(d, (h + 2 * kv) * hd, bias=False)
        self.o = nn.Linear(h * hd, d, bias=False)
        self.q_norm, self.k_norm = RMSNorm(hd, eps), RMSNorm(hd, eps)
        self.mlp = MoeMlp(c) if sparse else DenseMlp(d, f)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split([self.h * self.hd, self.kv * self.hd, self.kv * self.hd], -1)
        q = self.q_norm(q.view(b, t, self.h, self.hd)).transpose(1, 2)
        k = self.k_norm(k.view(b, t, self.kv, self.hd)).transpose(1, 2)
        v = v.view(b, t, self.kv, self.hd).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv != self.h)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        out, aux = self.mlp(self.mlp_norm(x))
        return x + out, aux


class Model(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed = nn.Embedding(c["vocab_size"], c["hidden"])
        self.blocks = nn.ModuleList(Block(c, sparse_layer(c, i)) for i in range(c["layers"]))
        self.norm = RMSNorm(c["hidden"], c["norm_eps"])
        hd, theta = c["head_dim"], c["rope_theta"]
        inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        ang = torch.outer(torch.arange(c["max_seq_len"], dtype=torch.float32), inv)
        emb = torch.cat((ang, ang), -1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, ids, targets):
        t = ids.shape[1]
        cos, sin = self.cos[:t].to(self.embed.weight.dtype), self.sin[:t].to(self.embed.weight.dtype)
        x = self.embed(ids)
        aux = 0.0  # the sparse layers' balance losses (kiln's per-micro-batch "moe_aux" slot)
        for blk in self.blocks:
            x, layer_aux = blk(x, cos, sin)
            aux = aux + layer_aux
        logits = F.linear(self.norm(x), self.embed.weight)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1)) + aux

    def compile_regions(self, eager_scan=False):
        """Regional compilation (run's compile_blocks): each block compiled on its own, one graph
        for every block of a kind; the embedding, head and loss stay eager. (eager_scan: the K3
        peer's; no loop here.)"""
        assert not eager_scan, "torch_peer: compile_blocks_eager_scan is the K3 peer's (KDA) mode"
        for blk in self.blocks:
            blk.compile()


def sparse_layer(c, i):
    """Whether layer i is sparse: model.mlp = "moe", except the alt_mlp layers ("first:N" only)."""
    if c["mlp"] != "moe":
        return False
    pattern = c["alt_mlp_layers"] if c["alt_mlp"] else ""
    if not pattern:
        return True
    assert pattern.startswith("first:"), f"torch_peer: alt_mlp_layers {pattern!r} (only first:N)"
    return i >= int(pattern.split(":")[1])


def load_config(path, overrides, extra=None):
    """The config's keys the peer reads, with kiln's defaults. extra (torch_peer_k3.py) adds
    keys: "model" to the top table, "moe" to [model.moe], any other name a [model.NAME] table."""
    extra = extra or {}
    defaults = dict(vocab_size=259, hidden=192, layers=4, heads=6, kv_heads=2, head_dim=32, ffn_hidden=512,
                    max_seq_len=256, norm_eps=1e-6, rope_theta=10000.0, micro_batch_tokens=4096, mlp="swiglu",
                    alt_mlp="", alt_mlp_layers="", **extra.get("model", {}))
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    c = dict(defaults)
    c.update({k: v for k, v in raw.get("model", {}).items() if k in defaults})
    c.update({k: v for k, v in raw.get("train", {}).items() if k in defaults})
    tables = {"moe": dict(moe_defaults(), **extra.get("moe", {}))}
    tables.update({name: t for name, t in extra.items() if name not in ("model", "moe")})
    for name, table in tables.items():
        c[name] = dict(table)
        c[name].update({k: v for k, v in raw.get("model", {}).get(name, {}).items() if k in table})
    for o in overrides:
        key, value = o.split("=", 1)
        parts = key.split(".")
        sub = parts[1] if len(parts) == 3 and parts[0] == "model" else None
        table, name = (c[sub], tables[sub]) if sub in tables else (c, defaults)
        field = parts[-1]
        kind = type(name[field])
        table[field] = value.lower() == "true" if kind is bool else kind(value)
    if c["mlp"] != "moe":
        del c["moe"]  # a dense model's record stays as it was
    return c


def run(c, mode, dtype, steps, warmup, make_model=None, float8="none"):
    """Times steps of make_model(c) (default Model) on the GPU, or on the CPU where there is none
    (a smoke run: no peak memory). mode: eager; compile (torch.compile of the whole model);
    compile_blocks (the model's compile_regions: its blocks compiled one by one, graphs shared
    by blocks alike); compile_blocks_eager_scan (K3: the same, KDA's chunk loop run eagerly). warmup_seconds is the warm-up steps' time, compilation included;
    dynamo_graphs the graphs dynamo captured (compilations and recompilations). float8: a
    torchao recipe (torch_peer_float8.RECIPES) for the dense Linears, swapped before compiling."""
    modes = ("eager", "compile", "compile_blocks", "compile_blocks_eager_scan")
    assert mode in modes, f"torch_peer: mode {mode!r} ({', '.join(modes)})"
    torch.manual_seed(0)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = dev == "cuda"
    model = (make_model or Model)(c).to(dev)
    assert float8 == "none" or dtype == "bf16", "torch_peer: --float8 needs --dtype bf16 (bf16 autocast)"
    float8_record = torch_peer_float8.convert(model, float8) if float8 != "none" else None
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    seq = min(c["max_seq_len"], c["micro_batch_tokens"])
    batch = c["micro_batch_tokens"] // seq
    ids = torch.randint(0, c["vocab_size"], (batch, seq), device=dev)
    targets = torch.roll(ids, -1, 1)
    fn = torch.compile(model) if mode == "compile" else model
    if mode.startswith("compile_blocks"):
        model.compile_regions(eager_scan=mode == "compile_blocks_eager_scan")

    def step():
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=dtype == "bf16"):
            loss = fn(ids, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    start = time.perf_counter()
    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    warmup_seconds = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        loss = step()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = batch * seq * steps
    return dict(peer=f"torch {torch.__version__} {mode} {dtype}" + ("" if float8 == "none" else f" float8 {float8}")
                + ("" if cuda else " cpu"), float8=float8, float8_linears=float8_record,
                tokens_per_second=tokens / seconds, ms_per_step=1e3 * seconds / steps,
                peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None, loss=loss.item(),
                warmup_steps=warmup, warmup_seconds=warmup_seconds,
                dynamo_graphs=counters["stats"]["unique_graphs"])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--modes", default="eager,compile")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--float8", default="none", choices=torch_peer_float8.RECIPES,
                   help="torchao float8 training recipe for the dense Linears (bf16 only)")
    a = p.parse_args()
    if a.float8 != "none" and a.dtype != "bf16":
        sys.exit(f"torch_peer: --float8 {a.float8} needs --dtype bf16 (float8 runs under bf16 autocast), not {a.dtype}")
    c = load_config(a.config, a.set)
    for mode in a.modes.split(","):
        print(json.dumps(dict(model=c, **run(c, mode, a.dtype, a.steps, a.warmup, float8=a.float8))), flush=True)


if __name__ == "__main__":
    main()

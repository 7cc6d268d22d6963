#!/usr/bin/env python3
"""Writes tests/data/rope/golden.json: transformers' RoPE inverse frequencies and attention
factors for each scaling kiln computes (nn/rope_scaling.h), the oracle of
tests/test_rope_scaling.cpp.

Each case is a kiln [model.rope] table with theta, head_dim and max_seq_len; the script
builds the Hugging Face config kiln's exporter writes for it (rope_parameters), builds
transformers' Qwen3RotaryEmbedding from it (what the model runs), and records its fp32 inverse frequencies
(as exact float bit patterns, hex) and the attention factor.

Usage: python3 scripts/make_rope_golden.py --out tests/data/rope/golden.json
(needs torch and transformers >= 5 on the CPU; runs in seconds).
"""

import argparse
import json
import struct

import torch
import transformers
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

CASES = [
    {"name": "none", "theta": 10000.0, "head_dim": 64, "max_seq_len": 4096, "rope": {"scaling": "none"}},
    {"name": "linear", "theta": 10000.0, "head_dim": 64, "max_seq_len": 8192, "rope": {"scaling": "linear", "factor": 4.0}},
    {"name": "ntk", "theta": 10000.0, "head_dim": 64, "max_seq_len": 8192, "rope": {"scaling": "ntk", "factor": 4.0}},
    {"name": "yarn", "theta": 1000000.0, "head_dim": 128, "max_seq_len": 131072,
     "rope": {"scaling": "yarn", "factor": 4.0, "original_max_seq_len": 32768}},
    {"name": "yarn_betas", "theta": 10000.0, "head_dim": 32, "max_seq_len": 1024,
     "rope": {"scaling": "yarn", "factor": 8.0, "original_max_seq_len": 128, "beta_fast": 16.0, "beta_slow": 2.0,
              "attention_factor": 1.25}},
    {"name": "llama3", "theta": 500000.0, "head_dim": 128, "max_seq_len": 131072,
     "rope": {"scaling": "llama3", "factor": 8.0, "original_max_seq_len": 8192, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0}},
    {"name": "llama3_small", "theta": 10000.0, "head_dim": 32, "max_seq_len": 2048,
     "rope": {"scaling": "llama3", "factor": 4.0, "original_max_seq_len": 256, "low_freq_factor": 2.0,
              "high_freq_factor": 8.0}},
]


def hf_rope_parameters(case):
    """The rope_parameters kiln's exporter writes (src/nn/rope.cpp), transformers' keys."""
    r, theta = case["rope"], case["theta"]
    if r["scaling"] == "none":
        return {"rope_type": "default", "rope_theta": theta}
    if r["scaling"] == "ntk":  # exported as plain RoPE of the effective base
        d = case["head_dim"]
        return {"rope_type": "default", "rope_theta": theta * r["factor"] ** (d / (d - 2))}
    p = {"rope_type": r["scaling"], "rope_theta": theta, "factor": r["factor"]}
    if r["scaling"] == "llama3":
        p.update(low_freq_factor=r["low_freq_factor"], high_freq_factor=r["high_freq_factor"],
                 original_max_position_embeddings=r["original_max_seq_len"])
    if r["scaling"] == "yarn":
        p.update(original_max_position_embeddings=r["original_max_seq_len"], beta_fast=r.get("beta_fast", 32.0),
                 beta_slow=r.get("beta_slow", 1.0), truncate=True)
        if "attention_factor" in r:
            p["attention_factor"] = r["attention_factor"]
    return p


def f32_hex(x):
    return struct.pack(">f", x).hex()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = {"transformers": transformers.__version__, "torch": torch.__version__,
           "made_by": "scripts/make_rope_golden.py", "cases": []}
    for case in CASES:
        params = hf_rope_parameters(case)
        config = Qwen3Config(hidden_size=case["head_dim"] * 2, num_attention_heads=2, num_key_value_heads=2,
                             head_dim=case["head_dim"], max_position_embeddings=case["max_seq_len"],
                             rope_parameters=params)
        rotary = Qwen3RotaryEmbedding(config)
        inv, attention_factor = rotary.inv_freq.to(torch.float32).tolist(), rotary.attention_scaling
        out["cases"].append({**case, "hf_rope_parameters": params, "attention_factor": float(attention_factor),
                             "inv_freq_f32_hex": [f32_hex(v) for v in inv]})
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""`kiln import hf` of checkpoints that transformers itself wrote (not kiln's exports).

For each sparse family kiln imports -- Qwen3MoeForCausalLM and Dots1ForCausalLM -- a tiny
model is built from a config (random weights; Dots1's e_score_correction_bias random too,
so that it moves the routing), saved with save_pretrained (transformers' own config.json
field names and per-expert tensor names), imported by kiln, and scored by `kiln score`
against transformers' fp32 forward on the CPU. Exits 1 if any logits differ by more than
1e-4 of their scale.

usage: hf_import_stock_check.py --kiln BIN [--out DIR]
"""

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
from safetensors.numpy import load_file, save_file
from transformers import Dots1Config, Dots1ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

COMMON = dict(vocab_size=259, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=False,
              bos_token_id=256, eos_token_id=257, pad_token_id=258)


def models():
    yield "dots1", Dots1ForCausalLM(Dots1Config(
        **COMMON, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5, n_group=4, topk_group=2,
        sliding_window=None))
    yield "qwen3_moe", Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **COMMON, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        mlp_only_layers=[0]))


def randomize(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    return model.eval()


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--out", default=None, help="keep the files here (default: a temporary folder)")
    args = ap.parse_args()
    torch.manual_seed(0)
    ids = np.array([[256] + list(b"To be, or not to be, that is the question: whether")], dtype=np.int32)
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        work = args.out or tmp
        os.makedirs(work, exist_ok=True)
        for name, model in models():
            model = randomize(model)
            hf, kiln = f"{work}/{name}", f"{work}/{name}-kiln"
            model.save_pretrained(hf)
            run([args.kiln, "import", "hf", hf, kiln])
            save_file({"input_ids": ids}, f"{work}/{name}-ids.safetensors")
            run([args.kiln, "score", kiln, f"{work}/{name}-ids.safetensors", "--out", f"{work}/{name}-scores.safetensors"])
            ours = load_file(f"{work}/{name}-scores.safetensors")["logits"]
            with torch.no_grad():
                theirs = model(torch.tensor(ids, dtype=torch.long)).logits.numpy()
            rel = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
            ok = rel < 1e-4
            failed |= not ok
            print(f"{name:10} {type(model).__name__:20} kiln import of transformers' checkpoint: max rel {rel:.2e} "
                  f"{'pass' if ok else 'FAIL'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Why llama.cpp's gemma2/gemma3 logits differ from kiln's more than other architectures'
(scripts/llama_cpp_check.py): ggml's CPU GELU reads a table of fp16 values
(ggml-cpu/vec.h, GGML_GELU_FP16: the input rounded to fp16, gelu_tanh of that in fp32, the
result rounded to fp16; |x| >= 10 passed through or zeroed), so its gated MLP is computed to
about fp16 precision even in an f32 file.

For each kiln Gemma model: `kiln export hf` and `kiln export gguf --type f32`, then the
numpy f64 forward of tests/python/check_gemma_export.py (transformers' Gemma 2/3 written out)
with the exact tanh GELU and with ggml's fp16-table GELU, against `kiln score` and llama.cpp's
logits of the same held-out tokens. Prints max |a - b| / max |b| for each pair: kiln should
sit on the exact forward, llama.cpp on the fp16-table one.

Then negative controls: the f32 file edited in place (gguf-py) and run by llama.cpp again,
each of which must move it away from kiln: every layer marked sliding in
sliding_window_pattern, gemma3's rope.freq_base_swa set to 1e6, gemma2's
attn_logit_softcapping set to 1e9 (no cap).

usage: llama_cpp_gemma_gelu.py --kiln BIN --out DIR [--text data/tinyshakespeare.txt] MODEL_DIR...
"""

import argparse
import json
import os
import sys

import shutil

import numpy as np
from gguf import GGUFReader
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
import check_gemma_export as gemma  # noqa: E402
from check_common import BOS, held_out_documents, read_toml_model, run  # noqa: E402
from llama_cpp_check import llama_cpp_logits  # noqa: E402


def gelu_tanh_f32(x):
    """ggml_gelu_f32 (ggml-cpu/vec.h) in float32."""
    x = x.astype(np.float32)
    a, s = np.float32(0.044715), np.float32(0.79788456)
    return np.float32(0.5) * x * (np.float32(1) + np.tanh(s * x * (np.float32(1) + a * x * x)))


def gelu_ggml_fp16_table(x):
    """ggml_vec_geglu_f32's activation under GGML_GELU_FP16: table[fp16(x)] as fp16."""
    h = x.astype(np.float16).astype(np.float32)
    y = gelu_tanh_f32(h).astype(np.float16).astype(np.float64)
    return np.where(x <= -10, 0.0, np.where(x >= 10, x, y))


def rel(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def edited_copy(src, dst, key, value):
    """src with every element of metadata field `key` set to value (same type and size)."""
    shutil.copy(src, dst)
    r = GGUFReader(dst, "r+")
    field = r.fields[key]
    for idx in field.data:
        field.parts[idx][...] = value
    del r
    return dst


def negative_controls(gguf, ids, kiln, name):
    arch = str(GGUFReader(gguf).fields["general.architecture"].contents())
    edits = [(f"{arch}.attention.sliding_window_pattern", 1)]
    edits += [("gemma3.rope.freq_base_swa", 1e6)] if arch == "gemma3" else [("gemma2.attn_logit_softcapping", 1e9)]
    for key, value in edits:
        if key not in GGUFReader(gguf).fields:
            continue
        logits, _ = llama_cpp_logits(edited_copy(gguf, gguf + ".edited", key, value), ids, os.cpu_count() or 1)
        print(f"  control {name}: {key} = {value}: max |kiln - llama.cpp| / max = {rel(kiln, logits):.2e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--text", default="data/tinyshakespeare.txt")
    ap.add_argument("--sequences", type=int, default=2)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("models", nargs="+")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    controls = []
    print(f"{'model':<8} {'kiln-exact':>11} {'kiln-fp16gelu':>14} {'llama-exact':>12} {'llama-fp16gelu':>15} {'kiln-llama':>11}")
    for model_dir in args.models:
        name = os.path.basename(os.path.normpath(model_dir))
        cfg = read_toml_model(model_dir)
        docs, _, _ = held_out_documents(args.text, cfg["data"]["val_fraction"], args.length - 1, args.sequences)
        ids = np.array([[BOS] + list(d[: args.length - 1]) for d in docs], dtype=np.int32)
        ids_file, scores = f"{args.out}/{name}-ids.safetensors", f"{args.out}/{name}-kiln.safetensors"
        save_file({"input_ids": ids}, ids_file)
        run([args.kiln, "score", model_dir, ids_file, "--out", scores])
        kiln = load_file(scores)["logits"].astype(np.float64)
        hf, gguf = f"{args.out}/{name}-hf", f"{args.out}/{name}-f32.gguf"
        run([args.kiln, "export", "hf", model_dir, hf])
        run([args.kiln, "export", "gguf", model_dir, gguf, "--type", "f32"])
        llama, _ = llama_cpp_logits(gguf, ids, os.cpu_count() or 1)
        llama = llama.astype(np.float64)
        hf_cfg = json.load(open(f"{hf}/config.json"))
        with safe_open(f"{hf}/model.safetensors", framework="numpy") as f:
            w = {k: f.get_tensor(k).astype(np.float64) for k in f.keys()}
        refs = {}
        for label, act in (("exact", gemma.gelu_pytorch_tanh), ("fp16gelu", gelu_ggml_fp16_table)):
            gemma.ACT["gelu_pytorch_tanh"] = act
            refs[label] = np.stack([gemma.forward(hf_cfg, w, seq.astype(np.int64)) for seq in ids])
        print(f"{name:<8} {rel(kiln, refs['exact']):>11.2e} {rel(kiln, refs['fp16gelu']):>14.2e} "
              f"{rel(llama, refs['exact']):>12.2e} {rel(llama, refs['fp16gelu']):>15.2e} {rel(kiln, llama):>11.2e}")
        controls.append((gguf, ids, kiln, name))
    for control in controls:
        negative_controls(*control)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""kiln -> Hugging Face -> kiln, checked by transformers itself (runs on the GPU machine).

For each trained kiln model directory given:
  1. `kiln export hf` (fp32, and bf16 in shards) and load both with AutoModelForCausalLM /
     AutoTokenizer WITHOUT trust_remote_code; the class must be the stock one expected.
  2. The tokenizer reproduces kiln's byte ids on the held-out documents (BOS first).
  3. Logits on held-out text (documents of kiln's own validation split, chosen by the same
     FNV-1a hash as src/data/dataset.cpp): kiln (`kiln score`, CPU fp32) vs transformers
     fp32 on the CPU, fp32 on the GPU (TF32 off), bf16 on the GPU from the bf16 export.
     Reported: max |diff| / max |logit|, mean KL(kiln || hf), top-1 agreement.
  4. Loss: transformers' (labels = input_ids) vs kiln's, then `kiln import hf` of the export
     and kiln's loss again (the weights must come back bit for bit).
  5. Greedy generation: kiln's KV-cache decoder (`kiln sample -t 0`) vs argmax of transformers'
     forward over the growing sequence (bytes compared; specials dropped on both sides).
  6. Where transformers can read GGUF (needs the gguf package), the f32 GGUF export too.
Models with sandwich norms export as Gemma2ForCausalLM (no q/k norms) or Gemma3ForCausalLM
(q/k norms), whose GGUF export kiln refuses naming model.sandwich_norms.
Sparse models: softmax_topk exports as Qwen3MoeForCausalLM, sigmoid_bias as Dots1ForCausalLM
(dots.llm1: DeepSeek-V3's router with Qwen3's attention); the GGUF refusals expected of
each (llama.cpp's qwen3moe has no dense layers, its dots1 always a shared expert, an
untied head and no grouped-query attention) are checked to be one line naming the key.
Writes OUT/hf_roundtrip.json and prints a table; exits 1 if an fp32 check fails (1e-4).

usage: hf_roundtrip_check.py --kiln BIN --out DIR MODEL_DIR...
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import transformers
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from check_common import BOS, compare, held_out_documents, read_toml_model, run

EXPECTED_CLASS = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM", "dots1": "Dots1ForCausalLM",
                  "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}


def hf_logits(model, ids, device):
    with torch.no_grad():
        out = model(torch.tensor(ids, dtype=torch.long, device=device)).logits
    return out.float().cpu().numpy()


def hf_loss(model, ids, device):
    with torch.no_grad():
        t = torch.tensor(ids, dtype=torch.long, device=device)
        return float(model(t, labels=t).loss)


def check_model(args, model_dir, work):
    name = os.path.basename(os.path.normpath(model_dir))
    cfg = read_toml_model(model_dir)
    m = cfg["model"]
    arch = "qwen3" if m["qk_norm"] else ("qwen2" if m["attention_bias"] else "llama")
    if m.get("mlp") == "moe" or m.get("alt_mlp") == "moe":  # sigmoid_bias routing exports as dots.llm1
        arch = "dots1" if m["moe"]["router"] == "sigmoid_bias" else "qwen3_moe"
    if m.get("sandwich_norms"):  # kiln picks Gemma 3 where the model has q/k norms (docs/export.md)
        arch = "gemma3" if m["qk_norm"] else "gemma2"
    res = {"model": name, "arch": arch, "config": {k: m[k] for k in ("hidden", "layers", "heads", "kv_heads", "head_dim",
                                                                      "ffn_hidden", "vocab_size", "qk_norm",
                                                                      "tie_embeddings", "attention_bias")}}
    if m.get("sliding_window", 0):
        res["config"].update({k: m.get(k) for k in ("sliding_window", "full_attention_layers")})
    if arch in ("qwen3_moe", "dots1"):
        res["config"]["moe"] = m["moe"]
        res["config"].update({k: m.get(k) for k in ("mlp", "alt_mlp", "alt_mlp_layers")})
    hf_dir, bf16_dir = f"{work}/{name}-hf", f"{work}/{name}-hf-bf16"
    out, _ = run([args.kiln, "export", "hf", model_dir, hf_dir])
    res["export"] = out.strip()
    run([args.kiln, "export", "hf", model_dir, bf16_dir, "--dtype", "bfloat16", "--max-shard-size", "1MB"])
    res["bf16_shards"] = sorted(f for f in os.listdir(bf16_dir) if f.endswith(".safetensors"))

    tok = AutoTokenizer.from_pretrained(hf_dir)
    res["hf_tokenizer_class"] = type(tok).__name__
    # Gemma's attention softcap is applied by transformers' eager attention only (its SDPA
    # path has no softcap argument), so Gemma models are compared under eager; what the
    # default implementation gives is reported beside it.
    attention = {"attn_implementation": "eager"} if arch in ("gemma2", "gemma3") else {}
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, **attention)
    res["hf_class"] = type(model).__name__
    res["hf_attention"] = model.config._attn_implementation
    assert res["hf_class"] == EXPECTED_CLASS[arch], f"{name}: loaded as {res['hf_class']}"
    if m.get("sliding_window", 0):  # what transformers made of the windows (the logits below check them)
        res["hf_windows"] = {"sliding_window": model.config.sliding_window,
                             "layer_types": getattr(model.config, "layer_types", None)}
    model.eval()

    L = args.length
    docs, n_val, n_docs = held_out_documents(args.text, cfg["data"]["val_fraction"], L - 1, args.sequences)
    assert len(docs) == args.sequences, f"only {len(docs)} held-out documents of >= {L - 1} bytes"
    res["held_out"] = f"{len(docs)} of {n_val} validation documents ({n_docs} in all) of {args.text}, {L} tokens each"
    tok_ok = all(tok(d.decode("utf-8")).input_ids == [BOS] + list(d) for d in docs)
    tok_ok &= all(tok(d.decode("utf-8"), add_special_tokens=False).input_ids == list(d) for d in docs)
    tok_ok &= all(tok.decode([BOS] + list(d), skip_special_tokens=True) == d.decode("utf-8") for d in docs)
    res["tokenizer_matches_kiln_ids"] = bool(tok_ok)
    ids = np.array([[BOS] + list(d[: L - 1]) for d in docs], dtype=np.int32)

    ids_file, scores = f"{work}/{name}-ids.safetensors", f"{work}/{name}-kiln.safetensors"
    save_file({"input_ids": ids}, ids_file)
    _, res["kiln_score_s"] = run([args.kiln, "score", model_dir, ids_file, "--out", scores])
    k = load_file(scores)
    kiln_logits = k["logits"]
    res["kiln_loss"] = float(k["loss_sum"].sum() / k["count"].sum())

    res["hf_fp32_cpu"] = compare(kiln_logits, hf_logits(model, ids, "cpu"))
    if attention:
        default = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        res["hf_default_attention"] = default.config._attn_implementation
        res["hf_fp32_cpu_default_attention"] = compare(kiln_logits, hf_logits(default, ids, "cpu"))
        del default
    res["hf_loss_fp32_cpu"] = hf_loss(model, ids, "cpu")
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        gpu = model.to("cuda")
        res["hf_fp32_cuda"] = compare(kiln_logits, hf_logits(gpu, ids, "cuda"))
        res["hf_loss_fp32_cuda"] = hf_loss(gpu, ids, "cuda")
        model.to("cpu")
        bf = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.bfloat16, **attention).to("cuda").eval()
        res["hf_bf16_cuda"] = compare(kiln_logits, hf_logits(bf, ids, "cuda"))
        res["hf_loss_bf16_cuda"] = hf_loss(bf, ids, "cuda")
        del bf

    back = f"{work}/{name}-back"
    run([args.kiln, "import", "hf", hf_dir, back])
    a, b = load_file(f"{model_dir}/model.safetensors"), load_file(f"{back}/model.safetensors")
    res["import_weights_bitwise"] = a.keys() == b.keys() and all(np.array_equal(a[n].view(np.uint32), b[n].view(np.uint32)) for n in a)
    save_file({"input_ids": ids}, ids_file)
    run([args.kiln, "score", back, ids_file, "--out", f"{work}/{name}-back.safetensors", "--no-logits"])
    kb = load_file(f"{work}/{name}-back.safetensors")
    res["imported_kiln_loss"] = float(kb["loss_sum"].sum() / kb["count"].sum())

    # Greedy generation: kiln's KV-cache decoder vs transformers' forward, token by token.
    prompts = [d[:24].decode("utf-8", "replace") for d in docs[:4]]
    same = 0
    for p in prompts:
        r = subprocess.run([args.kiln, "sample", model_dir, "-p", p, "-n", str(args.gen_tokens), "-t", "0",
                            "--ignore-eos", "--threads", "4", "--device", "cpu"], capture_output=True)
        assert r.returncode == 0, r.stderr
        kiln_ids = bytes(r.stdout[len(p.encode()):].rstrip(b"\n"))
        seq = [BOS] + list(p.encode())
        with torch.no_grad():  # greedy by the full forward at every step (no cache), EOS not special
            for _ in range(args.gen_tokens):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        hf_ids = bytes(t for t in seq[1 + len(p.encode()):] if t < 256)
        same += kiln_ids == hf_ids
    res["greedy_generation_equal"] = f"{same}/{len(prompts)} prompts x {args.gen_tokens} tokens"

    # transformers' own GGUF reader, if it is there (needs the gguf package).
    gg = f"{work}/{name}-f32.gguf"
    # llama.cpp's qwen3moe has sparse layers only, and renormalizes the top-k weights: kiln
    # must refuse other models, in one line naming the key.
    # llama.cpp's dots1 always has a shared expert, reads a separate output matrix and k/v
    # of as many heads as q.
    # kiln's GGUF export carries RoPE scaling only where llama.cpp's is known to equal kiln's,
    # and windowed layers nowhere.
    # A model with several of these is refused by whichever kiln checks first.
    refused_keys = []
    if arch in ("gemma2", "gemma3"):  # no gemma2/gemma3 GGUF writer in kiln yet
        refused_keys.append("model.sandwich_norms")
    if (m.get("rope") or {}).get("scaling") in ("yarn", "llama3"):
        refused_keys.append("model.rope.scaling")
    if m.get("sliding_window", 0):  # llama.cpp's qwen2/qwen3/qwen3moe have no sliding window
        refused_keys.append("model.sliding_window")
    if arch == "qwen3_moe" and (m.get("alt_mlp_layers") or m.get("mlp") != "moe"):
        refused_keys.append("alt_mlp_layers")
    if arch == "qwen3_moe" and not m["moe"]["norm_topk_prob"]:
        refused_keys.append("norm_topk_prob")
    if arch == "dots1" and not m["moe"]["shared_hidden"]:
        refused_keys.append("shared_hidden")
    if arch == "dots1" and m["tie_embeddings"]:
        refused_keys.append("tie_embeddings")
    if arch == "dots1" and m["kv_heads"] != m["heads"]:
        refused_keys.append("kv_heads")
    if refused_keys:
        r = subprocess.run([args.kiln, "export", "gguf", model_dir, gg, "--type", "f32"], capture_output=True, text=True)
        refusal = r.stderr.strip()
        named = any(key in refusal for key in refused_keys)
        assert r.returncode == 1 and "\n" not in refusal and named and not os.path.exists(gg), refusal
        res["gguf_export"] = f"refused as expected: {refusal}"
        return res
    run([args.kiln, "export", "gguf", model_dir, gg, "--type", "f32"])
    try:
        gm = AutoModelForCausalLM.from_pretrained(work, gguf_file=os.path.basename(gg), dtype=torch.float32).eval()
        res["hf_from_gguf_f32"] = compare(kiln_logits, hf_logits(gm, ids, "cpu"))
    except Exception as e:  # reported, not fatal: an optional, independent reader
        res["hf_from_gguf_f32"] = f"not loaded: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--text", default="data/tinyshakespeare.txt")
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=48)
    ap.add_argument("models", nargs="+")
    args = ap.parse_args()
    torch.manual_seed(0)
    env = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "python": platform.python_version(),
           "torch": torch.__version__, "transformers": transformers.__version__,
           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"}
    for mod in ("tokenizers", "safetensors", "gguf"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:
            env[mod] = "absent"
    results = {"env": env, "models": []}
    failed = False
    with tempfile.TemporaryDirectory() as work:
        for model_dir in args.models:
            try:
                r = check_model(args, model_dir, work)
            except Exception as e:
                r = {"model": model_dir, "error": f"{type(e).__name__}: {e}"}
            results["models"].append(r)
            ok = "error" not in r and r["hf_fp32_cpu"]["max_rel_err"] < 1e-4 and r["tokenizer_matches_kiln_ids"] \
                and r["import_weights_bitwise"] and abs(r["imported_kiln_loss"] - r["hf_loss_fp32_cpu"]) < 1e-4 \
                and ("hf_fp32_cuda" not in r or r["hf_fp32_cuda"]["max_rel_err"] < 1e-4)
            r["pass"] = bool(ok)
            failed |= not ok
            print(json.dumps(r, indent=1), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(f"{args.out}/hf_roundtrip.json", "w") as f:
        json.dump(results, f, indent=1)
    print("env:", json.dumps(env))
    print(f"{'model':16} {'class':18} {'fp32 cpu rel':>12} {'fp32 gpu rel':>12} {'bf16 gpu rel':>12} {'bf16 KL':>9} "
          f"{'bf16 top1':>9} {'hf loss':>9} {'kiln loss':>9} {'import loss':>11} pass")
    for r in results["models"]:
        if "error" in r:
            print(f"{r['model']:16} ERROR {r['error']}")
            continue
        g = lambda k, f: r[k][f] if k in r else float("nan")  # noqa: E731
        print(f"{r['model']:16} {r['hf_class']:18} {g('hf_fp32_cpu', 'max_rel_err'):12.2e} "
              f"{g('hf_fp32_cuda', 'max_rel_err'):12.2e} {g('hf_bf16_cuda', 'max_rel_err'):12.2e} "
              f"{g('hf_bf16_cuda', 'mean_kl'):9.2e} {g('hf_bf16_cuda', 'top1'):9.4f} {r['hf_loss_fp32_cpu']:9.5f} "
              f"{r['kiln_loss']:9.5f} {r['imported_kiln_loss']:11.5f} {r['pass']}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

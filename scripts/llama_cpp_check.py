#!/usr/bin/env python3
"""kiln's GGUF export run by llama.cpp itself (CPU; the `llama-cpp-python` package from PyPI
builds llama.cpp from source, so this is not part of CI: the build takes minutes).

For each trained kiln model directory and GGUF type (f32, q8_0):
  1. `kiln export gguf MODEL OUT.gguf --type T`, loaded by llama.cpp (llama_cpp.Llama).
  2. Held-out documents (kiln's own validation split, scripts/check_common.py), BOS first,
     fed to llama.cpp as token ids (its tokenizer is not involved) with logits for every
     position, and to `kiln score` (fp32, CPU).
  3. Reported: max |kiln - llama.cpp| / max |logit|, mean KL(kiln || llama.cpp), top-1
     agreement, and each side's next-token loss (perplexity = exp(loss)).
  4. For q8_0: llama.cpp's own quantizer (llama_model_quantize) applied to kiln's f32 export
     must give the same tensors, byte for byte, as kiln's q8_0 export.
  5. The embedded tokenizer: llama.cpp's tokenize of the held-out documents and of a few
     awkward UTF-8 strings gives kiln's ids (BOS, then the bytes), and detokenize gives the
     bytes back.
Writes OUT/llama_cpp.json and prints a table; exits 1 if an f32 export disagrees (rel err
above 1e-4, gemma2/gemma3 1e-3: ggml's CPU GELU is an fp16 table, see
llama_cpp_gemma_gelu.py; or losses more than 1e-4 apart) or a q8_0 one is off (mean KL
above 1e-3).

Any architecture kiln exports: dense ones, sparse ones as qwen3moe (softmax_topk) or
dots1 (sigmoid_bias; llama.cpp's dots1 needs a shared expert, an untied head and kv_heads =
heads, else kiln refuses the export), and Gemma 2/3 (model.sandwich_norms) as gemma2/gemma3.

usage: llama_cpp_check.py --kiln BIN --out DIR [--text data/tinyshakespeare.txt] MODEL_DIR...
"""

import argparse
import json
import os
import platform
import sys
import time

import ctypes

import llama_cpp
import numpy as np
from gguf import GGUFReader
from llama_cpp import Llama
from safetensors.numpy import load_file, save_file

from check_common import BOS, compare, held_out_documents, next_token_loss, read_toml_model, run


def llama_cpp_logits(gguf, ids, threads):
    """Logits [S, L, V] of each row of ids, evaluated from an empty context one token per
    micro-batch (n_ubatch = 1): with llama-cpp-python 0.3.36's CPU build, batched evaluation
    of the q8_0 files of these byte-level models (vocab 259, a q8_0 output matrix whose row
    count is not a multiple of 4) crashes inside llama.cpp, while single tokens do not."""
    # The KV cache in f32 (type 0; llama.cpp's default is f16), so that an f32 export is
    # compared at full precision. swa_full: gemma2/gemma3's sliding layers keep a cache of
    # the whole context, as the others do (no cells dropped; the window is the mask's).
    llm = Llama(model_path=gguf, n_ctx=ids.shape[1], n_batch=1, n_ubatch=1, logits_all=True, n_threads=threads,
                type_k=0, type_v=0, swa_full=True, verbose=False)
    rows = []
    for seq in ids:
        llm.reset()
        llm.eval([int(t) for t in seq])
        rows.append(np.array(llm.scores[: len(seq)], dtype=np.float32))
    meta = {k: llm.metadata[k] for k in ("general.architecture", "tokenizer.ggml.model") if k in llm.metadata}
    del llm
    return np.stack(rows), meta


# Valid UTF-8 with what trips tokenizers: multi-byte characters, runs of whitespace, control
# characters. (llama.cpp decodes its input as UTF-8 first: invalid bytes become U+FFFD there,
# while kiln's byte tokenizer keeps them; detokenize returns any bytes.)
AWKWARD_TEXT = ["café — naïve 日本語 🙂".encode(), b"  two  spaces\n\n\tand a tab\r\n", bytes(range(1, 128))]


def tokenizer_matches(gguf, docs):
    """llama.cpp's tokenizer from the GGUF gives kiln's byte ids and decodes them back."""
    llm = Llama(model_path=gguf, vocab_only=True, verbose=False)
    texts = list(docs) + AWKWARD_TEXT
    ok = all(llm.tokenize(t, add_bos=True, special=False) == [BOS] + list(t) and llm.detokenize(list(t)) == t
             for t in texts)
    del llm
    return ok, len(texts)


def same_tensor_bytes(a_path, b_path):
    """Names of tensors whose type, shape or bytes differ between two GGUF files."""
    a = {t.name: t for t in GGUFReader(a_path).tensors}
    b = {t.name: t for t in GGUFReader(b_path).tensors}
    differ = sorted(set(a) ^ set(b))
    for name in set(a) & set(b):
        x, y = a[name], b[name]
        if x.tensor_type != y.tensor_type or list(x.shape) != list(y.shape) or not np.array_equal(
                np.asarray(x.data).view(np.uint8), np.asarray(y.data).view(np.uint8)):
            differ.append(name)
    return len(a), differ


def llama_cpp_quantize_q8_0(src, dst):
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src}) returned {rc}")


def check_model(args, model_dir):
    name = os.path.basename(os.path.normpath(model_dir))
    cfg = read_toml_model(model_dir)
    length = args.length
    docs, n_val, n_docs = held_out_documents(args.text, cfg["data"]["val_fraction"], length - 1, args.sequences)
    assert len(docs) == args.sequences, f"only {len(docs)} held-out documents of >= {length - 1} bytes"
    ids = np.array([[BOS] + list(d[: length - 1]) for d in docs], dtype=np.int32)
    ids_file, scores = f"{args.out}/{name}-ids.safetensors", f"{args.out}/{name}-kiln.safetensors"
    save_file({"input_ids": ids}, ids_file)
    run([args.kiln, "score", model_dir, ids_file, "--out", scores])
    k = load_file(scores)
    kiln_logits, kiln_loss = k["logits"], float(k["loss_sum"].sum() / k["count"].sum())
    res = {"model": name, "held_out": f"{len(docs)} of {n_val} validation documents ({n_docs} in all), "
                                      f"{length} tokens each", "kiln_loss": kiln_loss, "types": {}}
    for gtype in args.types:
        gguf = f"{args.out}/{name}-{gtype}.gguf"
        run([args.kiln, "export", "gguf", model_dir, gguf, "--type", gtype])
        t = time.time()
        logits, meta = llama_cpp_logits(gguf, ids, args.threads)
        r = compare(kiln_logits, logits)
        r["llama_cpp_loss"] = next_token_loss(logits, ids)
        r["seconds"] = time.time() - t
        r["metadata"] = meta
        if gtype == "f32":
            # ggml's CPU GELU (gemma2/gemma3's gated MLP) reads a table of fp16 values, which
            # puts llama.cpp ~5e-5 from the exact f32 forward that kiln computes
            # (scripts/llama_cpp_gemma_gelu.py shows it): 1e-3 there, 1e-4 elsewhere.
            gelu_fp16 = meta.get("general.architecture") in ("gemma2", "gemma3")
            r["pass"] = r["max_rel_err"] <= (1e-3 if gelu_fp16 else 1e-4) and abs(r["llama_cpp_loss"] - kiln_loss) <= 1e-4
        else:
            r["pass"] = r["mean_kl"] <= 1e-3
        if gtype == "f32":
            ok, count = tokenizer_matches(gguf, docs)
            r["tokenizer_matches_kiln_ids"] = f"{count} texts: {ok}"
            r["pass"] &= ok
        if gtype == "q8_0":
            f32 = f"{args.out}/{name}-f32.gguf"
            if not os.path.exists(f32):
                run([args.kiln, "export", "gguf", model_dir, f32, "--type", "f32"])
            theirs = f"{args.out}/{name}-q8_0-by-llama-cpp.gguf"
            llama_cpp_quantize_q8_0(f32, theirs)
            count, differ = same_tensor_bytes(gguf, theirs)
            r["same_bytes_as_llama_cpp_quantize"] = f"{count - len(differ)} of {count} tensors"
            r["pass"] &= not differ
        res["types"][gtype] = r
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--text", default="data/tinyshakespeare.txt")
    ap.add_argument("--types", nargs="+", default=["f32", "q8_0"])
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("models", nargs="+")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "python": platform.python_version(),
              "llama_cpp_python": llama_cpp.__version__, "models": [check_model(args, m) for m in args.models]}
    with open(f"{args.out}/llama_cpp.json", "w") as f:
        json.dump(report, f, indent=1)
    print(f"llama-cpp-python {report['llama_cpp_python']} ({report['date']})")
    print(f"{'model':<10} {'type':<5} {'rel err':>9} {'mean KL':>9} {'top1':>7} {'kiln loss':>10} "
          f"{'llama.cpp loss':>14} {'arch':<7} {'tokenizer = kiln ids':<20} {'bytes = llama.cpp quantize':<27} pass")
    failed = False
    for m in report["models"]:
        for gtype, r in m["types"].items():
            failed |= not r["pass"]
            print(f"{m['model']:<10} {gtype:<5} {r['max_rel_err']:>9.2e} {r['mean_kl']:>9.2e} {r['top1']:>7.4f} "
                  f"{m['kiln_loss']:>10.5f} {r['llama_cpp_loss']:>14.5f} "
                  f"{r['metadata'].get('general.architecture', '?'):<7} "
                  f"{r.get('tokenizer_matches_kiln_ids', '-'):<20} "
                  f"{r.get('same_bytes_as_llama_cpp_quantize', '-'):<27} {r['pass']}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

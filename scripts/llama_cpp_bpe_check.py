#!/usr/bin/env python3
"""The tokenizer that kiln's GGUF export embeds for a trained BPE, run by llama.cpp itself
(CPU; `pip install llama-cpp-python` builds llama.cpp from source, minutes: not in CI).

For each split pattern of `kiln train-tokenizer --pattern` (gpt2, llama3, qwen2):
  1. train a BPE tokenizer on the text, train a model for two steps with it, and
     `kiln export gguf` it (f32);
  2. load the GGUF's vocabulary in llama.cpp (llama_cpp.Llama, vocab_only) and tokenize
     held-out documents (kiln's validation split) and a few awkward strings (contractions
     in capitals, digit runs, whitespace runs, CR/LF, tabs, punctuation runs, non-ASCII);
  3. compare with the ids of the tokenizer.json itself through Hugging Face `tokenizers`
     (which kiln's tokenizer matches exactly: tests/test_bpe_hf.cpp), and detokenize back.
Writes OUT/llama_cpp_bpe.json and prints a table; exits 1 on any difference.

usage: llama_cpp_bpe_check.py --kiln BIN --out DIR [--text data/tinyshakespeare.txt]
"""

import argparse
import json
import os
import sys

from llama_cpp import Llama
from tokenizers import Tokenizer

from check_common import held_out_documents, read_toml_model, run

# NFC text (llama.cpp applies no normalizer; the trained tokenizers normalize to NFC).
AWKWARD_TEXT = [
    "I'LL say it's DON'T and we'Re here; you'd've seen 'em.",
    "Numbers: 1 12 123 1234 12345 3.14159 2026-11-30 +44 (0)20 7946 0958",
    "  two  spaces,   three,\ttab,\t\ttwo tabs\n\nblank line\r\nCRLF\rCR  \n  ",
    "Punctuation!!! ??? ... --- ;;; ::: (([[{{}}]])) \"quoted\" «guillemets» — dash",
    "café naïve Ærø 日本語のテキスト 한국어 Ελληνικά русский עברית 🙂👍🏽 ok",
    "MixedCASEWords camelCase snake_case kebab-case ALLCAPS x",
    "",
]


def check_pattern(args, pattern):
    out = os.path.join(args.out, pattern)
    tok_dir, run_dir, gguf = f"{out}/tokenizer", f"{out}/run", f"{out}/model-f32.gguf"
    run([args.kiln, "train-tokenizer", args.text, "--vocab-size", str(args.vocab_size), "--pattern", pattern,
         "--out", tok_dir])
    tok_json = os.path.abspath(f"{tok_dir}/tokenizer.json")
    run([args.kiln, "train", args.config, "--set", f"data.tokenizer={tok_json}", "--set",
         f"model.vocab_size={args.vocab_size}", "--set", f"data.path={os.path.abspath(args.text)}", "--set",
         "train.steps=2", "--set", f"train.out_dir={run_dir}"])
    run([args.kiln, "export", "gguf", f"{run_dir}/model", gguf, "--type", "f32"])

    cfg = read_toml_model(f"{run_dir}/model")
    docs, _, _ = held_out_documents(args.text, cfg["data"]["val_fraction"], 200, args.documents)
    texts = [d.decode("utf-8") for d in docs] + AWKWARD_TEXT
    hf = Tokenizer.from_file(tok_json)
    llm = Llama(model_path=gguf, vocab_only=True, verbose=False)
    pre = llm.metadata.get("tokenizer.ggml.pre")
    mismatches, tokens = [], 0
    for text in texts:
        want = hf.encode(text, add_special_tokens=False).ids
        got = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        back = llm.detokenize(got)
        tokens += len(want)
        if got != want or back != text.encode("utf-8"):
            mismatches.append({"text": text[:80], "tokenizers": want[:40], "llama_cpp": got[:40],
                               "detokenized_equal": back == text.encode("utf-8")})
    del llm
    return {"pattern": pattern, "tokenizer.ggml.pre": pre, "texts": len(texts), "tokens": tokens,
            "mismatches": mismatches, "pass": not mismatches}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--text", default="data/tinyshakespeare.txt")
    ap.add_argument("--config", default="configs/default.toml")
    ap.add_argument("--vocab-size", type=int, default=1000)
    ap.add_argument("--documents", type=int, default=40)
    ap.add_argument("--patterns", nargs="+", default=["gpt2", "llama3", "qwen2"])
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = [check_pattern(args, p) for p in args.patterns]
    with open(os.path.join(args.out, "llama_cpp_bpe.json"), "w") as f:
        json.dump(results, f, indent=1, ensure_ascii=False)
    print(f"{'pattern':8} {'ggml.pre':10} {'texts':>5} {'tokens':>7} {'mismatches':>10} pass")
    for r in results:
        print(f"{r['pattern']:8} {str(r['tokenizer.ggml.pre']):10} {r['texts']:5} {r['tokens']:7} "
              f"{len(r['mismatches']):10} {r['pass']}")
        for m in r["mismatches"][:3]:
            print(f"  {m}")
    sys.exit(0 if all(r["pass"] for r in results) else 1)


if __name__ == "__main__":
    main()

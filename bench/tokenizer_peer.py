"""Hugging Face `tokenizers`, the peer arm of bench/run_tokenizer_bench.sh. Mirrors
bench/tokenizer_bench.cpp and prints one JSON line per result. Set RAYON_NUM_THREADS
before starting Python: tokenizers sizes its thread pool once.

  tokenizer_peer.py encode TOKENIZER_JSON TEXT THREADS [REPEAT]
  tokenizer_peer.py train TEXT VOCAB THREADS [OUT_DIR]
"""
import json
import os
import statistics
import sys
import time

import tokenizers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

QWEN2 = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
         r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


def encode(path, text_path, threads, repeat):
    with open(text_path, encoding="utf-8", newline="") as f:
        docs = f.read().split("\n\n")
    nbytes = os.path.getsize(text_path)
    tok = Tokenizer.from_file(path)
    for method in ("encode_batch", "encode_batch_fast"):
        if not hasattr(tok, method):
            continue
        fn = getattr(tok, method)
        times, tokens = [], 0
        for r in range(repeat + 1):
            t0 = time.perf_counter()
            out = fn(docs, add_special_tokens=False)
            dt = time.perf_counter() - t0
            if r == 0:
                tokens = sum(len(e.ids) for e in out)
            else:
                times.append(dt)
        median = statistics.median_low(times)
        print(json.dumps({"arm": "tokenizers." + method, "task": "encode", "threads": threads, "docs": len(docs),
                          "bytes": nbytes, "tokens": tokens, "seconds": round(median, 4),
                          "mb_per_s": round(nbytes / 1e6 / median, 2), "version": tokenizers.__version__}), flush=True)


def train(text_path, vocab, threads, out_dir):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    t0 = time.perf_counter()
    tok.train([text_path], trainer)
    seconds = time.perf_counter() - t0
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        tok.save(os.path.join(out_dir, "tokenizer.json"))
    print(json.dumps({"arm": "tokenizers.BpeTrainer", "task": "train", "threads": threads,
                      "vocab": tok.get_vocab_size(), "seconds": round(seconds, 3),
                      "version": tokenizers.__version__}), flush=True)


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    if command == "encode":
        encode(args[0], args[1], int(args[2]), int(args[3]) if len(args) > 3 else 5)
    elif command == "train":
        train(args[0], int(args[1]), int(args[2]), args[3] if len(args) > 3 else "")
    else:
        sys.exit(f"unknown command {command}")

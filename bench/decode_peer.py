#!/usr/bin/env python3
"""The transformers peer of `kiln bench-decode`: Qwen3ForCausalLM of the config's shape
(random init, bf16, on the GPU; nothing downloaded), greedy `model.generate` with a static
KV cache (cache_implementation="static"), min_new_tokens = max_new_tokens = --tokens, the
same prompt length and batch sizes. Prints one JSON line per batch size.

Timing: generate is timed (torch.cuda.synchronize around it) once with --tokens new tokens
and once with 1; generate(1) is the prefill plus the loop's setup, so
    ms_per_token = (t(tokens) - t(1)) / (tokens - 1)
is the time of one decode step (one new token per sequence), the quantity kiln's number
times. ms_per_token_total = t(tokens) / tokens is printed beside it. A warm-up generate
runs first.

On CUDA, generate compiles the decode step by itself (torch.compile) when the cache is
static, unless told not to: --compile off (the default here) sets disable_compile in the
model's generation config, so the forward runs eagerly; --compile auto leaves
transformers' default (the first call then compiles, which takes minutes).

    python3 bench/decode_peer.py --config configs/bench-0.6b.toml --batch 1 --batch 8
"""
import argparse
import json
import sys
import time
import tomllib

import torch
import transformers
from transformers import Qwen3Config, Qwen3ForCausalLM


def load_config(path):
    defaults = dict(vocab_size=259, hidden=192, layers=4, heads=6, kv_heads=2, head_dim=32, ffn_hidden=512,
                    max_seq_len=256, norm_eps=1e-6, rope_theta=10000.0, qk_norm=True, tie_embeddings=True,
                    attention_bias=False, name="model")
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    c = dict(defaults)
    c.update({k: v for k, v in raw.get("model", {}).items() if k in defaults})
    if not c["qk_norm"]:
        sys.exit("decode_peer: Qwen3 always has q/k norms; the config has qk_norm = false")
    return c


def build(c):
    shape = dict(vocab_size=c["vocab_size"], hidden_size=c["hidden"], intermediate_size=c["ffn_hidden"],
                 num_hidden_layers=c["layers"], num_attention_heads=c["heads"], num_key_value_heads=c["kv_heads"],
                 head_dim=c["head_dim"], max_position_embeddings=c["max_seq_len"], rms_norm_eps=c["norm_eps"],
                 tie_word_embeddings=c["tie_embeddings"], attention_bias=c["attention_bias"], use_cache=True,
                 bos_token_id=None, eos_token_id=None, pad_token_id=0)
    try:  # RoPE's theta (it changes no cost) as kiln's, where this version takes it so
        cfg = Qwen3Config(**shape, rope_parameters={"rope_type": "default", "rope_theta": float(c["rope_theta"])})
    except Exception:  # an older config class without rope_parameters
        cfg = Qwen3Config(**shape)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg)
    model = model.to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def set_compile(model, compile_mode):
    # An attribute of the model's generation config (generate merges it with its kwargs), so
    # a version without the field ignores it rather than refusing an unknown kwarg.
    model.generation_config.disable_compile = compile_mode == "off"


def timed_generate(model, ids, tokens):
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                  do_sample=False, cache_implementation="static", pad_token_id=0)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(**kwargs)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + tokens, f"generated {out.shape[1] - ids.shape[1]} tokens, not {tokens}"
    return seconds, out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--batch", type=int, action="append", default=[])
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--compile", choices=["off", "auto"], default="off")
    a = p.parse_args()
    c = load_config(a.config)
    model = build(c)
    set_compile(model, a.compile)
    mode = "eager" if a.compile == "off" else "auto-compiled"
    if a.compile == "off" and not hasattr(transformers.GenerationConfig(), "disable_compile"):
        mode = "eager asked, but this version has no disable_compile"
    who = f"transformers {transformers.__version__} generate, static cache, {mode}; torch {torch.__version__}"
    for batch in a.batch or [1, 8]:
        g = torch.Generator(device="cuda").manual_seed(batch)
        ids = torch.randint(0, c["vocab_size"], (batch, a.prompt), device="cuda", generator=g)
        # Warm-up. A compiled generate was seen (2026-11-30, H200) to keep compiling past a
        # 16-token warm-up (its first timed batch-1 run: 44 ms per step, then 3.65), so with
        # compilation on the warm-up is a whole run of --tokens.
        timed_generate(model, ids, a.tokens if a.compile == "auto" else min(16, a.tokens))
        t1 = min(timed_generate(model, ids, 1)[0] for _ in range(3))
        tn, out = timed_generate(model, ids, a.tokens)
        step_ms = 1e3 * (tn - t1) / max(1, a.tokens - 1)
        print(json.dumps(dict(who=who, model=c["name"], batch=batch, prompt=a.prompt, tokens=a.tokens,
                              ms_per_token=step_ms, ms_per_token_total=1e3 * tn / a.tokens,
                              tokens_per_second=batch * 1e3 / step_ms, generate_1_ms=1e3 * t1,
                              first_tokens=out[0, a.prompt:a.prompt + 8].tolist())), flush=True)
        print(f"decode_peer: batch {batch}: {step_ms:.3f} ms per decode step ({1e3 * tn / a.tokens:.3f} ms per "
              f"token with the prefill), generate(1) {1e3 * t1:.1f} ms", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Checks a `kiln export gguf` file with the `gguf` package (llama.cpp's gguf-py), against
the kiln model it came from.

usage: check_gguf.py FILE.gguf KILN_MODEL_DIR TYPE [KILN_DEQUANT.safetensors]
  TYPE: f32 | bf16 | q8_0 (what the export was asked for)
  KILN_DEQUANT: kiln's own reading of FILE (GgufFile::read_f32, by GGUF name); each tensor
                must equal gguf-py's dequantization bit for bit.
Checks metadata, tensor names, shapes and types; for Q8_0, that gguf-py's quantizer applied
to kiln's f32 weights gives kiln's bytes exactly; for llama, the q/k permutation; under
partial rotary (model.rope.fraction < 1), the q/k reordering into llama.cpp's NEOX layout
and, at f32, that llama.cpp's rotation of the first R dims gives kiln's attention scores;
for Gemma (model.sandwich_norms: llama.cpp's gemma2 / gemma3), its keys (softcaps, window
pattern, local RoPE base), its tensor names and every norm gain stored as 1 + w.
"""

import os
import sys

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf.quants import dequantize, quantize
from safetensors import safe_open

sys.path.insert(0, os.path.dirname(__file__))
import kiln_ref as ref  # noqa: E402
from kiln_ref import check  # noqa: E402


def field(reader, key):
    f = reader.get_field(key)
    check(f is not None, f"missing metadata key {key}")
    return f.contents()


def rotary_dims(m):
    return round(m.get("rope", {}).get("fraction", 1.0) * m["head_dim"])


def neox_partial_order(w, n_head, head_dim, rotary):
    """kiln rotates pairs (j, j + D/2) for j < R/2; llama.cpp's NEOX rope with n_rot = R pairs
    (j, j + R/2) over the first R dims and passes the rest: per head, gather [0, R/2),
    [D/2, D/2 + R/2), then the passed dims in order."""
    half, r2 = head_dim // 2, rotary // 2
    idx = list(range(r2)) + list(range(half, half + r2)) + list(range(r2, half)) + list(range(half + r2, head_dim))
    return w.reshape(n_head, head_dim, *w.shape[1:])[:, idx].reshape(w.shape)


def rope_heads(x, pos, theta, rotary, pairs_at):
    """Rotates x [H, D] at position pos by an R-dim RoPE (transformers' default inverse
    frequencies over R): pairs (j, j + pairs_at) for j < R/2, the other dims passed."""
    inv = 1.0 / theta ** (np.arange(0, rotary, 2, dtype=np.float64) / rotary)
    c, s = np.cos(pos * inv), np.sin(pos * inv)
    out = x.copy()
    a, b = x[:, : rotary // 2], x[:, pairs_at : pairs_at + rotary // 2]
    out[:, : rotary // 2] = a * c - b * s
    out[:, pairs_at : pairs_at + rotary // 2] = b * c + a * s
    return out


def check_partial_rotary_scores(gguf, kiln, m):
    """Layer 0's attention scores q(pos 5) . k(pos 2) as llama.cpp computes them from the
    GGUF tensors (NEOX rope over the first R dims: rotate_half within them, as transformers'
    partial_rotary_factor classes do) equal kiln's from its own (pairs (j, j + D/2))."""
    D, R, H, KV = m["head_dim"], rotary_dims(m), m["heads"], m["kv_heads"]
    x = np.random.default_rng(7).standard_normal(m["hidden"])

    def heads(get, qk, n, pairs_at, pos):  # get(qk, "weight" | "bias" | "norm")
        y = (get(qk, "weight").astype(np.float64) @ x).reshape(n, D)
        if m["attention_bias"]:
            y = y + get(qk, "bias").astype(np.float64).reshape(n, D)
        if m["qk_norm"]:
            y = y / np.sqrt((y * y).mean(-1, keepdims=True) + m["norm_eps"]) * get(qk, "norm").astype(np.float64)
        return rope_heads(y, pos, m["rope_theta"], R, pairs_at)

    def scores(get, pairs_at):
        q, k = heads(get, "q", H, pairs_at, 5), heads(get, "k", KV, pairs_at, 2)
        return np.array([q[h] @ k[h // (H // KV)] for h in range(H)])

    gguf_names = {"weight": "blk.0.attn_{}.weight", "bias": "blk.0.attn_{}.bias", "norm": "blk.0.attn_{}_norm.weight"}
    kiln_names = {"weight": "layers.0.attn.{}_proj.weight", "bias": "layers.0.attn.{}_proj.bias",
                  "norm": "layers.0.attn.{}_norm.weight"}
    theirs = scores(lambda qk, part: gguf[gguf_names[part].format(qk)], R // 2)
    ours = scores(lambda qk, part: kiln[kiln_names[part].format(qk)], D // 2)
    err = np.abs(theirs - ours).max() / np.abs(ours).max()
    check(err < 1e-5, f"partial rotary: llama.cpp's scores differ from kiln's by {err:.3e} (relative)")
    print(f"OK partial rotary: {R} of {D} dims, layer 0's {H} scores agree within {err:.1e}")


def gguf_arch(m):
    """Sandwich norms are Gemma's block: llama.cpp's gemma3 with q/k norms, else gemma2."""
    if m.get("sandwich_norms", False):
        return "gemma3" if m["qk_norm"] else "gemma2"
    return ref.expected_arch(m)


def gemma_tensors(m):
    """GGUF name -> (kiln name, shape) of llama.cpp's gemma2/gemma3 tensors (load_arch_tensors
    in src/models/gemma2.cpp, gemma3.cpp), written out from conversion/gemma.py's names."""
    d, hd, q, kv, f, v = m["hidden"], m["head_dim"], m["heads"] * m["head_dim"], m["kv_heads"] * m["head_dim"], m["ffn_hidden"], m["vocab_size"]
    out = {"token_embd.weight": ("embed.weight", (v, d)), "output_norm.weight": ("final_norm.weight", (d,))}
    if not m["tie_embeddings"]:
        out["output.weight"] = ("lm_head.weight", (v, d))
    for l in range(m["layers"]):
        for g, k, shape in [("attn_norm", "attn_norm", (d,)), ("attn_q", "attn.q_proj", (q, d)),
                            ("attn_k", "attn.k_proj", (kv, d)), ("attn_v", "attn.v_proj", (kv, d)),
                            ("attn_output", "attn.o_proj", (d, q)), ("post_attention_norm", "post_attn_norm", (d,)),
                            ("ffn_norm", "mlp_norm", (d,)), ("ffn_gate", "mlp.gate_proj", (f, d)),
                            ("ffn_up", "mlp.up_proj", (f, d)), ("ffn_down", "mlp.down_proj", (d, f)),
                            ("post_ffw_norm", "post_mlp_norm", (d,))] + (
                [("attn_q_norm", "attn.q_norm", (hd,)), ("attn_k_norm", "attn.k_norm", (hd,))] if m["qk_norm"] else []):
            out[f"blk.{l}.{g}.weight"] = (f"layers.{l}.{k}.weight", shape)
    return out


def check_gemma_metadata(r, m, arch):
    """The keys llama.cpp's gemma2/gemma3 read (load_arch_hparams, load_swa_pattern)."""
    def f32(key):
        return np.float32(field(r, f"{arch}.{key}"))
    windowed = ref.windowed_layers(m)
    pattern = [l in windowed for l in range(m["layers"])]
    check(list(field(r, f"{arch}.attention.sliding_window_pattern")) == pattern, f"sliding_window_pattern != {pattern}")
    if windowed:
        check(field(r, f"{arch}.attention.sliding_window") == m["sliding_window"], "attention.sliding_window")
    else:
        check(r.get_field(f"{arch}.attention.sliding_window") is None, "attention.sliding_window without a window")
    softcap, final = m.get("attention_softcap", 0.0), m.get("logit_softcap", 0.0)
    if arch == "gemma2":  # applied always: both written
        check(f32("attn_logit_softcapping") == np.float32(softcap), "attn_logit_softcapping")
        check(f32("final_logit_softcapping") == np.float32(final), "final_logit_softcapping")
    else:
        check(r.get_field("gemma3.attn_logit_softcapping") is None, "gemma3 has no attention softcap")
        if final:
            check(f32("final_logit_softcapping") == np.float32(final), "final_logit_softcapping")
        else:
            check(r.get_field("gemma3.final_logit_softcapping") is None, "final_logit_softcapping without a cap")
        if windowed:
            local = m.get("rope", {}).get("local_theta", 0.0) or m["rope_theta"]
            check(f32("rope.freq_base_swa") == np.float32(local), "rope.freq_base_swa")
    print(f"OK {arch} keys: window pattern {''.join('s' if p else 'g' for p in pattern)}, softcaps {softcap} / {final}")


def check_metadata(r, m, typ):
    arch = gguf_arch(m)
    check(field(r, "general.architecture") == arch, f"architecture {field(r, 'general.architecture')} != {arch}")
    check(field(r, "general.file_type") == {"f32": 0, "bf16": 32, "q8_0": 7}[typ], "general.file_type")
    want = {"context_length": m["max_seq_len"], "embedding_length": m["hidden"], "block_count": m["layers"],
            "feed_forward_length": m["ffn_hidden"], "attention.head_count": m["heads"],
            "attention.head_count_kv": m["kv_heads"], "attention.key_length": m["head_dim"],
            "attention.value_length": m["head_dim"], "rope.dimension_count": rotary_dims(m), "vocab_size": m["vocab_size"]}
    for k, v in want.items():
        check(field(r, f"{arch}.{k}") == v, f"{arch}.{k} = {field(r, f'{arch}.{k}')} != {v}")
    check(np.float32(field(r, f"{arch}.rope.freq_base")) == np.float32(m["rope_theta"]), "rope.freq_base")
    check(np.float32(field(r, f"{arch}.attention.layer_norm_rms_epsilon")) == np.float32(m["norm_eps"]), "rms eps")
    check(field(r, "tokenizer.ggml.model") == "gpt2", "tokenizer model")
    tokens, types = field(r, "tokenizer.ggml.tokens"), field(r, "tokenizer.ggml.token_type")
    byte_map = ref.gpt2_bytes_to_unicode()
    check(len(tokens) == m["vocab_size"] == len(types), f"{len(tokens)} tokens for vocab {m['vocab_size']}")
    check(tokens[:256] == [byte_map[b] for b in range(256)], "byte tokens differ from GPT-2's byte map")
    check(tokens[256:259] == list(ref.SPECIALS.values()), f"special tokens {tokens[256:259]}")
    check(list(types[:256]) == [1] * 256 and list(types[256:259]) == [3] * 3, "token types")
    check(field(r, "tokenizer.ggml.merges") == [], "merges must be empty for the byte vocabulary")
    ids = [field(r, f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding")]
    check(ids == [ref.BOS, ref.EOS, ref.PAD], f"special ids {ids}")
    if arch in ("gemma2", "gemma3"):
        check_gemma_metadata(r, m, arch)
    print(f"OK metadata: {arch}, {len(r.fields)} keys, {len(tokens)} tokens")


def main():
    path, model_dir, typ = sys.argv[1:4]
    kiln_dequant = sys.argv[4] if len(sys.argv) > 4 else None
    m = ref.load_kiln_config(model_dir)
    r = GGUFReader(path)
    check(field(r, "GGUF.version") == 3, "GGUF version")
    check_metadata(r, m, typ)

    kiln = ref.kiln_weights(model_dir)
    arch = gguf_arch(m)
    gemma = arch in ("gemma2", "gemma3")
    if gemma:
        shapes = gemma_tensors(m)
    else:
        shapes = {ref.gguf_name(hf): (ref.kiln_name(hf), s) for hf, s in ref.hf_tensor_shapes(m).items()}
    got = {t.name: t for t in r.tensors}
    check(set(got) == set(shapes), f"tensors: extra {set(got) - set(shapes)}, missing {set(shapes) - set(got)}")
    theirs = {}
    if kiln_dequant:
        with safe_open(kiln_dequant, framework="numpy") as f:
            theirs = {k: f.get_tensor(k) for k in f.keys()}
    counts = {}
    f32_values = {}
    for name, t in got.items():
        kiln_name, shape = shapes[name]
        check(tuple(int(x) for x in reversed(t.shape)) == shape, f"{name}: ggml shape {list(t.shape)} for {shape}")
        w = kiln[kiln_name]
        if gemma and name.endswith("norm.weight"):  # llama.cpp multiplies by the stored gain: 1 + w
            w = w.astype(np.float32) + np.float32(1)
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            w = ref.llama_permute(w, m["heads"] if "attn_q" in name else m["kv_heads"])
        rope_tensors = ("attn_q.weight", "attn_k.weight", "attn_q.bias", "attn_k.bias", "attn_q_norm.weight", "attn_k_norm.weight")
        if rotary_dims(m) < m["head_dim"] and name.endswith(rope_tensors):
            heads = 1 if "_norm" in name else m["heads"] if "attn_q" in name else m["kv_heads"]
            w = neox_partial_order(w, heads, m["head_dim"], rotary_dims(m))
        if len(shape) == 1:
            want_type = Q.F32
        elif typ == "q8_0":
            want_type = Q.Q8_0 if shape[1] % 32 == 0 else Q.F32
        else:
            want_type = {"f32": Q.F32, "bf16": Q.BF16}[typ]
        check(t.tensor_type == want_type, f"{name}: type {t.tensor_type.name}, expected {want_type.name}")
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
        if want_type == Q.F32:
            values = np.asarray(t.data).reshape(shape)
            check(np.array_equal(values, w), f"{name}: f32 values differ from kiln's weights")
            f32_values[name] = values
        elif want_type == Q.BF16:
            bits = np.asarray(t.data).view(np.uint16).reshape(shape)
            check(np.array_equal(bits, ref.f32_to_bf16_bits(w)), f"{name}: bf16 bits differ")
            values = ref.bf16_bits_to_f32(bits)
        else:
            raw = np.asarray(t.data)
            check(np.array_equal(raw, quantize(w, Q.Q8_0)), f"{name}: Q8_0 bytes differ from gguf-py's quantizer")
            values = dequantize(raw, Q.Q8_0).reshape(shape)
            err = np.abs(values - w).max() / max(np.abs(w).max(), 1e-30)
            check(err <= 1 / 127 * 0.51 + 1e-3, f"{name}: Q8_0 error {err} beyond half a step")
        if kiln_dequant:
            check(np.array_equal(theirs[name].reshape(shape), values.astype(np.float32)),
                  f"{name}: kiln's dequantization differs from gguf-py's")
    if rotary_dims(m) < m["head_dim"] and typ == "f32":
        check_partial_rotary_scores(f32_values, kiln, m)
    print(f"OK tensors: {len(got)} ({', '.join(f'{n} {k}' for k, n in sorted(counts.items()))})"
          + (", kiln's dequantization equals gguf-py's bit for bit" if kiln_dequant else ""))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Checks a `kiln export gguf` file with the `gguf` package (llama.cpp's gguf-py), against
the kiln model it came from.

usage: check_gguf.py FILE.gguf KILN_MODEL_DIR TYPE [KILN_DEQUANT.safetensors]
  TYPE: f32 | bf16 | q8_0 (what the export was asked for)
  KILN_DEQUANT: kiln's own reading of FILE (GgufFile::read_f32, by GGUF name); each tensor
                must equal gguf-py's dequantization bit for bit.
Checks metadata, tensor names, shapes and types; for Q8_0, that gguf-py's quantizer applied
to kiln's f32 weights gives kiln's bytes exactly; for llama, the q/k permutation.
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


def check_metadata(r, m, typ):
    arch = ref.expected_arch(m)
    check(field(r, "general.architecture") == arch, f"architecture {field(r, 'general.architecture')} != {arch}")
    check(field(r, "general.file_type") == {"f32": 0, "bf16": 32, "q8_0": 7}[typ], "general.file_type")
    want = {"context_length": m["max_seq_len"], "embedding_length": m["hidden"], "block_count": m["layers"],
            "feed_forward_length": m["ffn_hidden"], "attention.head_count": m["heads"],
            "attention.head_count_kv": m["kv_heads"], "attention.key_length": m["head_dim"],
            "attention.value_length": m["head_dim"], "rope.dimension_count": m["head_dim"], "vocab_size": m["vocab_size"]}
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
    print(f"OK metadata: {arch}, {len(r.fields)} keys, {len(tokens)} tokens")


def main():
    path, model_dir, typ = sys.argv[1:4]
    kiln_dequant = sys.argv[4] if len(sys.argv) > 4 else None
    m = ref.load_kiln_config(model_dir)
    r = GGUFReader(path)
    check(field(r, "GGUF.version") == 3, "GGUF version")
    check_metadata(r, m, typ)

    kiln = ref.kiln_weights(model_dir)
    shapes = {ref.gguf_name(hf): (hf, s) for hf, s in ref.hf_tensor_shapes(m).items()}
    got = {t.name: t for t in r.tensors}
    check(set(got) == set(shapes), f"tensors: extra {set(got) - set(shapes)}, missing {set(shapes) - set(got)}")
    theirs = {}
    if kiln_dequant:
        with safe_open(kiln_dequant, framework="numpy") as f:
            theirs = {k: f.get_tensor(k) for k in f.keys()}
    arch = ref.expected_arch(m)
    counts = {}
    for name, t in got.items():
        hf, shape = shapes[name]
        check(tuple(int(x) for x in reversed(t.shape)) == shape, f"{name}: ggml shape {list(t.shape)} for {shape}")
        w = kiln[ref.kiln_name(hf)]
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            w = ref.llama_permute(w, m["heads"] if "attn_q" in name else m["kv_heads"])
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
    print(f"OK tensors: {len(got)} ({', '.join(f'{n} {k}' for k, n in sorted(counts.items()))})"
          + (", kiln's dequantization equals gguf-py's bit for bit" if kiln_dequant else ""))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Checks a `kiln export hf` directory with the Hugging Face `safetensors` and `tokenizers`
packages, against the kiln model it came from.

usage: check_hf_export.py EXPORT_DIR KILN_MODEL_DIR DTYPE
  DTYPE: float32 | bfloat16 | float16 (what the export was asked for)
Prints one OK line per check group; raises (exit 1) on the first mismatch.
"""

import json
import os
import sys

import numpy as np
from safetensors import safe_open
from tokenizers import Tokenizer

sys.path.insert(0, os.path.dirname(__file__))
import kiln_ref as ref  # noqa: E402
from kiln_ref import check  # noqa: E402

ST_DTYPE = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def check_config(out, m):
    cfg = json.load(open(f"{out}/config.json"))
    arch = ref.expected_arch(m)
    classes = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3_moe": "Qwen3MoeForCausalLM", "dots1": "Dots1ForCausalLM"}
    check(cfg["model_type"] == arch and cfg["architectures"] == [classes[arch]], f"architecture {cfg['model_type']} != {arch}")
    want = {"vocab_size": m["vocab_size"], "hidden_size": m["hidden"], "num_hidden_layers": m["layers"],
            "num_attention_heads": m["heads"], "num_key_value_heads": m["kv_heads"], "head_dim": m["head_dim"],
            "intermediate_size": m["ffn_hidden"], "max_position_embeddings": m["max_seq_len"],
            "rms_norm_eps": m["norm_eps"], "tie_word_embeddings": m["tie_embeddings"],
            "hidden_act": "gelu_pytorch_tanh" if m.get("mlp") == "geglu" else "silu",
            "bos_token_id": ref.BOS, "eos_token_id": ref.EOS, "pad_token_id": ref.PAD}
    for k, v in want.items():
        check(cfg[k] == v, f"config.json {k} = {cfg[k]!r}, expected {v!r}")
    check(cfg["rope_theta"] == m["rope_theta"] and cfg["rope_parameters"]["rope_theta"] == m["rope_theta"], "rope_theta")
    check(cfg.get("rope_scaling") is None and cfg["rope_parameters"]["rope_type"] == "default", "rope scaling")
    if arch == "qwen3_moe":  # transformers: layer l sparse unless in mlp_only_layers, if (l + 1) % step == 0
        moe = m["moe"]
        for k, v in {"num_experts": moe["experts"], "num_experts_per_tok": moe["top_k"],
                     "moe_intermediate_size": moe["expert_hidden"], "norm_topk_prob": moe["norm_topk_prob"]}.items():
            check(cfg[k] == v, f"config.json {k} = {cfg[k]!r}, expected {v!r}")
        step, only = cfg["decoder_sparse_step"], set(cfg["mlp_only_layers"])
        sparse = [l for l in range(m["layers"]) if l not in only and (l + 1) % step == 0]
        check(sparse == ref.sparse_layers(m), f"sparse layers {sparse} != {ref.sparse_layers(m)}")
    if arch == "dots1":  # the dense layers first; the shared expert n_shared_experts x moe_intermediate_size
        moe, sparse = m["moe"], ref.sparse_layers(m)
        want = {"n_routed_experts": moe["experts"], "num_experts_per_tok": moe["top_k"],
                "moe_intermediate_size": moe["expert_hidden"], "norm_topk_prob": moe["norm_topk_prob"],
                "n_shared_experts": moe.get("shared_hidden", 0) // moe["expert_hidden"],
                "routed_scaling_factor": moe.get("routed_scaling", 1.0), "n_group": moe.get("groups", 1),
                "topk_group": moe.get("top_groups", 1), "first_k_dense_replace": sparse[0]}
        for k, v in want.items():
            check(cfg[k] == v, f"config.json {k} = {cfg[k]!r}, expected {v!r}")
        check(sparse == list(range(sparse[0], m["layers"])), f"sparse layers {sparse} are not the last ones")
    if arch != "qwen2":
        check(cfg["attention_bias"] is False, "attention_bias")
    if arch != "llama":  # transformers' Qwen2/3, Dots1: layer_types; Qwen3-MoE: every layer or none
        windowed = ref.windowed_layers(m)
        check(cfg["use_sliding_window"] is bool(windowed), f"use_sliding_window with windowed layers {windowed}")
        check(cfg["sliding_window"] == (m["sliding_window"] if windowed else None), "sliding_window")
        if arch in ("qwen2", "qwen3", "dots1"):
            kinds = ["sliding_attention" if l in windowed else "full_attention" for l in range(m["layers"])]
            check(cfg["layer_types"] == kinds, f"layer_types {cfg['layer_types']} != {kinds}")
    gen = json.load(open(f"{out}/generation_config.json"))
    check((gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (ref.BOS, ref.EOS, ref.PAD), "generation_config ids")
    print(f"OK config.json: {cfg['architectures'][0]}, {m['layers']} layers, head_dim {m['head_dim']}")
    return cfg


def weight_files(out):
    index = f"{out}/model.safetensors.index.json"
    if not os.path.exists(index):
        check(os.path.exists(f"{out}/model.safetensors"), "no model.safetensors")
        return None, {None: f"{out}/model.safetensors"}
    idx = json.load(open(index))
    files = sorted(set(idx["weight_map"].values()))
    n = len(files)
    check(n > 1, "an index with a single shard")
    check(files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)], f"shard names {files}")
    check(not os.path.exists(f"{out}/model.safetensors"), "both model.safetensors and shards")
    return idx, {f: f"{out}/{f}" for f in files}


def check_weights(out, model_dir, m, dtype):
    idx, files = weight_files(out)
    kiln = ref.kiln_weights(model_dir)
    shapes = ref.hf_tensor_shapes(m)
    seen, total = {}, 0
    for key, path in files.items():
        with safe_open(path, framework="numpy") as f:
            check(f.metadata() is not None and f.metadata().get("format") == "pt", f"{path}: metadata format != pt")
            for name in f.keys():
                check(name not in seen, f"tensor {name} in two files")
                seen[name] = key
                header, _ = ref.safetensors_header(path)
                info = header[name]
                check(info["dtype"] == ST_DTYPE[dtype], f"{name}: dtype {info['dtype']}")
                check(tuple(info["shape"]) == shapes.get(name), f"{name}: shape {info['shape']} != {shapes.get(name)}")
                total += info["data_offsets"][1] - info["data_offsets"][0]
                src = kiln[ref.kiln_name(name)]
                if dtype == "bfloat16":
                    _, raw = ref.read_raw_tensor(path, name)
                    got = np.frombuffer(raw, dtype=np.uint16).reshape(src.shape)
                    check(np.array_equal(got, ref.f32_to_bf16_bits(src)), f"{name}: bf16 bits differ from RNE rounding")
                elif dtype == "float16":
                    check(np.array_equal(f.get_tensor(name), src.astype(np.float16)), f"{name}: f16 values differ")
                else:
                    check(np.array_equal(f.get_tensor(name), src), f"{name}: values differ from kiln's weights")
    check(set(seen) == set(shapes), f"tensor set differs: extra {set(seen) - set(shapes)}, missing {set(shapes) - set(seen)}")
    if idx is not None:
        check(idx["metadata"]["total_size"] == total, f"index total_size {idx['metadata']['total_size']} != {total}")
        check(idx["weight_map"] == seen, "index weight_map disagrees with the shards' contents")
    print(f"OK weights: {len(seen)} tensors, {dtype}, {len(files)} file(s), {total} bytes, equal to kiln's")


def check_tokenizer(out):
    tok = Tokenizer.from_file(f"{out}/tokenizer.json")
    byte_map = ref.gpt2_bytes_to_unicode()
    vocab = tok.get_vocab(with_added_tokens=True)
    for b, ch in byte_map.items():
        check(vocab[ch] == b, f"byte {b}: token {ch!r} has id {vocab.get(ch)}")
    for i, s in ref.SPECIALS.items():
        check(tok.token_to_id(s) == i, f"special {s} id {tok.token_to_id(s)}")
    check(tok.get_vocab_size(with_added_tokens=True) == 259, "vocabulary size")
    texts = ["Hello, world!", "déjà vu — naïve café", "日本語のテキスト 🚀🔥", "  two  spaces\n\ttab\r\n", "x", "",
             "ends with space ", "a'b's \"quoted\" 123 4567"]
    for text in texts:
        want = list(text.encode("utf-8"))
        enc = tok.encode(text, add_special_tokens=False)
        check(enc.ids == want, f"{text!r}: ids {enc.ids} != bytes {want}")
        check(tok.encode(text).ids == [ref.BOS] + want, f"{text!r}: with specials != BOS + bytes")
        check(tok.decode(want) == text, f"{text!r}: decode gives {tok.decode(want)!r}")
        check(tok.decode([ref.BOS] + want + [ref.EOS]) == text, f"{text!r}: specials not skipped in decode")
    cfg = json.load(open(f"{out}/tokenizer_config.json"))
    check(cfg["tokenizer_class"] == "PreTrainedTokenizerFast", "tokenizer_class")
    check((cfg["bos_token"], cfg["eos_token"], cfg["pad_token"]) == tuple(ref.SPECIALS.values()), "special token texts")
    print(f"OK tokenizer.json: 256 byte tokens + 3 specials; {len(texts)} texts encode to kiln's byte ids and decode back")


def main():
    out, model_dir, dtype = sys.argv[1], sys.argv[2], sys.argv[3]
    m = ref.load_kiln_config(model_dir)
    check_config(out, m)
    check_weights(out, model_dir, m, dtype)
    check_tokenizer(out)


if __name__ == "__main__":
    main()

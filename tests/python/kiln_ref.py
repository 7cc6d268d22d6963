"""Independent reference facts for checking kiln's exports from Python.

Nothing here imports kiln: the name tables, the GPT-2 byte map, bf16 rounding and the
llama.cpp q/k permutation are written out again from their public definitions, so a
mistake in kiln's C++ does not cancel out against the same mistake here.
"""

import json
import struct
import tomllib

import numpy as np
from safetensors import safe_open

BOS, EOS, PAD = 256, 257, 258
SPECIALS = {BOS: "<|bos|>", EOS: "<|eos|>", PAD: "<|pad|>"}


def check(cond, message):
    if not cond:
        raise AssertionError(message)


def load_kiln_config(model_dir):
    with open(f"{model_dir}/config.toml", "rb") as f:
        return tomllib.load(f)["model"]


def gpt2_bytes_to_unicode():
    """GPT-2's bytes_to_unicode (openai/gpt-2 encoder.py)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def sparse_layers(m):
    """The layers whose MLP is the sparse one (model.mlp = "moe", except model.alt_mlp_layers;
    the tests write alt_mlp_layers as a plain comma list)."""
    alt = {int(x) for x in m.get("alt_mlp_layers", "").split(",") if x.strip()}
    return [l for l in range(m["layers"]) if m.get("mlp") == "moe" and l not in alt]


def windowed_layers(m):
    """The layers with model.sliding_window (all but model.full_attention_layers; the tests
    write it as a plain comma list)."""
    if not m.get("sliding_window", 0):
        return []
    full = {int(x) for x in m.get("full_attention_layers", "").split(",") if x.strip()}
    return [l for l in range(m["layers"]) if l not in full]


def expected_arch(m):
    if sparse_layers(m):  # sigmoid_bias routing is DeepSeek-V3's, as dots.llm1 (Dots1) holds it
        return "dots1" if m["moe"].get("router") == "sigmoid_bias" else "qwen3_moe"
    if m["qk_norm"]:
        return "qwen3"
    return "qwen2" if m["attention_bias"] else "llama"


def hf_tensor_shapes(m):
    """HF name -> shape of every tensor a stock Qwen3/Llama/Qwen2 checkpoint of config m holds."""
    d, hd, q, kv, f, v = m["hidden"], m["head_dim"], m["heads"] * m["head_dim"], m["kv_heads"] * m["head_dim"], m["ffn_hidden"], m["vocab_size"]
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not m["tie_embeddings"]:
        shapes["lm_head.weight"] = (v, d)
    sparse = sparse_layers(m)
    for l in range(m["layers"]):
        p = f"model.layers.{l}."
        shapes.update({
            p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
        })
        if l in sparse:  # Qwen3-MoE / Dots1: the router (Dots1: its bias), each expert's SwiGLU, the shared one
            e, fe, fs = m["moe"]["experts"], m["moe"]["expert_hidden"], m["moe"].get("shared_hidden", 0)
            shapes[p + "mlp.gate.weight"] = (e, d)
            if m["moe"].get("router") == "sigmoid_bias":
                shapes[p + "mlp.gate.e_score_correction_bias"] = (e,)
            if fs:
                shapes.update({p + "mlp.shared_experts.gate_proj.weight": (fs, d),
                               p + "mlp.shared_experts.up_proj.weight": (fs, d),
                               p + "mlp.shared_experts.down_proj.weight": (d, fs)})
            for x in range(e):
                shapes.update({p + f"mlp.experts.{x}.gate_proj.weight": (fe, d), p + f"mlp.experts.{x}.up_proj.weight": (fe, d),
                               p + f"mlp.experts.{x}.down_proj.weight": (d, fe)})
        else:
            shapes.update({p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                           p + "mlp.down_proj.weight": (d, f)})
        if m["qk_norm"]:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        if m["attention_bias"]:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
    return shapes


# kiln name <- HF name, written out independently of src/io/hf_names.cpp.
def kiln_name(hf):
    fixed = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "final_norm.weight", "lm_head.weight": "lm_head.weight"}
    if hf in fixed:
        return fixed[hf]
    _, _, l, rest = hf.split(".", 3)
    rest = (rest.replace("input_layernorm", "attn_norm").replace("post_attention_layernorm", "mlp_norm").replace("self_attn.", "attn."))
    return f"layers.{l}.{rest}"


def gguf_name(hf):
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    _, _, l, rest = hf.split(".", 3)
    table = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
             "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
             "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
             "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
             "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
    return f"blk.{l}.{table[rest]}"


def llama_permute(w, n_head):
    """convert_hf_to_gguf.py's LlamaModel.permute: rotate_half pairs -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def f32_to_bf16_bits(x):
    """Round-to-nearest-even float32 -> bfloat16 bits (as torch does), NaN kept quiet."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    rounded[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded


def bf16_bits_to_f32(h):
    return (h.astype(np.uint32) << 16).view(np.float32)


def kiln_weights(model_dir):
    """kiln's own model.safetensors (f32), by kiln name."""
    out = {}
    with safe_open(f"{model_dir}/model.safetensors", framework="numpy") as f:
        for k in f.keys():
            out[k] = f.get_tensor(k)
    return out


def safetensors_header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        return header, 8 + n


def read_raw_tensor(path, name):
    """(dtype string, raw little-endian bytes) of one tensor, for dtypes numpy lacks (BF16)."""
    header, start = safetensors_header(path)
    info = header[name]
    b, e = info["data_offsets"]
    with open(path, "rb") as f:
        f.seek(start + b)
        return info["dtype"], f.read(e - b)

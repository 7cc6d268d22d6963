#!/usr/bin/env python3
"""Oracle for kiln's Gemma 2/3 export (tests/test_export_gemma.cpp): the exported folder run
as transformers' Gemma2ForCausalLM / Gemma3ForCausalLM (text) define the model, in numpy f64,
against the logits kiln computed for the same tokens.

usage: check_gemma_export.py EXPORT_DIR LOGITS.safetensors

LOGITS.safetensors holds "tokens" (int32 [T]) and "logits" (float32 [T, vocab]), kiln's.
Nothing here imports kiln: the model is read from config.json and model.safetensors as
transformers reads them (modeling_gemma2.py / modeling_gemma3.py, transformers 4.53+):
  embedding x sqrt(hidden_size); per layer
    x += post_attention_layernorm(attn(input_layernorm(x)))
    x += post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))
  Gemma's RMSNorm x / sqrt(mean(x^2) + eps) * (1 + w); Gemma 3's q/k norms of the same kind
  per head before RoPE; RoPE rotate_half with rope_theta (Gemma 3's sliding layers:
  rope_local_base_freq); scores x query_pre_attn_scalar^-0.5, then attn_logit_softcapping
  (Gemma 2 only: transformers' Gemma 3 ignores it);
  a sliding layer's query i sees keys j with i - j < sliding_window; the MLP
  down(act(gate(x)) * up(x)) with hidden_activation; the final norm, the tied (or lm_head)
  projection, then final_logit_softcapping.
The largest logit difference over the largest logit must stay below 1e-4 (kiln's f32 against
f64 here); exits non-zero otherwise. Also prints that difference.
"""

import json
import math
import sys

import numpy as np
from safetensors import safe_open


def gemma_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w)


def gelu_pytorch_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


ACT = {"gelu_pytorch_tanh": gelu_pytorch_tanh, "silu": lambda x: x / (1.0 + np.exp(-x))}


def rope(x, positions, theta):
    """x [T, H, D]: rotate_half pairing (j, j + D/2), transformers' default RoPE."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    ang = positions[:, None] * inv_freq[None, :]
    cos = np.concatenate([np.cos(ang), np.cos(ang)], axis=-1)[:, None, :]
    sin = np.concatenate([np.sin(ang), np.sin(ang)], axis=-1)[:, None, :]
    rotated = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], axis=-1)
    return x * cos + rotated * sin


def softcap(x, cap):
    return x if cap is None else np.tanh(x / cap) * cap


def forward(cfg, w, tokens):
    arch = cfg["architectures"][0]
    gemma3 = arch == "Gemma3ForCausalLM"
    assert arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"), arch
    eps, hd = cfg["rms_norm_eps"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    t = len(tokens)
    pos = np.arange(t, dtype=np.float64)
    x = w["model.embed_tokens.weight"][tokens] * math.sqrt(cfg["hidden_size"])
    act = ACT[cfg["hidden_activation"]]
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}."
        sliding = cfg["layer_types"][l] == "sliding_attention"
        h = gemma_norm(x, w[p + "input_layernorm.weight"], eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(t, nh, hd)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(t, nkv, hd)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(t, nkv, hd)
        if gemma3:
            q = gemma_norm(q, w[p + "self_attn.q_norm.weight"], eps)
            k = gemma_norm(k, w[p + "self_attn.k_norm.weight"], eps)
        theta = cfg["rope_local_base_freq"] if gemma3 and sliding else cfg["rope_theta"]
        q, k = rope(q, pos, theta), rope(k, pos, theta)
        rep = nh // nkv
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) * cfg["query_pre_attn_scalar"] ** -0.5
        # Gemma3Attention keeps attn_logit_softcapping in its config and never applies it.
        scores = softcap(scores, None if gemma3 else cfg.get("attn_logit_softcapping"))
        i, j = np.arange(t)[:, None], np.arange(t)[None, :]
        allowed = j <= i
        if sliding:
            allowed &= i - j < cfg["sliding_window"]
        scores = np.where(allowed[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", probs, v).reshape(t, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
        x = x + gemma_norm(o, w[p + "post_attention_layernorm.weight"], eps)
        h = gemma_norm(x, w[p + "pre_feedforward_layernorm.weight"], eps)
        m = (act(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
        x = x + gemma_norm(m, w[p + "post_feedforward_layernorm.weight"], eps)
    x = gemma_norm(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else w["lm_head.weight"]
    return softcap(x @ head.T, cfg.get("final_logit_softcapping"))


def main(out, logits_path):
    cfg = json.load(open(f"{out}/config.json"))
    with safe_open(f"{out}/model.safetensors", framework="numpy") as f:
        w = {k: f.get_tensor(k).astype(np.float64) for k in f.keys()}
    with safe_open(logits_path, framework="numpy") as f:
        tokens = f.get_tensor("tokens").astype(np.int64)
        kiln = f.get_tensor("logits").astype(np.float64)
    ref = forward(cfg, w, tokens)
    if ref.shape != kiln.shape or not np.all(np.isfinite(kiln)):
        print(f"MISMATCH: kiln logits {kiln.shape}, reference {ref.shape}, or non-finite")
        return 1
    error = float(np.max(np.abs(kiln - ref)) / np.max(np.abs(ref)))
    print(f"{cfg['architectures'][0]}: {len(tokens)} tokens, max |kiln - numpy| / max |logit| = {error:.3e}")
    if not error < 1e-4:
        print("MISMATCH: above 1e-4")
        return 1
    print("gemma logits match numpy")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))

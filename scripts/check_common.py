"""Helpers shared by the scripts that check kiln against other implementations
(hf_roundtrip_check.py: transformers; llama_cpp_check.py: llama.cpp)."""

import subprocess
import time

import numpy as np

BOS = 256  # kiln's byte-level tokenizer: bytes 0..255, then BOS, EOS, PAD


def fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def held_out_documents(path, val_fraction, min_bytes, count):
    """kiln's validation documents of a text file (separator: blank line), chosen by the
    same FNV-1a hash as src/data/dataset.cpp."""
    text = open(path, "rb").read()
    threshold = round(val_fraction * 1_000_000)
    docs = [d for d in text.split(b"\n\n") if d.strip()]
    val = [d for d in docs if fnv1a64(d) % 1_000_000 < threshold]
    return [d for d in val if len(d) >= min_bytes][:count], len(val), len(docs)


def run(cmd):
    t = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace")  # samples may cut a UTF-8 character
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stdout}\n{r.stderr}")
    return r.stdout, time.time() - t


def read_toml_model(model_dir):
    import tomllib
    with open(f"{model_dir}/config.toml", "rb") as f:
        return tomllib.load(f)


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def compare(kiln, other):
    """max |diff| / max |other|, mean KL(kiln || other) per position, top-1 agreement."""
    kiln = kiln.astype(np.float64)
    other = other.astype(np.float64)
    rel = float(np.abs(kiln - other).max() / np.abs(other).max())
    lk, lo = log_softmax(kiln), log_softmax(other)
    kl = float((np.exp(lk) * (lk - lo)).sum(-1).mean())
    top1 = float((kiln.argmax(-1) == other.argmax(-1)).mean())
    return {"max_rel_err": rel, "mean_kl": max(kl, 0.0), "top1": top1}


def next_token_loss(logits, ids):
    """Mean of -log p(ids[t+1] | ids[..t]) over t < L-1 and all sequences; logits [S, L, V]."""
    lp = log_softmax(logits[:, :-1, :])
    targets = ids[:, 1:]
    return float(-np.take_along_axis(lp, targets[..., None].astype(np.int64), -1).mean())

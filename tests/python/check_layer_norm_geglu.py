"""Oracle for kiln's LayerNorm and GeGLU CPU forwards (tests/test_ops_grad_layer_norm_geglu.cpp).

Usage: check_layer_norm_geglu.py FILE.safetensors

The file holds the inputs and kiln's outputs in f64 and f32. Here the same outputs are
computed again with numpy in f64, from the public definitions (nothing imports kiln):
  torch.nn.functional.layer_norm(x, (C,), weight, bias, eps): biased variance over the
    last dimension, (x - mean) / sqrt(var + eps) * weight + bias;
  transformers' gelu_pytorch_tanh (torch.nn.functional.gelu(x, approximate="tanh")):
    0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), and GemmaMLP's act(gate) * up.
kiln's f64 outputs must agree to 1e-12 and its f32 outputs to 1e-5, relative to the
largest reference value of each output. Where torch is importable (not in the CI env; the
GPU machine has it) the same outputs are also compared with torch.nn.functional.layer_norm
and transformers' ACT2FN["gelu_pytorch_tanh"] (or torch's gelu(approximate="tanh")
without transformers), run in f64. Exits non-zero on any mismatch.
"""

import math
import sys

import numpy as np
from safetensors import safe_open

try:
    import torch
except ImportError:
    torch = None


def layer_norm(x, weight, bias, eps):
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    y = (x - mean) / np.sqrt(var + eps) * weight
    return y if bias is None else y + bias


def gelu_pytorch_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def geglu(gate_up):
    f = gate_up.shape[1] // 2
    return gelu_pytorch_tanh(gate_up[:, :f]) * gate_up[:, f:]


def torch_references(t, eps):
    """The same outputs from torch itself (f64), where it is installed."""
    try:
        from transformers.activations import ACT2FN

        gelu = ACT2FN["gelu_pytorch_tanh"]
        which = "transformers gelu_pytorch_tanh"
    except ImportError:
        gelu = lambda v: torch.nn.functional.gelu(v, approximate="tanh")  # noqa: E731
        which = "torch gelu(approximate='tanh')"
    x, w, b = (torch.from_numpy(t[k]) for k in ("layer_norm.x", "layer_norm.weight", "layer_norm.bias"))
    gu = torch.from_numpy(t["geglu.gate_up"])
    f = gu.shape[1] // 2
    print(f"also against torch {torch.__version__} layer_norm and {which}")
    return {
        "layer_norm.y": torch.nn.functional.layer_norm(x, (x.shape[1],), w, b, eps).numpy(),
        "layer_norm_nobias.y": torch.nn.functional.layer_norm(x, (x.shape[1],), w, None, eps).numpy(),
        "geglu.out": (gelu(gu[:, :f]) * gu[:, f:]).numpy(),
    }


def compare(t, expected, oracle, failures):
    for name, ref in expected.items():
        for tag, tolerance in (("f64", 1e-12), ("f32", 1e-5)):
            got = t[f"{name}.{tag}"].astype(np.float64)
            if got.shape != ref.shape or not np.all(np.isfinite(got)):
                failures.append(f"{name}.{tag}: shape {got.shape} (expected {ref.shape}) or non-finite values")
                continue
            error = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
            print(f"{name}.{tag} vs {oracle}: max error {error:.3e} of the largest value (tolerance {tolerance:g})")
            if not error <= tolerance:
                failures.append(f"{name}.{tag} vs {oracle}: error {error:.3e} > {tolerance:g}")


def main(path):
    with safe_open(path, framework="np") as f:
        t = {name: f.get_tensor(name) for name in f.keys()}
        eps = float(f.metadata()["eps"])
    x, w, b = t["layer_norm.x"], t["layer_norm.weight"], t["layer_norm.bias"]
    expected = {
        "layer_norm.y": layer_norm(x, w, b, eps),
        "layer_norm_nobias.y": layer_norm(x, w, None, eps),
        "geglu.out": geglu(t["geglu.gate_up"]),
    }
    failures = []
    compare(t, expected, "numpy", failures)
    if torch is not None:
        compare(t, torch_references(t, eps), "torch", failures)
    if failures:
        print("MISMATCH:\n  " + "\n  ".join(failures))
        return 1
    print("layer_norm and geglu match numpy" + (" and torch" if torch is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

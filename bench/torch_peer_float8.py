"""torchao float8 training for bench/torch_peer.py (--float8 tensorwise | rowwise): the
model's dense nn.Linear layers swapped for torchao's Float8Linear
(torchao.float8.convert_to_float8_training with Float8LinearConfig.from_recipe_name) before
torch.compile, as torchtitan's float8 converter does. torchao 0.18.0's recipes:
  tensorwise  dynamic per-tensor scales, e4m3 everywhere, cuBLAS's tensorwise _scaled_mm
              (kiln's train.precision = "fp8_tensorwise" uses e5m2 for gradients);
  rowwise     dynamic per-row scales rounded to powers of two, e4m3, CUTLASS's rowwise kernel.
Kept in bf16 (not swapped): the LM head (torch_peer.py's is F.linear on the tied embedding,
never an nn.Linear) and the MoE router (an nn.Parameter there), and, by name, any Linear
called head / lm_head / output / router / embed in another model; and any Linear whose in or
out features are not multiples of 16 (torch._scaled_mm needs them). The routed experts
(torch._grouped_mm) stay bf16; an MoE model's shared expert (nn.Linear) is swapped.

torchao is not in the GPU machine's venv: scripts/torchao_wheel.sh unpacks the wheel into
.whl/torchao (carry .whl); put it on PYTHONPATH, or leave it there: this module looks in
<repo>/.whl/torchao when the import fails.
"""
import os
import sys

import torch.nn as nn

RECIPES = ("none", "tensorwise", "rowwise")
SKIP_NAMES = ("head", "lm_head", "output", "router", "embed")  # a Linear's own name (last part of its FQN)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def import_torchao():
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        sys.path.insert(0, os.path.join(REPO, ".whl", "torchao"))
        try:
            import torchao.float8  # noqa: F401
        except ImportError as e:
            sys.exit(f"torch_peer: --float8 needs torchao (scripts/torchao_wheel.sh -> .whl/torchao on PYTHONPATH): {e}")
    import torchao
    return torchao


def convert(model, recipe):
    """Swaps model's dense Linears for torchao Float8Linears under recipe (in place, before
    torch.compile). Returns the record for the JSON line: torchao's version, the Linears
    converted, and those kept with why."""
    assert recipe in RECIPES[1:], f"torch_peer: --float8 {recipe!r} ({', '.join(RECIPES)})"
    torchao = import_torchao()
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    converted, kept = [], {}

    def keep_reason(mod, fqn):
        if fqn.split(".")[-1] in SKIP_NAMES:
            return "head/router/embed"
        if mod.in_features % 16 or mod.out_features % 16:
            return "features not multiples of 16"
        return None

    def module_filter_fn(mod, fqn):
        if not isinstance(mod, nn.Linear):
            return False
        reason = keep_reason(mod, fqn)
        if reason:
            kept.setdefault(reason, []).append(fqn)
            return False
        converted.append(fqn)
        return True

    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                               module_filter_fn=module_filter_fn)
    return dict(recipe=recipe, torchao=torchao.__version__, converted=len(converted),
                kept=kept)

#!/usr/bin/env python3
"""CPU checks of bench/torch_peer_k3.py (docs/kda.md, "The PyTorch peer"):

    count CONFIG [--set K=V ...]       the peer's total and active parameters (meta device)
    kda                                chunked KDA vs the token-by-token recurrence, fp64
    loss MODEL_DIR IDS SCORE           the peer's fp32 next-token loss on IDS (input_ids [S, L])
                                       with a kiln model folder's weights, vs `kiln score`'s
                                       loss_sum in SCORE
"""
import sys

import torch

from torch_peer import load_config
from torch_peer_k3 import EXTRA, Model, counts, load_kiln
from torch_peer_kda import kda_chunked, kda_recurrent


def check_kda():
    torch.manual_seed(0)
    b, h, t, dk, dv = 2, 3, 150, 16, 12  # two full chunks and a partial one
    q, k = (torch.nn.functional.normalize(torch.randn(b, h, t, dk, dtype=torch.float64), dim=-1) for _ in range(2))
    v = torch.randn(b, h, t, dv, dtype=torch.float64)
    g = -torch.rand(b, h, t, dk, dtype=torch.float64) * 3  # fast decays: e^G spans ~1e-80 in a chunk
    beta = torch.rand(b, h, t, dtype=torch.float64)
    want = kda_recurrent(q, k, v, g, beta, dk ** -0.5)
    got = kda_chunked(q, k, v, g, beta, dk ** -0.5)
    print(f"kda: chunked vs recurrent fp64, max abs diff {(got - want).abs().max().item():.3e} "
          f"(outputs up to {want.abs().max().item():.3f})")


def check_loss(model_dir, ids_path, score_path):
    from safetensors.torch import load_file
    c = load_config(f"{model_dir}/config.toml", [], EXTRA)
    model = Model(c)
    load_kiln(model, model_dir)
    ids = load_file(ids_path)["input_ids"].long()
    with torch.no_grad():
        logits, _ = model.logits(ids)
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].double().transpose(1, 2), ids[:, 1:], reduction="none")
    peer = nll.sum(1)
    kiln = load_file(score_path)["loss_sum"]
    rel = ((peer - kiln).abs() / kiln.abs()).max().item()
    print(f"loss: peer {peer.tolist()} kiln {kiln.tolist()} max relative diff {rel:.3e}")


def main():
    what = sys.argv[1]
    if what == "count":
        overrides = [a.split("=", 1)[1] if a.startswith("--set=") else a for a in sys.argv[3:] if a != "--set"]
        total, active = counts(load_config(sys.argv[2], overrides, EXTRA))
        print(f"parameters {total} active {active}")
    elif what == "kda":
        check_kda()
    else:
        check_loss(*sys.argv[2:5])


if __name__ == "__main__":
    main()

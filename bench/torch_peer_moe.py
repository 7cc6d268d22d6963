"""The sparse MLP of bench/torch_peer.py, as kiln computes it (src/nn/moe/moe_mlp.cpp): a
router's fp32 logits -> each token's k experts and weights (softmax_topk or sigmoid_bias,
without expert groups), the token copies sorted by expert (stable), the experts' SwiGLU on
the sorted rows with torch._grouped_mm (bf16 operands, fp32 accumulation; Hopper), the
outputs weighted back onto their tokens, an optional shared expert, and the Switch
balance loss when model.moe.aux_loss is set (returned beside the output, 0 otherwise).
sigmoid_bias's bias is a buffer that stays at zero: its update after each step is a
64-element kernel in kiln and left out here."""
import torch
import torch.nn as nn
import torch.nn.functional as F


def moe_defaults():
    """The [model.moe] keys the peer reads, with kiln's defaults (src/config/config.h)."""
    return dict(experts=8, top_k=2, expert_hidden=128, shared_hidden=0, router="softmax_topk", norm_topk_prob=True,
                routed_scaling=1.0, aux_loss=0.0, groups=1)


def grouped(x, w, offsets):
    """Rows of x [n, in] grouped by expert (offsets: each expert's end row) times w_e^T, w [E, out, in]."""
    return torch._grouped_mm(x.bfloat16(), w.bfloat16().transpose(-2, -1), offs=offsets)


class MoeMlp(nn.Module):
    def __init__(self, c):
        super().__init__()
        m = c["moe"]
        d, e, f, s = c["hidden"], m["experts"], m["expert_hidden"], m["shared_hidden"]
        assert m["groups"] == 1, "torch_peer: expert groups (model.moe.groups) are not modelled"
        assert m["router"] in ("softmax_topk", "sigmoid_bias"), m["router"]
        self.m = m
        self.router = nn.Parameter(torch.randn(e, d) * 0.02)
        self.gate_up = nn.Parameter(torch.randn(e, 2 * f, d) * 0.02)  # expert e: gate rows, then up rows
        self.down = nn.Parameter(torch.randn(e, d, f) * 0.02)
        self.register_buffer("bias", torch.zeros(e))
        self.shared_gate_up = nn.Linear(d, 2 * s, bias=False) if s > 0 else None
        self.shared_down = nn.Linear(s, d, bias=False) if s > 0 else None

    def route(self, logits):
        """logits [T, E] fp32 -> expert ids [T, k], weights [T, k] fp32, the distribution [T, E]."""
        m, k = self.m, self.m["top_k"]
        if m["router"] == "softmax_topk":
            probs = logits.softmax(-1)
            weights, ids = probs.topk(k, -1)
            if m["norm_topk_prob"]:
                weights = weights / weights.sum(-1, keepdim=True)
            return ids, weights, probs
        scores = logits.sigmoid()
        ids = (scores + self.bias).topk(k, -1).indices
        weights = scores.gather(-1, ids)
        if m["norm_topk_prob"]:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, weights * m["routed_scaling"], scores / scores.sum(-1, keepdim=True)

    def forward(self, x):
        b, t, d = x.shape
        e, k = self.m["experts"], self.m["top_k"]
        h = x.reshape(-1, d)
        with torch.autocast("cuda", enabled=False):
            ids, weights, probs = self.route(F.linear(h.float(), self.router.float()))
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)  # grouped row r holds pair order[r]
        counts = torch.zeros(e, dtype=torch.int32, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))
        offsets = counts.cumsum(0, dtype=torch.int32)
        gate, up = grouped(h[order // k], self.gate_up, offsets).chunk(2, -1)
        y = grouped(F.silu(gate) * up, self.down, offsets)
        pairs = torch.empty_like(y)
        pairs[order] = y
        out = (pairs.view(-1, k, d).float() * weights.unsqueeze(-1)).sum(1)
        if self.shared_gate_up is not None:
            g, u = self.shared_gate_up(h).chunk(2, -1)
            out = out + self.shared_down(F.silu(g) * u).float()
        aux = 0.0
        if self.m["aux_loss"] > 0:
            share = counts.float() / flat.numel()
            aux = self.m["aux_loss"] * e * (share * probs.mean(0)).sum()
        return out.to(x.dtype).view(b, t, d), aux

"""Kimi Delta Attention for bench/torch_peer_k3.py, as kiln computes it (docs/kda.md,
src/nn/kda_mixer.cpp): q|k|v projections, a causal depthwise short convolution + SiLU, q and
k L2-normed per head, the channel-wise decay g = -exp(A_log) softplus(Wfb Wfa x + dt_bias),
beta = sigmoid(Wb x), the delta rule, and the output RMSNorm'd per head x gain x
sigmoid(Wgb Wga x + b). Each row of the batch is one document (the bench's independent
sequences); kiln's restarts at document boundaries inside a packed row are not modelled.

The delta rule runs chunked in plain torch (chunk 64), written from the recurrence
    S_t = (I - b_t k_t k_t^T) Diag(exp g_t) S_{t-1} + b_t k_t v_t^T,   o_t = scale S_t^T q_t.
With u_t = b_t (v_t - S_{t-1}^T (exp(g_t) * k_t)) it reads S_t = Diag(exp g_t) S_{t-1} + k_t u_t^T,
and within a chunk (G_r: the cumulative log decay from the chunk's start, S_0 its state)
    (I + Diag(b) A) U = Diag(b) (V - (K * e^G) S_0),   A_ri = sum_c k_r k_i e^(G_r - G_i) (i < r)
so U = W_v - W_k S_0 with [W_v, W_k] from one unit-lower-triangular solve (the WY form), and
    O   = scale ((Q * e^G) S_0 + M U),                 M_ri = sum_c q_r k_i e^(G_r - G_i) (i <= r)
    S_C = e^(G_C) * S_0 + (K * e^(G_C - G))^T U.
Every exponent is <= 0 (pairs above the diagonal are masked before exp), so nothing
overflows however fast the decay. The [C, C, d_k] pair decays are the memory cost: eager
materializes them, torch.compile may fuse them into the A and M reductions."""
import torch
import torch.nn as nn
import torch.nn.functional as F

CHUNK = 64


def kda_chunked(q, k, v, g, beta, scale, chunk=CHUNK):
    """q, k, g [B, H, T, dk], v [B, H, T, dv], beta [B, H, T] -> o [B, H, T, dv] (fp32 math
    unless the inputs are fp64); the state starts at zero."""
    with torch.autocast(q.device.type, enabled=False):  # fp32 math under bf16 autocast, as kiln's
        return _kda_chunked(q, k, v, g, beta, scale, chunk)


def _kda_chunked(q, k, v, g, beta, scale, chunk):
    dtype = q.dtype
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    q, k, v, g, beta = (x.to(wide) for x in (q, k, v, g, beta))
    b, h, t, dk = q.shape
    dv = v.shape[-1]
    pad = -t % chunk
    if pad:  # zero rows after the end: k = 0 and beta = 0 leave the state and earlier outputs alone
        q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    n = (t + pad) // chunk
    q, k, v, g = (x.reshape(b, h, n, chunk, x.shape[-1]) for x in (q, k, v, g))
    beta = beta.reshape(b, h, n, chunk, 1)
    G = g.cumsum(-2)  # [B, H, N, C, dk]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # Pair decays e^(G_r - G_i) for i <= r, [B, H, N, C, C, dk]; masked before exp.
    diff = G.unsqueeze(-2) - G.unsqueeze(-3)
    decay = diff.masked_fill(~causal[..., None], float("-inf")).exp()
    A = torch.einsum("...rc,...ic,...ric->...ri", k, k, decay).tril(-1)
    M = torch.einsum("...rc,...ic,...ric->...ri", q, k, decay)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    L = eye + beta * A
    W = torch.linalg.solve_triangular(L, beta * torch.cat((v, k * G.exp()), -1), upper=False, unitriangular=True)
    Wv, Wk = W.split([dv, dk], -1)
    qg = q * G.exp()
    G_last = G[..., -1:, :]  # [B, H, N, 1, dk]
    k_end = k * (G_last - G).exp()
    scan = chunk_scan_eager if EAGER_SCAN else chunk_scan
    o = scan(Wv, Wk, qg, M, G_last, k_end, scale).reshape(b, h, n * chunk, dv)[:, :, :t]
    return o.to(dtype)


def chunk_scan(Wv, Wk, qg, M, G_last, k_end, scale):
    """The sequential part: chunk after chunk, the state S carried -> O [B, H, N, C, dv]."""
    b, h, n, _, dv = Wv.shape
    S = Wv.new_zeros(b, h, Wk.shape[-1], dv)
    out = []
    for i in range(n):
        U = Wv[:, :, i] - Wk[:, :, i] @ S
        out.append(scale * (qg[:, :, i] @ S + M[:, :, i] @ U))
        S = G_last[:, :, i].transpose(-1, -2).exp() * S + k_end[:, :, i].transpose(-1, -2) @ U
    return torch.stack(out, 2)


# compile_blocks_eager_scan sets it: torch.compile then leaves the chunk loop out of its graphs
# (runs it eagerly) instead of unrolling its N iterations forward and backward.
EAGER_SCAN = False
chunk_scan_eager = torch.compiler.disable(chunk_scan)


def kda_recurrent(q, k, v, g, beta, scale):
    """The recurrence token by token (the reference kda_chunked is checked against)."""
    b, h, t, dk = q.shape
    S = q.new_zeros(b, h, dk, v.shape[-1])
    out = []
    for i in range(t):
        kt, bt = k[:, :, i], beta[:, :, i, None]
        S = g[:, :, i].exp().unsqueeze(-1) * S  # Diag(exp g_t) S
        u = bt * (v[:, :, i] - (kt.unsqueeze(-2) @ S).squeeze(-2))
        S = S + kt.unsqueeze(-1) * u.unsqueeze(-2)
        out.append(scale * (q[:, :, i].unsqueeze(-2) @ S).squeeze(-2))
    return torch.stack(out, 2)


class KdaMixer(nn.Module):
    """Parameter names as kiln's layers.N.kda.* (the conv weights [C, K])."""

    def __init__(self, c):
        super().__init__()
        kda = c["kda"]
        d = c["hidden"]
        self.h = kda["heads"] or c["heads"]
        self.dk = kda["head_dim"] or c["head_dim"]
        rank = kda["gate_rank"] or self.dk
        kc = self.h * self.dk
        self.kernel, self.eps = kda["conv_kernel"], c["norm_eps"]
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d, kc, bias=False) for _ in range(3))
        bound = self.kernel ** -0.5
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (
            nn.Parameter(torch.empty(kc, self.kernel).uniform_(-bound, bound)) for _ in range(3))
        self.f_a_proj, self.f_b_proj = nn.Linear(d, rank, bias=False), nn.Linear(rank, kc, bias=False)
        self.b_proj = nn.Linear(d, self.h, bias=False)
        self.A_log = nn.Parameter(torch.empty(self.h).uniform_(1, 16).log())
        dt = torch.empty(kc).uniform_(0.001, 0.1)  # (kiln: log-uniform; the init is not timed)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.g_a_proj, self.g_b_proj = nn.Linear(d, rank, bias=False), nn.Linear(rank, kc, bias=True)
        nn.init.zeros_(self.g_b_proj.bias)
        self.o_norm = nn.Parameter(torch.ones(self.dk))  # loaded as o_norm.weight
        self.o_proj = nn.Linear(kc, d, bias=False)

    def conv(self, x, w):
        """Causal depthwise convolution + SiLU over [B, T, C]."""
        y = F.conv1d(F.pad(x.transpose(1, 2), (self.kernel - 1, 0)), w.unsqueeze(1).to(x.dtype), groups=w.shape[0])
        return F.silu(y.transpose(1, 2))

    def forward(self, x):
        b, t, _ = x.shape
        h, dk = self.h, self.dk
        wide = torch.float64 if x.dtype == torch.float64 else torch.float32  # the delta rule's and the norms' math

        def heads(y):
            return y.view(b, t, h, dk).transpose(1, 2)

        q = heads(self.conv(self.q_proj(x), self.q_conv1d)).to(wide)
        k = heads(self.conv(self.k_proj(x), self.k_conv1d)).to(wide)
        v = heads(self.conv(self.v_proj(x), self.v_conv1d)).to(wide)
        q, k = (y * torch.rsqrt(y.pow(2).sum(-1, keepdim=True) + 1e-6) for y in (q, k))
        graw = heads(self.f_b_proj(self.f_a_proj(x))).to(wide)
        g = -self.A_log.to(wide).exp()[:, None, None] * F.softplus(graw + self.dt_bias.to(wide).view(h, 1, dk))
        beta = self.b_proj(x).to(wide).sigmoid().transpose(1, 2)
        o = kda_chunked(q, k, v, g, beta, dk ** -0.5)  # [B, H, T, dv] fp32
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps) * self.o_norm.to(wide)
        gate = self.g_b_proj(self.g_a_proj(x)).to(wide).sigmoid()
        y = o.transpose(1, 2).reshape(b, t, h * dk) * gate
        return self.o_proj(y.to(x.dtype))

"""Peer timing for kiln's KDA: flash-linear-attention's Triton `chunk_kda` (fla 0.6.0).

Times the delta-rule core only (no projections, conv, norms): forward alone and forward +
backward for each head dim D (K = V = D), with the same shapes as `kiln bench-kda`.

fla 0.6.0 (fla/ops/kda/chunk.py):
    chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
              use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False,
              lower_bound=None, disable_recompute=False, return_intermediate_states=False,
              state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, cp_context=None,
              use_graph=False, max_num_seqs=None, **kwargs)  -> (o [B, T, HV, V], final_state | None)
    q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K] the per-step, per-channel decay in log
    space (not cumsummed; fla cumsums it per chunk in fp32); beta [B, T, HV] post-sigmoid;
    scale defaults to K**-0.5. Here the inputs are what kiln's mixer feeds its delta rule:
    q, k L2-normed per head outside the kernel, g = -exp(A_log) softplus(x + dt_bias), beta =
    sigmoid(x), so every *_in_kernel flag is off and the state starts at zero (none returned).

Offline use: fla is taken from the venv if importable, else from the pure-python wheels in
FLA_WHEELS (folders separated by os.pathsep; default <repo>/.whl/fla and <repo>/.whl/fla-deps,
the latter holding fla-core's own dependencies einops and packaging, used only when the venv
lacks them). Fetch them with
    pip download flash-linear-attention==0.6.0 fla-core==0.6.0 --no-deps -d .whl/fla
    pip download einops packaging --no-deps --only-binary=:all: -d .whl/fla-deps
FLA_UNZIP=1 extracts the wheels to a temporary folder instead of importing from the zips.

    python bench/fla_peer_kda.py --batch 8 --seq 4096 --heads 16 --dims 128,64 --json out.json
prints one JSON line per D (and writes the same lines to --json)."""
import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_WHEELS = os.pathsep.join([os.path.join(REPO, ".whl", "fla"), os.path.join(REPO, ".whl", "fla-deps")])


def die(msg):
    print(f"fla_peer_kda: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def _wheel_paths():
    wheels = []
    for folder in os.environ.get("FLA_WHEELS", DEFAULT_WHEELS).split(os.pathsep):
        if folder:
            wheels += sorted(glob.glob(os.path.join(folder, "*.whl")))
    if os.environ.get("FLA_UNZIP") == "1" and wheels:
        root = tempfile.mkdtemp(prefix="fla_wheels_")
        out = []
        for w in wheels:
            d = os.path.join(root, os.path.basename(w)[:-4])
            with zipfile.ZipFile(w) as z:
                z.extractall(d)
            out.append(d)
        wheels = out
    return wheels


def import_chunk_kda():
    """(chunk_kda, fla version, where fla came from); the carried wheels only when needed."""
    import importlib.util
    added = []
    if importlib.util.find_spec("fla") is None:
        wheels = _wheel_paths()
        if not wheels:
            die(f"fla is not installed and no .whl files in FLA_WHEELS={os.environ.get('FLA_WHEELS', DEFAULT_WHEELS)}")
        for w in wheels:
            name = os.path.basename(w).split("-")[0].lower()
            if name in ("fla_core", "flash_linear_attention"):
                sys.path.insert(0, w)  # fla itself ahead of anything
                added.append(w)
            elif importlib.util.find_spec(name) is None:
                sys.path.append(w)  # a dependency the venv lacks (einops, packaging)
                added.append(w)
    try:
        import fla
        from fla.ops.kda import chunk_kda
    except Exception as e:  # noqa: BLE001 - one clear line, whatever broke
        die(f"cannot import fla.ops.kda.chunk_kda ({type(e).__name__}: {e}); wheels added: {added or 'none'}")
    return chunk_kda, getattr(fla, "__version__", "?"), os.path.dirname(os.path.dirname(fla.__file__))


def make_inputs(B, T, H, D, dtype, gate, seed):
    import torch
    import torch.nn.functional as F
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.float32, generator=gen)

    def l2(x):
        return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)

    q, k = l2(randn(B, T, H, D)), l2(randn(B, T, H, D))
    v = randn(B, T, H, D)
    if gate == "kiln":  # kiln's gate at init: A_log = log U(1, 16) per head, dt_bias = softplus^-1 U(0.001, 0.1)
        A_log = (torch.rand(H, device="cuda", generator=gen) * 15 + 1).log()
        dt = torch.rand(H, D, device="cuda", generator=gen) * 0.099 + 0.001
        dt_bias = dt + torch.log(-torch.expm1(-dt))
        g = -A_log.exp()[:, None] * F.softplus(randn(B, T, H, D) + dt_bias)
    else:  # fla's tests: logsigmoid of a normal
        g = F.logsigmoid(randn(B, T, H, D))
    beta = randn(B, T, H).sigmoid()
    return [x.to(dtype).requires_grad_(True) for x in (q, k, v, g, beta)]


def timed(fn, warmup, iters):
    """Median milliseconds of fn() over iters after warmup, each bracketed by CUDA events."""
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dims", default="128,64", help="head dims D (K = V = D), comma separated")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--gate", default="kiln", choices=["kiln", "logsigmoid"], help="how the random log decay g is drawn")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the JSON lines here")
    a = p.parse_args()

    try:
        import torch
    except Exception as e:  # noqa: BLE001
        die(f"cannot import torch ({type(e).__name__}: {e})")
    chunk_kda, fla_version, fla_from = import_chunk_kda()
    if not torch.cuda.is_available():
        die(f"no CUDA GPU visible to torch {torch.__version__}; chunk_kda needs one (Triton kernels)")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    dims = [int(d) for d in a.dims.split(",") if d.strip()]
    B, T, H = a.batch, a.seq, a.heads
    out = open(a.json, "w") if a.json else None

    for D in dims:
        q, k, v, g, beta = make_inputs(B, T, H, D, dtype, a.gate, a.seed)
        inputs = (q, k, v, g, beta)
        do = torch.randn(B, T, H, D, device="cuda", dtype=dtype)

        def fwd():
            # Inputs require grad, so this is the training forward (it saves what backward needs;
            # fla's inference-only FlashKDA backend is never picked while grad is enabled).
            return chunk_kda(q, k, v, g, beta)[0]

        def fwd_bwd():
            o = chunk_kda(q, k, v, g, beta)[0]
            return torch.autograd.grad(o, inputs, do)  # no .grad accumulation

        # One checked call first: compiles and autotunes, and tells whether the numbers are sane.
        o = fwd()
        grads = torch.autograd.grad(o, inputs, do)
        finite = bool(torch.isfinite(o).all()) and all(bool(torch.isfinite(x).all()) for x in grads)
        assert o.shape == (B, T, H, D), f"unexpected output shape {tuple(o.shape)}"
        del o, grads
        torch.cuda.synchronize()

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fwd_ms = timed(fwd, a.warmup, a.iters)
        peak_fwd = torch.cuda.max_memory_allocated()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        fwd_bwd_ms = timed(fwd_bwd, a.warmup, a.iters)
        peak = torch.cuda.max_memory_allocated()

        rec = {
            "peer": "fla.chunk_kda", "fla_version": fla_version, "B": B, "T": T, "H": H, "D": D,
            "dtype": a.dtype, "fwd_ms": round(fwd_ms, 4), "fwd_bwd_ms": round(fwd_bwd_ms, 4),
            "peak_mem_gib": round(peak / 2**30, 4),  # during fwd+bwd, inputs and dO included
            "peak_mem_fwd_gib": round(peak_fwd / 2**30, 4),
            "inputs_gib": round(base / 2**30, 4),  # q, k, v, g, beta, dO resident before timing
            "finite": finite, "gate": a.gate, "warmup": a.warmup, "iters": a.iters,
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "fla_from": fla_from,
        }
        line = json.dumps(rec)
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()
        del q, k, v, g, beta, do, inputs
        torch.cuda.empty_cache()
    if out:
        out.close()


if __name__ == "__main__":
    main()

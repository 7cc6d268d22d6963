# PyTorch SDPA alone at the three benchmark shapes (causal, bf16, q/k/v in the BSHD memory
# bench/torch_peer.py gives them): forward and forward+backward ms per layer for the default
# dispatch and each forced backend, with kv heads as the model has them and expanded to the
# query heads. Run on the GPU machine with the PyTorch venv: python bench/sdpa_probe.py.
# docs/performance.md compares these with kiln's own attention times (kiln bench's per-op rows).
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
torch.backends.cuda.matmul.allow_tf32 = True
print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version(), torch.cuda.get_device_name())
shapes = {"124M": (32, 1024, 12, 12, 64, 12), "0.6B": (8, 4096, 16, 8, 128, 28), "1.5B": (4, 4096, 16, 8, 128, 28)}
backends = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}
def timeit(fn, n=10, w=3):
    for _ in range(w): fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    e0.record()
    for _ in range(n): fn()
    e1.record(); torch.cuda.synchronize()
    return e0.elapsed_time(e1) / n
for name, (B, S, H, KV, D, L) in shapes.items():
    flops_fwd = 4 * B * H * D * S * S / 2
    for bname, be in backends.items():
        for gqa_expand in ([False, True] if KV != H else [False]):
            q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
            kvh = H if gqa_expand else KV
            k = torch.randn(B, S, kvh, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
            v = torch.randn(B, S, kvh, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
            go = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
            gqa = kvh != H
            def fwd():
                with torch.no_grad():
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            def fb():
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
                o.backward(go)
            try:
                if be is None:
                    tf, tb = timeit(fwd), timeit(fb)
                else:
                    with sdpa_kernel([be]):
                        tf, tb = timeit(fwd), timeit(fb)
            except Exception as ex:
                print(f"{name:5s} {bname:9s} gqa_expand={gqa_expand}: unsupported ({str(ex).splitlines()[0][:80]})")
                continue
            print(f"{name:5s} {bname:9s} kv_heads={kvh:2d}: fwd {tf:7.3f} ms ({flops_fwd/tf/1e9:5.0f} TF/s)  fwd+bwd {tb:7.3f} ms "
                  f"(bwd {tb-tf:7.3f}, {2.5*flops_fwd/(tb-tf)/1e9:5.0f} TF/s)  x{L} layers: {tb*L:7.1f} ms")
            del q, k, v, go
            torch.cuda.empty_cache()

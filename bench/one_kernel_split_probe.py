"""one-off probe: is the one-kernel middle (fwd/bwd) bound by per-program latency? Same tokens, more (shorter) sequences; registers of its kernels (PYTHONPATH=. python bench/one_kernel_split_probe.py)"""
import sys, os, math, torch
sys.path.insert(0, "bench")
from cuda_timing import median_ms
from llm_surgery.ops.pd_select import triton_middle as tm

torch.manual_seed(0)
dev = "cuda"
H, N, K, P = 32, 32, 32, 32
W = K + 2 * N
def inputs(B, L):
    proj = (torch.randn(B, L, H, W, device=dev) * 2).bfloat16()
    u = torch.randn(B, L, H * P, device=dev).bfloat16()
    gy = torch.randn_like(u)
    Bw = torch.randn(H, N, P, 2, device=dev) * 0.1
    C = torch.randn(H, P, N, 2, device=dev) * 0.1
    skip = torch.randn(H, P, device=dev)
    bias = torch.randn(H * N, device=dev)
    Pd = torch.randint(0, N, (H, K, N), device=dev)
    x0 = (torch.zeros(B, H, N, device=dev), torch.zeros(B, H, N, device=dev))
    return proj, u, gy, Bw, C, skip, bias, Pd, x0

def kinfo(kern):
    try:
        for dc in kern.device_caches.values():
            for ck in dc[0].values():
                return f"regs {ck.n_regs} spills {ck.n_spills} smem {ck.metadata.shared}"
    except Exception as e:
        return f"? {e}"
    return "?"

TOK = 32 * 2048
for (B, L) in [(32, 2048), (128, 512), (512, 128), (1024, 64)]:
    proj, u, gy, Bw, C, skip, bias, Pd, x0 = inputs(B, L)
    xs = (torch.empty(B, H, L, N, device=dev), torch.empty(B, H, L, N, device=dev))
    for cfg in [{"chunk": 16, "num_warps": 1}, {"chunk": 16, "num_warps": 2}, {"chunk": 32, "num_warps": 1}]:
        f = lambda: tm.middle_fwd(proj, u, Bw, C, skip, bias, Pd, *x0, states=xs, precision="tf32", config=cfg)
        t = median_ms(f, reps=5)
        print(f"fwd B={B} L={L} {cfg}: {t:.3f} ms  {kinfo(tm._middle_fwd_kernel)}", flush=True)
    gC = torch.zeros(2, H, P, N, device=dev); gs = torch.zeros(H, P, device=dev)
    gB = torch.zeros(2, H, N, P, device=dev); gb = torch.zeros(H * N, device=dev)
    for cfg in [{"chunk": 16, "num_warps": 4}, {"chunk": 16, "num_warps": 2}, {"chunk": 16, "num_warps": 1}]:
        f = lambda: tm.middle_bwd(proj, u, gy, xs, x0, None, Bw, C, skip, bias, Pd, gC, gs, gB, gb, 1.0,
                                  precision="tf32", config=cfg)
        t = median_ms(f, reps=5)
        print(f"bwd B={B} L={L} {cfg}: {t:.3f} ms  {kinfo(tm._middle_bwd_kernel)}", flush=True)
    del proj, u, gy, xs
    torch.cuda.empty_cache()

# the separate-kernel middle, fwd and fwd+bwd, B=32 L=2048, for the same layer sizes
from llm_surgery.layers.flash_pdssm_fused import fused_middle
B, L = 32, 2048
u = torch.randn(B, L, H * P, device=dev).bfloat16().requires_grad_()
Wx = (torch.randn(H * W, H * P, device=dev) * 0.03).bfloat16().requires_grad_()
db = torch.randn(H * N, device=dev).requires_grad_()
M = torch.randn(H, K, N, N, device=dev).requires_grad_()
Bw = (torch.randn(H, N, P, 2, device=dev) * 0.1).requires_grad_()
x0 = torch.zeros(B, H, N, dtype=torch.complex64, device=dev)
C = (torch.randn(H, P, N, 2, device=dev) * 0.1).requires_grad_()
Ds = torch.randn(H, P, device=dev).requires_grad_()
g = torch.randn(B, L, H * P, device=dev).bfloat16()
def fb():
    y, *_ = fused_middle(u, Wx, db, M, Bw, x0, C, Ds)
    y.backward(g)
def fo():
    with torch.no_grad():
        fused_middle(u, Wx, db, M, Bw, x0, C, Ds)
print(f"separate middle fwd {median_ms(fo, reps=5):.3f} ms, fwd+bwd {median_ms(fb, reps=5):.3f} ms", flush=True)
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(3):
        fb()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=22, max_name_column_width=60))

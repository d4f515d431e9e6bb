"""fp32 large-head readout/injection forward kernels: tokens per block and warps, timed; checked against float64."""
import itertools, torch, triton
from triton.testing import do_bench
from llm_surgery.ops.pd_select import triton_readout as tr
torch.manual_seed(0)
dev = "cuda"
for (b, H, N, P) in [(8, 70, 64, 64), (1, 70, 64, 64)]:
    L = 2048
    xre, xim = (torch.randn(b, H, L, N, device=dev) for _ in range(2))
    u = torch.randn(b, L, H * P, device=dev)
    C = torch.randn(H, P, N, 2, device=dev) / N ** 0.5
    Bw = torch.randn(H, N, P, 2, device=dev) / P ** 0.5
    skip = torch.randn(H, P, device=dev)
    u64 = u.double().view(b, L, H, P).permute(0, 2, 1, 3)
    ref_y = xre.double() @ C[..., 0].double().transpose(1, 2) - xim.double() @ C[..., 1].double().transpose(1, 2) + skip.double()[:, None] * u64
    ref_b = u64 @ Bw[..., 0].double().transpose(1, 2)
    print(f"## b={b} H={H} N={N} P={P} L={L}", flush=True)
    for prec, bl, nw in itertools.product(["ieee", "tf32"], [16, 32, 64], [4, 8]):
        y = torch.empty_like(u); bre = torch.empty(b, H, L, N, device=dev); bim = torch.empty_like(bre)
        f1 = lambda: tr._readout_fwd_kernel[(triton.cdiv(L, bl), H, b)](xre, xim, C, skip, u, y, L, H, u.stride(0), u.stride(1), y.stride(0), y.stride(1), N=N, P=P, BLOCK_L=bl, BLOCK_N=64, BLOCK_P=64, PRECISION=prec, num_warps=nw)
        f2 = lambda: tr._injection_fwd_kernel[(triton.cdiv(L, bl), H, b)](u, Bw, bre, bim, L, H, u.stride(0), u.stride(1), N=N, P=P, BLOCK_L=bl, BLOCK_N=64, BLOCK_P=64, PRECISION=prec, num_warps=nw)
        f1(); f2()
        e1 = ((y.double().view(b, L, H, P).permute(0, 2, 1, 3) - ref_y).abs().max() / ref_y.abs().max()).item()
        e2 = ((bre.double() - ref_b).abs().max() / ref_b.abs().max()).item()
        print(f"{prec} block_l={bl} warps={nw}: readout {do_bench(f1, warmup=5, rep=40):.3f} ms injection {do_bench(f2, warmup=5, rep=40):.3f} ms rel.err {max(e1, e2):.1e}", flush=True)

"""fp32 large-head readout/injection backward: launch configs and precision, timed; checked against float64."""
import itertools, torch, triton
from triton.testing import do_bench
from llm_surgery.ops.pd_select import triton_readout as tr
torch.manual_seed(0)
dev = "cuda"
for (b, H, N, P) in [(8, 70, 64, 64), (1, 70, 64, 64)]:
    L = 2048
    xre, xim = (torch.randn(b, H, L, N, device=dev) for _ in range(2))
    gy, u = (torch.randn(b, L, H * P, device=dev) for _ in range(2))
    C = torch.randn(H, P, N, 2, device=dev) / N ** 0.5
    Bw = torch.randn(H, N, P, 2, device=dev) / P ** 0.5
    skip = torch.randn(H, P, device=dev)
    # float64 references
    g64 = gy.double().view(b, L, H, P).permute(0, 2, 1, 3)
    ref_gre = g64 @ C[..., 0].double()
    ref_gC = torch.einsum("bhlp,bhln->hpn", g64, xre.double())
    ref_gu = (gy.double().view(b, L, H, P) * skip.double()).permute(0, 2, 1, 3) + xre.double() @ Bw[..., 0].double() + xim.double() @ Bw[..., 1].double()
    print(f"## b={b} H={H} N={N} P={P} L={L}", flush=True)
    rows = []
    for prec, bl, rep, nw in itertools.product(["ieee", "tf32"], [16, 32, 64], [1, 8], [4, 8]):
        cfg = {"block_l": bl, "repeat": rep, "num_warps": nw}
        try:
            gC = torch.zeros(2, H, P, N, device=dev); gs = torch.zeros(H, P, device=dev)
            gre, gim = tr.readout_bwd(gy, xre, xim, C, u, gC, gs, prec, cfg)
            e1 = ((gre.double() - ref_gre).abs().max() / ref_gre.abs().max()).item()
            e2 = ((gC[0].double() - ref_gC).abs().max() / ref_gC.abs().max()).item()
            gB = torch.zeros(2, H, N, P, device=dev)
            gu = tr.injection_bwd(xre, xim, gy, u, skip, Bw, gB, prec, cfg)
            e3 = ((gu.double().view(b, L, H, P).permute(0, 2, 1, 3) - ref_gu).abs().max() / ref_gu.abs().max()).item()
            t1 = do_bench(lambda: tr.readout_bwd(gy, xre, xim, C, u, gC, gs, prec, cfg), warmup=5, rep=40)
            t2 = do_bench(lambda: tr.injection_bwd(xre, xim, gy, u, skip, Bw, gB, prec, cfg), warmup=5, rep=40)
            rows.append((prec, bl, rep, nw, t1, t2, max(e1, e2, e3)))
            print(f"{prec} block_l={bl} repeat={rep} warps={nw}: readout {t1:.3f} ms injection {t2:.3f} ms rel.err {max(e1,e2,e3):.1e}", flush=True)
        except Exception as e:
            print(f"{prec} {cfg}: {type(e).__name__} {str(e)[:80]}", flush=True)
    for prec in ["ieee", "tf32"]:
        r = [x for x in rows if x[0] == prec]
        print(prec, "best readout", min(r, key=lambda x: x[4])[:5], "best injection", min(r, key=lambda x: x[5])[:4] + (min(r, key=lambda x: x[5])[5],))
    print("default large:", tr.LARGE_HEAD_BWD_CONFIG, flush=True)

"""The Triton kernels of the fused Flash PD-SSM backward, checked and timed at one layer's size, with launch
configurations swept (one device call). The defaults in ops/pd_select/triton_ste.py and triton_readout.py's backward
configs come from this table.

    PYTHONPATH=. python bench/ste_kernels.py [--batch 16 --length 4096 --heads 32 --state 32 --members 32]

Rows: the selector kernel (r) per tile size x warps, in its gather form (float32 layers) and its tensor-core form
(TF32: half-precision layers), the dictionary kernel (G) per segment x token block x warps, the readout's and the
injection's backward (ops/pd_select/triton_readout.py) per token block x blocks per program x warps
(`--readout-only`: those alone), and for scale the pd_transition kernels and the split-plane scan; `--norm-only`:
the gated RMSNorm's backward per tile x warps (rows B*L x heads*head-dim in groups of head-dim). Each is checked
before it is timed (median of CUDA-event timings): the sums against the torch path (float32), the readout's and
injection's configs against the default config's result. Kernels this short read high here (launch gaps count);
A/B a config in the layer before taking it.
"""

from __future__ import annotations

import argparse
import datetime

import torch
from cuda_timing import median_ms as timed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--state", type=int, default=32)
    ap.add_argument("--members", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=32, help="entries per head of u (the gated norm's group)")
    ap.add_argument("--readout-only", action="store_true", help="only the readout's and injection's backward rows")
    ap.add_argument("--norm-only", action="store_true", help="only the gated norm's backward rows")
    args = ap.parse_args()
    import triton

    B, L, H, N, K = args.batch, args.length, args.heads, args.state, args.members
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    print(f"# fused-backward kernels, {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}, {datetime.date.today()}; B={B} L={L} H={H} N={N} K={K}")
    planes = [torch.randn(B, H, L, N, device=dev, generator=g) for _ in range(6)]
    print("\n| kernel | config | ms | max rel err |\n|---|---|---|---|")
    if args.norm_only:
        norm_rows(B * L, H * args.head_dim, args.head_dim, g)
        return
    if not args.readout_only:
        sum_rows(B, L, H, N, K, planes, g)
    readout_rows(B, L, H, N, planes, g)
    if not args.readout_only:
        scale_rows(B, L, H, N, K, planes, g)


def sum_rows(B, L, H, N, K, planes, g):
    """The straight-through sums: the selector kernel (gathers and tensor cores) and the dictionary kernel (uniform
    and skewed selections) per launch configuration, each checked against the torch path."""
    from llm_surgery.ops.pd_select.function import dictionary_grad, selector_grad
    from llm_surgery.ops.pd_select.triton_ste import selector_on_tensor_cores, ste_grads_triton
    dev = "cuda"
    lam, D, x = (planes[0], planes[1]), (planes[2], planes[3]), (planes[4], planes[5])
    x0 = (torch.randn(B, H, N, device=dev, generator=g), torch.randn(B, H, N, device=dev, generator=g))
    kstar = torch.randint(0, K, (B, H, L), device=dev, generator=g)
    P_dict = torch.randint(0, N, (H, K, N), device=dev, generator=g).to(torch.int16)
    lam_c, D_c, x_c = (torch.complex(*p) for p in (lam, D, x))
    x0_c = torch.complex(*x0)
    x_prev = torch.cat([x0_c.unsqueeze(2), x_c[:, :, :-1]], dim=2)
    dx = D_c * x_prev
    G_ref, r_ref = dictionary_grad(kstar, lam_c, dx, K), selector_grad(P_dict, lam_c, dx)
    skewed = kstar.clone()
    skewed[..., : L * 9 // 10] = 3           # one member takes 90% of every head's tokens (as early in training)
    G_skew = dictionary_grad(skewed, lam_c, dx, K)
    del x_prev, dx
    for tile in (1024, 2048, 4096):
        for warps in (1, 2, 4):
            for repeat in (1, 8, 32):
                cfg = {"tile": tile, "num_warps": warps, "repeat": repeat}
                run = lambda: ste_grads_triton(P_dict, kstar, lam, D, x, x0, None, K,  # noqa: E731
                                               selector_config=cfg, parts=("selector",))
                r = run()[1]
                err = ((r - r_ref).abs().max() / r_ref.abs().max()).item()
                print(f"| selector | tile {tile}, {warps} warps, {repeat} blocks per program | {timed(run):.3f} | "
                      f"{err:.1e} |", flush=True)
    if selector_on_tensor_cores(N, "tf32"):
        for block_t in (64, 128):
            for rows in (2, 4, 8):
                for warps in (4, 8):
                    for bf16 in (False, True):
                        cfg = {"block_t": block_t, "rows": rows, "num_warps": warps, "repeat": 1, "bf16": bf16}
                        run = lambda: ste_grads_triton(P_dict, kstar, lam, D, x, x0, None, K,  # noqa: E731
                                                       selector_config=cfg, parts=("selector",), precision="tf32")
                        try:
                            r = run()[1]
                        except Exception as e:  # e.g. out of shared memory at the largest tiles
                            print(f"| selector, tensor cores | {cfg} | failed: {type(e).__name__} | - |")
                            continue
                        err = ((r - r_ref).abs().max() / r_ref.abs().max()).item()
                        print(f"| selector, tensor cores ({'bf16' if bf16 else 'tf32'}) | {block_t} tokens, "
                              f"{rows} rows of Q, {warps} warps | {timed(run):.3f} | {err:.1e} |", flush=True)
    else:   # ste_grads_triton runs the gathers there, whatever config it is given
        print(f"| selector, tensor cores | - | not run at N={N}: the layer keeps the gathers there | - |")
    for name, ks, ref in (("uniform", kstar, G_ref), ("skewed", skewed, G_skew)):
        for seg in (128, 256, 512):
            for bt in (32, 64):
                for warps in (4, 8):
                    cfg = {"seg": seg, "block_t": bt, "num_warps": warps}
                    run = lambda: ste_grads_triton(P_dict, ks, lam, D, x, x0, None, K,  # noqa: E731
                                                   dictionary_config=cfg, parts=("dictionary",))
                    G = run()[0]
                    err = ((G - ref).abs().max() / ref.abs().max()).item()
                    print(f"| dictionary ({name} selection) | seg {seg}, block {bt}, {warps} warps | "
                          f"{timed(run):.3f} | {err:.1e} |", flush=True)


def norm_rows(R, d, group, g):
    """The gated RMSNorm's backward (layers/block_kernels.py) per tile x warps on [R, d] bf16 rows in groups of
    `group`, each checked against the whole-row tile (the former launch), beside its forward for scale."""
    from llm_surgery.layers import block_kernels as bk
    xz = torch.randn(R, 2 * d, device="cuda", dtype=torch.bfloat16, generator=g)
    x, z = xz[:, :d], xz[:, d:]
    w = torch.randn(d, device="cuda", dtype=torch.bfloat16, generator=g)
    go = torch.randn(R, d, device="cuda", dtype=torch.bfloat16, generator=g)
    print(f"| gated norm fwd, rows {R} x {d}, groups of {group} | - | "
          f"{timed(lambda: bk.gated_norm_fwd(x, z, w, group, 1e-6)):.4f} | - |")
    ref = bk.gated_norm_bwd(x, z, w, go, group, 1e-6, config={"tile": 4096, "num_warps": 4})
    for tile in (512, 1024, 2048, 4096):
        for warps in (2, 4, 8):
            cfg = {"tile": tile, "num_warps": warps}
            out = bk.gated_norm_bwd(x, z, w, go, group, 1e-6, config=cfg)
            err = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(out, ref))
            ms = timed(lambda: bk.gated_norm_bwd(x, z, w, go, group, 1e-6, config=cfg))
            print(f"| gated norm bwd | tile {tile}, {warps} warps | {ms:.4f} | {err:.1e} |", flush=True)


def scale_rows(B, L, H, N, K, planes, g):
    """For scale: the pd_transition kernels, the split-plane scan and a copy of one float32 plane."""
    from llm_surgery.ops.pd_scan import cuda as scan_cuda
    from llm_surgery.ops.pd_transition.triton_fused import transition_bwd_triton, transition_fwd_triton
    dev = "cuda"
    P_dict = torch.randint(0, N, (H, K, N), device=dev, generator=g).to(torch.int16)
    r = torch.randn(B, H, L, K, device=dev, generator=g)
    proj = torch.randn(B, L, H, K + 2 * N, device=dev, generator=g).to(torch.bfloat16)
    bias = torch.randn(H * N, device=dev, generator=g)
    D_re, D_im, ks, P = transition_fwd_triton(proj, bias, P_dict, K, N)
    print(f"| transition fwd | - | {timed(lambda: transition_fwd_triton(proj, bias, P_dict, K, N)):.3f} | - |")
    bwd = timed(lambda: transition_bwd_triton(proj, bias, D_re, D_im, r, 1.0, K, N))   # D's planes as dL/dD
    print(f"| transition bwd | - | {bwd:.3f} | - |")
    b_re, b_im = planes[0], planes[1]
    x0c = torch.complex(torch.randn(B, H, N, device=dev, generator=g), torch.randn(B, H, N, device=dev, generator=g))
    print(f"| scan fwd (split planes) | - | "
          f"{timed(lambda: scan_cuda.pd_scan_fwd_cuda_split(P, D_re, D_im, b_re, b_im, x0c)):.3f} | - |")
    xr, xi = scan_cuda.pd_scan_fwd_cuda_split(P, D_re, D_im, b_re, b_im, x0c)
    print(f"| scan bwd (split planes) | - | "
          f"{timed(lambda: scan_cuda.pd_scan_bwd_cuda_split(P, D_re, D_im, x0c, xr, xi, b_re, b_im)):.3f} | - |")
    nbytes = B * H * L * N * 4
    src = torch.empty(nbytes // 4, device=dev)
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src))
    print(f"| copy of one float32 plane ({nbytes / 2**20:.0f} MiB) | - | {ms:.3f} | - |")


def readout_rows(B, L, H, N, planes, g):
    """The readout's and the injection's backward kernels (bf16 layer, TF32 products, head width P = N) per
    launch configuration, each checked against the default configuration's result."""
    from llm_surgery.ops.pd_select import triton_readout as tr
    dev, P = "cuda", N
    gy, u = (torch.randn(B, L, H * P, device=dev, generator=g).to(torch.bfloat16) for _ in range(2))
    C, Bw = (torch.randn(H, P, N, 2, device=dev, generator=g) for _ in range(2))
    skip = torch.randn(H, P, device=dev, generator=g)

    def readout(cfg):
        gC, gskip = torch.zeros(2, H, P, N, device=dev), torch.zeros(H, P, device=dev)
        return (*tr.readout_bwd(gy, planes[4], planes[5], C, u, gC, gskip, "tf32", cfg), gC, gskip)

    def injection(cfg):
        gBw = torch.zeros(2, H, N, P, device=dev)
        return tr.injection_bwd(planes[0], planes[1], gy, u, skip, Bw, gBw, "tf32", cfg), gBw

    blocks = tr._blocks(N, P)
    for name, run, default in (("readout bwd", readout, tr._bwd_config(None, tr.READOUT_BWD_CONFIG, *blocks)),
                               ("injection bwd", injection, tr._bwd_config(None, tr.INJECTION_BWD_CONFIG, *blocks))):
        ref = run(default)
        for block_l in (32, 64, 128):
            for repeat in (1, 4, 8, 16):
                for warps in (2, 4, 8):
                    cfg = {"block_l": block_l, "repeat": repeat, "num_warps": warps}
                    try:
                        out = run(cfg)
                    except Exception as e:  # e.g. out of shared memory at the largest tiles
                        print(f"| {name} | {cfg} | failed: {type(e).__name__} | - |")
                        continue
                    err = max(((o.float() - r.float()).abs().max() / r.float().abs().max()).item()
                              for o, r in zip(out, ref))
                    print(f"| {name} | {block_l} tokens x {repeat} blocks, {warps} warps"
                          f"{' (default)' if cfg == default else ''} | {timed(lambda: run(cfg)):.3f} | {err:.1e} |",
                          flush=True)


if __name__ == "__main__":
    main()

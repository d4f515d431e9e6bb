"""Checks and times the one-kernel middle of FlashPDSSM (ops/pd_select/triton_middle.py) on a GPU, forced at every
length: its output (and gradients, --backward) against the torch reference path in float64, then forward (and
forward + backward) times per launch config, and (--profile) the top kernels of one step.

    python bench/fused_middle.py --batch 32 --lengths 2048 8192 [--backward] [--configs 16x1 32x1 16x2]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_timing import median_ms  # noqa: E402


def check(width: int = 256, L: int = 300, backward: bool = False) -> None:
    """Relative deviation of the fused layer (float32) from the torch path in float64, per b-gate and mask."""
    from llm_surgery.layers.flash_pdssm import FlashPDSSM
    cases = [(g, {}) for g in (None, "sigmoid", "hard", "decay", "off")]
    cases.append(("decay", {"unit_snap": 3e-3, "phase_levels": 12}))
    for gate, opts in cases:
        for masked in (False, True):
            torch.manual_seed(0)
            ref = FlashPDSSM(width, b_gate=gate, x_init_std=0.1, tau=0.8, backend="torch", **opts).cuda().double()
            fused = copy.deepcopy(ref).float()
            fused.backend = "kernel"
            x = torch.randn(40, L, width, device="cuda", dtype=torch.float64)
            mask = torch.ones(40, L, dtype=torch.long, device="cuda")
            mask[0, :5] = 0
            mask[1, -3:] = 0
            m = mask if masked else None
            g = torch.randn_like(x)
            res = []
            for layer, xx in ((ref, x), (fused, x.float())):
                xx = xx.clone().requires_grad_(backward)
                with torch.set_grad_enabled(backward):
                    y, (_, last) = layer(xx, attention_mask=m, return_state=True)
                out = {"y": y.double(), "last": torch.view_as_real(last).double()}
                if backward:
                    y.backward(g.to(y.dtype))
                    out["grad_x"] = xx.grad.double()
                    out.update({n: p.grad.double() for n, p in layer.named_parameters() if p.grad is not None})
                res.append(out)
            rel = {k: ((res[1][k] - v).norm() / v.norm().clamp_min(1e-30)).item() for k, v in res[0].items()}
            worst = max(rel.values())
            print(f"check gate={gate} {opts} mask={masked}: worst rel {worst:.2e}"
                  + ("" if worst < 1e-5 else f"  FAIL {rel}"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--configs", nargs="+", default=["16x1", "32x1", "16x2", "16x4"], help="chunk x warps")
    ap.add_argument("--backward", action="store_true", help="also check and time forward + backward")
    ap.add_argument("--bwd-configs", nargs="+", default=["16x4"], help="backward's chunk x warps")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--profile", action="store_true", help="print the top CUDA kernels of one fwd+bwd per length")
    ap.add_argument("--separate", action="store_true", help="time the separate kernels instead (the default path)")
    args = ap.parse_args()
    from llm_surgery.layers.registry import build_mixer
    from llm_surgery.ops.pd_select import triton_middle
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    triton_middle.CONFIG["min_pairs_per_sm"] = None if args.separate else 0   # the one-kernel path at every length
    if not args.no_check:
        check(backward=args.backward)
    torch.manual_seed(0)
    layer = build_mixer("pdssm", args.width).cuda().to(torch.bfloat16)
    for L in args.lengths:
        x = torch.randn(args.batch, L, args.width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn_like(x)
        for cfg in args.configs:
            chunk, warps = map(int, cfg.split("x"))
            triton_middle.CONFIG.update(chunk=chunk, num_warps=warps)
            with torch.no_grad():
                inf = median_ms(lambda: layer(x), 10, warmup=2)
            print(f"L={L} forward config {cfg}: without autograd {inf:.2f} ms, with autograd "
                  f"{median_ms(lambda: layer(x), 10, warmup=2):.2f} ms", flush=True)
        if not args.backward:
            continue
        triton_middle.CONFIG.update(chunk=int(args.configs[0].split("x")[0]),
                                    num_warps=int(args.configs[0].split("x")[1]))

        def step():
            x.grad = None
            for q in layer.parameters():
                q.grad = None
            layer(x).backward(g)
        for cfg in args.bwd_configs:
            chunk, warps = map(int, cfg.split("x"))
            triton_middle.BWD_CONFIG.update(chunk=chunk, num_warps=warps)
            print(f"L={L} backward config {cfg}: fwd+bwd {median_ms(step, 10, warmup=2):.2f} ms", flush=True)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=50))


if __name__ == "__main__":
    main()

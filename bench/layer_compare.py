"""One mixer layer, forward + backward, side by side: Flash PD-SSM vs Mamba2 (mamba-ssm kernels) vs DeltaNet
(fla kernels), parameter-matched at one model width (registry defaults), bf16, on one GPU.

    PYTHONPATH=. python bench/layer_compare.py --width 1024 --batch 16 --lengths 1024 2048 4096 5120 8192

Prints time per fwd+bwd (median of CUDA-event timings after warm-up) and peak memory above the resting
weights+input, as a markdown table, plus the device, versions and date.
"""

from __future__ import annotations

import argparse
import datetime
import platform

import torch
from cuda_timing import median_ms


def measure(layer, x, iters: int, warmup: int):
    grad = torch.randn_like(x)

    def step():
        x.grad = None
        layer(x).backward(grad)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return median_ms(step, iters, warmup=0), peak


def profile(build_mixer, args) -> None:
    """Where one fwd+bwd of a layer spends its GPU time (the first length of --lengths)."""
    from torch.profiler import ProfilerActivity, profile as tprofile

    torch.manual_seed(0)
    layer = build_mixer(args.profile, args.width).cuda().to(torch.bfloat16)
    L = args.lengths[0]
    x = torch.randn(args.batch, L, args.width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ms, peak = measure(layer, x, args.iters, args.warmup)
    print(f"{args.profile}: {layer.extra_repr() if hasattr(layer, 'extra_repr') else ''}")
    print(f"B={args.batch} L={L} width={args.width}: fwd+bwd {ms:.2f} ms, peak {peak / 2**30:.2f} GiB")
    grad = torch.randn_like(x)
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            layer(x).backward(grad)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=60))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 5120, 8192])
    ap.add_argument("--kinds", nargs="+", default=["pdssm", "mamba2", "deltanet"])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--quick-autotune", action="store_true",
                    help="Triton autotuners keep their leanest working config (saves minutes; untuned timings)")
    ap.add_argument("--pdssm-slice-mib", type=int, default=0,
                    help="batch-slice budget of the fused Flash PD-SSM op in MiB (0: its default)")
    ap.add_argument("--profile", default="", help="kind: print torch.profiler's top CUDA ops of one fwd+bwd and exit")
    args = ap.parse_args()
    from llm_surgery.layers.registry import build_mixer

    if args.pdssm_slice_mib:
        from llm_surgery.ops.pd_select.projected import _ProjectedSelectScan
        _ProjectedSelectScan.SLICE_BYTES = args.pdssm_slice_mib << 20
    if args.quick_autotune:
        from llm_surgery.triton_autotune import quick_autotune
        quick_autotune()
    if args.profile:
        profile(build_mixer, args)
        return

    print(f"# layer fwd+bwd, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}, python {platform.python_version()}, {datetime.date.today()}, "
          f"Triton autotuning {'cut to the leanest config that runs' if args.quick_autotune else 'full'}")
    layers = {}
    for kind in args.kinds:
        torch.manual_seed(0)
        try:
            # mamba2 / deltanet must run their fused kernels here: backend="kernel" raises instead of falling back
            extra = {"backend": "kernel"} if kind in ("mamba2", "deltanet") else {}
            layers[kind] = build_mixer(kind, args.width, **extra).cuda().to(torch.bfloat16)
        except Exception as e:  # report, keep measuring the others
            print(f"{kind}: could not build ({type(e).__name__}: {e})")
    print("| kind | params |\n|---|---|")
    for kind, layer in layers.items():
        print(f"| {kind} | {sum(p.numel() for p in layer.parameters()) / 1e6:.2f} M |")
    print("\n| L | batch | " + " | ".join(f"{k} ms | {k} GiB" for k in layers) + " |")
    print("|---|---|" + "---|---|" * len(layers))
    for L in args.lengths:
        row = [str(L), str(args.batch)]
        for kind, layer in layers.items():
            x = torch.randn(args.batch, L, args.width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            try:
                ms, peak = measure(layer, x, args.iters, args.warmup)
                row += [f"{ms:.2f}", f"{peak / 2**30:.2f}"]
            except Exception as e:
                row += [f"error: {type(e).__name__}", "-"]
                print(f"{kind} L={L}: {type(e).__name__}: {str(e)[:300]}")
            del x
            torch.cuda.empty_cache()
        print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()

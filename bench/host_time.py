"""How much of a layer's time is the host's: for the Flash PD-SSM layer at width 1024 (B=32, L=2048) and at the
surgery host's shape (width 2560, B=1, L=2048), forward and forward + backward, bf16, on one GPU:

  alone    median of CUDA-event timings with a sync after each call: the GPU starts idle, as layer_compare.py times
           every layer, so any stretch where the host issues launches slower than the GPU runs them counts
  queued   ten calls queued behind a sleep kernel: the host runs ahead, so this is the GPU's time alone
  host     wall time of the Python call while a sleep kernel keeps the GPU busy (nothing waits for the GPU)

`alone` - `queued` is the time the GPU waits for the host. Each call also runs once under torch's sync debug mode
(warn), which names any synchronising torch op. With --profile-dir, also a cProfile of the host side and a
torch.profiler chrome trace per case (and width 2048), for where the host time goes.

    PYTHONPATH=. python bench/host_time.py [--profile-dir DIR]

A/B of two versions of the package: run it twice with PYTHONPATH pointing at each tree.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time

import torch

from cuda_timing import median_ms
from layer_compare import build, step_and_forward


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile-dir", default="", help="also write cProfile tables and chrome traces here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/host_time.py: needs a CUDA GPU (it times host against GPU time)")
    cases = [("pdssm", 1024, 32, 2048), ("pdssm", 2560, 1, 2048)]
    if args.profile_dir:
        cases.insert(1, ("pdssm", 2048, 32, 2048))
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    built = {}
    for kind, width, B, L in cases:
        if (kind, width) not in built:
            built[kind, width] = build(kind, width)[1]
        layer = built[kind, width]
        x = torch.randn(B, L, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        step, fwd = step_and_forward(layer, x)
        for name, fn in (("fwd", fwd), ("step", step)):
            for _ in range(4):
                fn()
            torch.cuda.synchronize()
            host = []
            for _ in range(5):   # one call at a time: several could fill the launch queue and block on it
                torch.cuda._sleep(int(2e8))
                t0 = time.perf_counter()
                fn()
                host.append((time.perf_counter() - t0) * 1e3)
                torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode(1)
            fn()
            torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
            alone = median_ms(fn, 10, warmup=0)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(int(1e9))
            s.record()
            for _ in range(10):
                fn()
            e.record()
            e.synchronize()
            print(f"{kind} w{width} B{B} L{L} {name}: alone (synced) median {alone:.3f} ms, queued "
                  f"(GPU-bound) {s.elapsed_time(e) / 10:.3f} ms, host issue {sorted(host)[2]:.3f} ms", flush=True)
            if args.profile_dir:
                profile(fn, os.path.join(args.profile_dir, f"{kind}_w{width}_B{B}_{name}"))
        del x, step, fwd
        torch.cuda.empty_cache()


def profile(fn, stem: str) -> None:
    """cProfile of five calls' host side (stem.cprof.txt) and a chrome trace of two (stem.trace.json)."""
    from torch.profiler import ProfilerActivity, profile as tprofile
    pr = cProfile.Profile()
    for _ in range(5):
        torch.cuda._sleep(int(2e8))
        pr.enable()
        fn()
        pr.disable()
        torch.cuda.synchronize()
    sio = io.StringIO()
    pstats.Stats(pr, stream=sio).sort_stats("tottime").print_stats(25)
    with open(stem + ".cprof.txt", "w") as f:
        f.write(sio.getvalue())
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            fn()
            torch.cuda.synchronize()
    prof.export_chrome_trace(stem + ".trace.json")
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"  {len(kernels) / 2:.0f} GPU events a call", flush=True)


if __name__ == "__main__":
    main()

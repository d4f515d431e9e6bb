"""One way to time GPU work for every bench script: the median of CUDA-event timings after warm-up calls."""

from __future__ import annotations

import torch


def median_ms(fn, reps: int = 10, warmup: int = 2) -> float:
    """Median milliseconds of fn() on the current stream (events around each call, synchronised per call)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]

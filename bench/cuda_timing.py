"""One way to time GPU work for every bench script: CUDA-event timings after warm-up calls, and their median."""

from __future__ import annotations

import torch


def times_ms(fn, reps: int = 10, warmup: int = 2, back_to_back: bool = False) -> list[float]:
    """Sorted milliseconds of `reps` calls of fn() on the current stream, from an event pair around each call,
    after `warmup` untimed calls and a sync.

    Synchronised per call (default): each call starts on an idle GPU, so host time the GPU waits for counts.
    `back_to_back`: no sync between the calls, as the issues' tables were taken (bench_layers.py):
    the host issues a call while the GPU still runs the one before, so a call whose host work is shorter than its
    GPU work is timed by its GPU work."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        if not back_to_back:
            end.synchronize()
        events.append((start, end))
    torch.cuda.synchronize()
    return sorted(start.elapsed_time(end) for start, end in events)


def median_ms(fn, reps: int = 10, warmup: int = 2, back_to_back: bool = False) -> float:
    """Median of `times_ms` (the upper one for an even count)."""
    times = times_ms(fn, reps, warmup, back_to_back)
    return times[len(times) // 2]

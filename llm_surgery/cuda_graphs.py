"""A step replayed from CUDA graphs, one per input shape, for steps whose pace the CPU's kernel launches set.

`GraphedByShape(body)(*tensors)` returns `body(*tensors)`. The first call at a shape runs `body` eagerly on the
capture stream; the second captures it there and replays the graph at once, so no step is skipped or repeated;
later calls copy their inputs into the graph's static ones and replay. Warming up on the capture stream itself
matters: it builds Triton's autotuning choices and the stream's lazy CUDA state (cuBLAS workspaces), which a
capture must not create. Captured on another stream than its warm-up, the backward of a frozen granite-4.0-h-micro
failed with "operation would make the legacy stream depend on a capturing blocking stream" (H100, torch 2.11).

`body` must not synchronise with the host (no `.item()`, no data-dependent shapes), and must read whatever changes
between calls (learning rate, temperature) from device memory: a graph freezes Python numbers and kernel arguments.
All graphs share one memory pool: they never run concurrently, and what lives across calls (parameters, gradients,
optimizer state, static inputs and outputs) is allocated outside them or kept referenced. Outputs are the graph's
own tensors, overwritten by the next call at the same shape: clone what must outlive it. A failed capture (a
kernel that syncs with the host) warns once; shapes without a graph then run eagerly.

A layer that picks its path with a host sync (a mask's padding side) cannot do so in a capture, so it takes its
general path there; `graphed_path()` tells it to take that path in the warm-up call too. Otherwise the warm-up
builds the other path's Triton choices, and the capture compiles and autotunes its own (the trainer warms shapes up
on an all-ones mask: the Mamba2 kind's capture failed with cudaErrorStreamCaptureInvalidated).
"""

from __future__ import annotations

import threading
import warnings
from contextlib import contextmanager
from typing import Callable

import torch

_graphed = threading.local()


def graphed_path() -> bool:
    """Whether the running code is a graphed body (its warm-up or its capture), or any CUDA capture: layers then
    choose their path without looking at the data."""
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    return getattr(_graphed, "active", False) or capturing


@contextmanager
def _in_graphed_body():
    before = getattr(_graphed, "active", False)
    _graphed.active = True
    try:
        yield
    finally:
        _graphed.active = before


class GraphedByShape:
    def __init__(self, body: Callable, name: str = "step"):
        self.body, self.name = body, name
        self.seen: set[tuple] = set()
        self.graphs: dict[tuple, tuple] = {}  # shapes -> (graph, static inputs, outputs)
        self.pool = None
        self.failed: str | None = None  # why a capture failed
        self.stream = torch.cuda.Stream()

    def _on_stream(self, fn):
        current = torch.cuda.current_stream()
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            out = fn()
        current.wait_stream(self.stream)
        return out

    def __call__(self, *tensors: torch.Tensor):
        key = tuple((tuple(t.shape), t.dtype) for t in tensors)
        entry = self.graphs.get(key)
        if entry is None and key not in self.seen:  # first time at this shape: an ordinary call, on the stream
            self.seen.add(key)
            with _in_graphed_body():
                return self._on_stream(lambda: self.body(*tensors))
        if entry is None and self.failed is None:
            try:
                entry = self.graphs[key] = self._capture(tensors)
            except RuntimeError as exc:  # e.g. a kernel that syncs with the host: go on eagerly
                self.failed = f"{type(exc).__name__}: {exc}"[:300]
                warnings.warn(f"{self.name}: CUDA graph capture failed, shapes without a graph now run eagerly: "
                              f"{self.failed}")
                torch.cuda.synchronize()
        if entry is None:
            return self.body(*tensors)
        graph, static, out = entry
        for s, t in zip(static, tensors):
            s.copy_(t, non_blocking=True)
        graph.replay()
        return out

    def _capture(self, tensors) -> tuple:
        static = tuple(t.clone() for t in tensors)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        # thread_local: other threads' CUDA calls are not this capture's (a DataLoader's pin-memory thread
        # allocating pinned memory broke a global-mode capture of the trainer's step)
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"), \
                _in_graphed_body():
            out = self.body(*static)
        self.pool = graph.pool() if self.pool is None else self.pool
        return graph, static, out

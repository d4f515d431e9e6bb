"""A whole training step (forward, backward, gradient clipping, AdamW) replayed as one CUDA graph per input shape.

The state-tracking models are tiny (two layers of width 128 on 256 x <= 41 tokens): an eager step is a few
hundred kernel launches of microseconds each, so the CPU sets the pace and many runs sharing a GPU starve each
other of CPU. Captured once per sequence length, a step is one graph launch.

Capture needs a step without host syncs (the Flash PD-SSM fused op, Mamba2 and DeltaNet kernels have none) and
an optimizer that keeps its state and learning rate on the GPU (AdamW with capturable=True and a tensor lr).
The first step at a new shape runs eagerly (it also warms up Triton's autotuning and lazy CUDA state), the
second captures; the captured graph runs at once, so no step is skipped or repeated. Should a capture fail
(a kernel that syncs with the host), the run warns and goes on eagerly. The graphs of one run share
one memory pool: they never run concurrently, and every tensor that lives across steps (parameters, optimizer
state, the static inputs and the loss) is allocated outside them or kept referenced.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float,
                   tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """One step: fresh gradients (set to None: under capture the graph's backward allocates those it reads),
    cross-entropy, backward, clipping, optimizer step; the loss, detached."""
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(tokens), labels)
    loss.backward()
    if grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return loss.detach()


class GraphedTrainStep:
    """`step(tokens, labels) -> loss` (a device tensor, valid until the next step: clone it to keep it)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float):
        for group in optimizer.param_groups:
            if not group.get("capturable") or not torch.is_tensor(group["lr"]):
                raise ValueError("GraphedTrainStep: the optimizer needs capturable=True and a tensor lr")
        self.model, self.opt, self.grad_clip = model, optimizer, grad_clip
        self.seen: set[tuple] = set()
        self.graphs: dict[tuple, tuple] = {}  # shape -> (graph, static tokens, static labels, loss)
        self.pool = None
        self.failed: str | None = None  # why a capture failed (then shapes without a graph run eagerly)
        self.stream = torch.cuda.Stream()

    def _body(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return optimizer_step(self.model, self.opt, self.grad_clip, tokens, labels)

    def _on_side_stream(self, fn):
        """The eager warm step runs on the stream captures use (as the CUDA-graph docs advise)."""
        current = torch.cuda.current_stream()
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            out = fn()
        current.wait_stream(self.stream)
        return out

    def __call__(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        key = (tuple(tokens.shape), tuple(labels.shape))
        entry = self.graphs.get(key)
        if entry is None and key not in self.seen:  # first time at this shape: an ordinary step
            self.seen.add(key)
            return self._on_side_stream(lambda: self._body(tokens, labels))
        if entry is None and self.failed is None:
            try:
                entry = self.graphs[key] = self._capture(tokens, labels)
            except RuntimeError as exc:  # e.g. a kernel that syncs with the host: keep training, eagerly
                self.failed = f"{type(exc).__name__}: {exc}"[:300]
                warnings.warn(f"GraphedTrainStep: capture failed, shapes without a graph now train eagerly: "
                              f"{self.failed}")
                torch.cuda.synchronize()
        if entry is None:
            return self._body(tokens, labels)
        graph, static_tokens, static_labels, loss = entry
        static_tokens.copy_(tokens, non_blocking=True)
        static_labels.copy_(labels, non_blocking=True)
        graph.replay()
        return loss

    def _capture(self, tokens: torch.Tensor, labels: torch.Tensor) -> tuple:
        static_tokens, static_labels = tokens.clone(), labels.clone()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            loss = self._body(static_tokens, static_labels)
        self.pool = graph.pool() if self.pool is None else self.pool
        return graph, static_tokens, static_labels, loss

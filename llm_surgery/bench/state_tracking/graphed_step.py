"""A whole training step (forward, backward, gradient clipping, AdamW) replayed as one CUDA graph per input shape.

The state-tracking models are tiny (two layers of width 128 on 256 x <= 41 tokens): an eager step is a few
hundred kernel launches of microseconds each, so the CPU sets the pace and many runs sharing a GPU starve each
other of CPU. Captured once per sequence length (`llm_surgery.cuda_graphs`), a step is one graph launch.

Capture needs a step without host syncs (the Flash PD-SSM fused op, Mamba2 and DeltaNet kernels have none) and
an optimizer that keeps its state and learning rate on the GPU (AdamW with capturable=True and a tensor lr).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llm_surgery.cuda_graphs import GraphedByShape


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


class GraphedTrainStep(GraphedByShape):
    """`step(tokens, labels) -> loss` (a device tensor, valid until the next step: clone it to keep it)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float):
        for group in optimizer.param_groups:
            if not group.get("capturable") or not torch.is_tensor(group["lr"]):
                raise ValueError("GraphedTrainStep: the optimizer needs capturable=True and a tensor lr")
        self.model, self.opt, self.grad_clip = model, optimizer, grad_clip
        super().__init__(lambda tokens, labels: optimizer_step(model, optimizer, grad_clip, tokens, labels),
                         name="GraphedTrainStep")

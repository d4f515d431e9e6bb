"""Schedules over the optimizer steps. Learning rate (the paper's): linear warm-up, then constant (Granite 350M/1B)
or cosine decay to a floor of `min_lr_ratio` x lr (Granite 3B/7B, Nemotron-H). PD-SSM temperature: geometric
annealing (`tau_at`)."""

from __future__ import annotations

import math

import torch


def lr_factor(step: int, total_steps: int, warmup_steps: int, schedule: str, min_lr_ratio: float = 0.1) -> float:
    """Multiplier of the peak lr for the update taken at `step` (0-based)."""
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown schedule {schedule!r}; expected 'constant' or 'cosine'")


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, warmup_ratio: float, schedule: str,
                    min_lr_ratio: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR (so its state_dict checkpoints and restores with the run)."""
    warmup = int(round(warmup_ratio * total_steps))
    lr_factor(0, total_steps, warmup, schedule, min_lr_ratio)  # validate now, not at the first step
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, warmup, schedule, min_lr_ratio))


def tau_at(step: int, total_steps: int, tau: float | None, tau_end: float | None) -> float | None:
    """The PD-SSM straight-through temperature for the update at `step` (0-based): geometric from `tau` (None:
    the layer's default, 1.0) at step 0 to `tau_end` at the last step (`FlashPDSSM`'s `tau_schedule`); `tau`
    itself when `tau_end` is None. A function of the step alone, so a resumed run continues the same schedule."""
    from llm_surgery.layers.flash_pdssm import tau_schedule

    if tau_end is None:
        return tau
    return tau_schedule(step, max(1, total_steps - 1), 1.0 if tau is None else tau, tau_end)

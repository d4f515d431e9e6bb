"""Schedules over the optimizer steps. Learning rate (the paper's): linear warm-up, then constant (Granite 350M/1B)
or cosine decay to a floor of `min_lr_ratio` x lr (Granite 3B/7B, Nemotron-H). PD-SSM temperature: geometric
annealing (`tau_at`)."""

from __future__ import annotations

import torch


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, warmup_ratio: float, schedule: str,
                    min_lr_ratio: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    """transformers' schedules: linear warm-up from 0 over round(warmup_ratio * total_steps) updates, then
    constant, or cosine decay to min_lr_ratio x lr at total_steps. A LambdaLR: its state checkpoints with the run."""
    from transformers import get_constant_schedule_with_warmup, get_cosine_with_min_lr_schedule_with_warmup

    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    warmup = int(round(warmup_ratio * total_steps))
    if schedule == "constant":
        return get_constant_schedule_with_warmup(optimizer, warmup)
    if schedule == "cosine":
        return get_cosine_with_min_lr_schedule_with_warmup(optimizer, warmup, total_steps, min_lr_rate=min_lr_ratio)
    raise ValueError(f"unknown schedule {schedule!r}; expected 'constant' or 'cosine'")


def tau_at(step: int, total_steps: int, tau: float | None, tau_end: float | None) -> float | None:
    """The PD-SSM straight-through temperature for the update at `step` (0-based): geometric from `tau` (None:
    the layer's default, 1.0) at step 0 to `tau_end` at the last step (`FlashPDSSM`'s `tau_schedule`); `tau`
    itself when `tau_end` is None. A function of the step alone, so a resumed run continues the same schedule."""
    from llm_surgery.layers.flash_pdssm import tau_schedule

    if tau_end is None:
        return tau
    return tau_schedule(step, max(1, total_steps - 1), 1.0 if tau is None else tau, tau_end)

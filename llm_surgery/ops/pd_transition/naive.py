"""Reference for `pd_transition`: the layer's per-token transition inputs from its projection, in plain torch.

proj [B, L, H, W] holds per head and token: K selector logits | N pre-decay logits a | N phases phi | (any
extra columns, e.g. a b-gate, ignored here). With decay_bias [H, N]:
  sel = proj[..., :K],   |D| = exp(-softplus(a + bias)) = sigmoid(-(a + bias)),   D = |D| e^{i phi}
returned in the scan's layout [B, H, L, *] as float32 (float64 for float64 input); D as (re, im) planes.
At padding steps (mask 0) D is the identity 1 + 0i. FlashPDSSM's two options against length drift:
unit_snap s > 0: |D| = min(1, (1 + s) sigmoid(-(a + bias))); phase_levels Q > 0: phi rounded to a multiple of
2 pi / Q in value, its gradient passed straight through.
"""

from __future__ import annotations

import math

import torch


def snap_magnitude(mag: torch.Tensor, unit_snap: float) -> torch.Tensor:
    """unit_snap s > 0: min(1, (1 + s) |D|), so a magnitude reaches exactly 1; s = 0: |D| unchanged."""
    return (mag * (1 + unit_snap)).clamp(max=1) if unit_snap else mag


def round_phase(phase: torch.Tensor, phase_levels: int) -> torch.Tensor:
    """phase_levels Q > 0: phi rounded to a multiple of 2 pi / Q in value, gradient straight through."""
    if not phase_levels:
        return phase
    step = 2 * math.pi / phase_levels
    return phase + (torch.round(phase / step) * step - phase).detach()


def transition_naive(proj: torch.Tensor, decay_bias: torch.Tensor, K: int, N: int,
                     mask: torch.Tensor | None = None, unit_snap: float = 0.0, phase_levels: int = 0):
    """-> (sel [B,H,L,K], D_re [B,H,L,N], D_im [B,H,L,N]); differentiable in proj and decay_bias."""
    cd = torch.promote_types(proj.dtype, torch.float32)
    p = proj.to(cd).transpose(1, 2)  # [B, H, L, W]
    sel = p[..., :K]
    mag = snap_magnitude(torch.sigmoid(-(p[..., K:K + N] + decay_bias.to(cd)[None, :, None, :])), unit_snap)
    phase = round_phase(p[..., K + N:K + 2 * N], phase_levels)
    D_re, D_im = mag * torch.cos(phase), mag * torch.sin(phase)
    if mask is not None:
        keep = mask.to(torch.bool)[:, None, :, None]
        D_re = torch.where(keep, D_re, torch.ones_like(D_re))
        D_im = torch.where(keep, D_im, torch.zeros_like(D_im))
    return sel, D_re, D_im

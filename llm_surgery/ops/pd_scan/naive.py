"""The PD recurrence as a plain loop over time: the reference every fast path is checked against.

x_t[n] = b_t[n] + sum_{m : P_t[m] = n} D_t[m] * x_{t-1}[m]   (column one-hot A_t = P_t D_t, a scatter-add)
"""

from __future__ import annotations

import torch


def pd_scan_naive(P: torch.Tensor, D: torch.Tensor, b: torch.Tensor, x0: torch.Tensor | None = None) -> torch.Tensor:
    """Loop over time with one scatter-add per step. Differentiable through autograd (slowly)."""
    L = b.shape[-2]
    x = torch.zeros_like(b[..., 0, :]) if x0 is None else x0.to(b.dtype)
    out = []
    P = P.long()
    for t in range(L):
        x = b[..., t, :] + torch.zeros_like(x).scatter_add(-1, P[..., t, :], D[..., t, :] * x)
        out.append(x)
    return torch.stack(out, dim=-2)


def pd_scan_dense(P: torch.Tensor, D: torch.Tensor, b: torch.Tensor, x0: torch.Tensor | None = None) -> torch.Tensor:
    """The same recurrence with explicit dense A_t = P_t D_t (N x N): the definition, for tiny sizes only."""
    N = b.shape[-1]
    A = torch.zeros(*P.shape, N, dtype=D.dtype, device=D.device)  # [..., L, N(rows n), N(cols m)]
    A.scatter_(-2, P.long().unsqueeze(-2), D.unsqueeze(-2))
    x = torch.zeros_like(b[..., 0, :]) if x0 is None else x0.to(b.dtype)
    out = []
    for t in range(b.shape[-2]):
        x = b[..., t, :] + (A[..., t, :, :] @ x.unsqueeze(-1)).squeeze(-1)
        out.append(x)
    return torch.stack(out, dim=-2)

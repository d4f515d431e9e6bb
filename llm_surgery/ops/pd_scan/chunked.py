"""Vectorised PD scan for any device: time is cut into chunks, each chunk is composed as the paper's three
phases do (local scan + composed column map per chunk, carry across chunks, replay), so the Python loop runs
about 2*sqrt(L) times over whole [batch, chunks, N] tensors instead of L times.

Forward is a scatter-add recurrence; its backward is the transposed (gather) recurrence run in reverse time,
computed with the same chunked routine in gather mode. Exact up to float rounding (float64 gives ~1e-15).
"""

from __future__ import annotations

import math

import torch


def default_chunk(L: int) -> int:
    return int(min(256, max(8, 2 ** round(math.log2(max(1.0, math.sqrt(L)))))))


def _chunked_scan(P: torch.Tensor, D: torch.Tensor, b: torch.Tensor, x0: torch.Tensor | None,
                  gather: bool, chunk: int | None = None) -> torch.Tensor:
    """x_t = b_t + A_t x_{t-1} over the last-but-one dim of [F, L, N] tensors, A_t given by (P_t, D_t):
    scatter mode (gather=False): (A x)[n] = sum_{m: P[m]=n} D[m] x[m];  gather mode: (A x)[m] = D[m] x[P[m]].

    Composition: a chunk's cumulative map sends start entry m to pi[m] with scale d[m] (scatter mode), or reads
    start entry rho[m] with scale e[m] (gather mode); both compose by index gathers, only the bias needs the
    scatter or gather of the recurrence itself.
    """
    F, L, N = b.shape
    T = chunk or default_chunk(L)
    C = -(-L // T)
    pad = C * T - L
    idx = torch.arange(N, device=b.device)
    if pad:
        P = torch.cat([P, idx.expand(F, pad, N)], dim=1)
        D = torch.cat([D, D.new_zeros(F, pad, N)], dim=1)
        b = torch.cat([b, b.new_zeros(F, pad, N)], dim=1)
    P = P.reshape(F, C, T, N)
    D = D.reshape(F, C, T, N)
    b = b.reshape(F, C, T, N)

    y = b.new_zeros(F, C, N)
    pos = idx.expand(F, C, N)
    scale = D.new_ones(F, C, N)
    ys, poss, scales = [], [], []
    for j in range(T):  # phase 1: every chunk scans locally from zero and composes its map
        Pj, Dj = P[:, :, j], D[:, :, j]
        if gather:
            y = b[:, :, j] + Dj * y.gather(-1, Pj)
            scale = Dj * scale.gather(-1, Pj)
            pos = pos.gather(-1, Pj)
        else:
            y = b[:, :, j] + torch.zeros_like(y).scatter_add(-1, Pj, Dj * y)
            scale = scale * Dj.gather(-1, pos)
            pos = Pj.gather(-1, pos)
        ys.append(y)
        poss.append(pos)
        scales.append(scale)
    y = torch.stack(ys, dim=2)        # [F, C, T, N]
    pos = torch.stack(poss, dim=2)
    scale = torch.stack(scales, dim=2)

    carry = b.new_zeros(F, N) if x0 is None else x0.to(b.dtype)
    carries = []
    for c in range(C):  # phase 2: the state entering each chunk, sequential over chunks only
        carries.append(carry)
        carry = y[:, c, -1] + _apply(pos[:, c, -1], scale[:, c, -1], carry, gather)
    x_in = torch.stack(carries, dim=1).unsqueeze(2).expand(F, C, T, N)
    x = y + _apply(pos, scale, x_in, gather)  # phase 3: replay the carry through every step's cumulative map
    return x.reshape(F, C * T, N)[:, :L]


def _apply(pos: torch.Tensor, scale: torch.Tensor, v: torch.Tensor, gather: bool) -> torch.Tensor:
    if gather:
        return scale * v.gather(-1, pos)
    return torch.zeros_like(v).scatter_add(-1, pos, scale * v)


def _conj(t: torch.Tensor) -> torch.Tensor:
    return t.conj() if t.is_complex() else t


def scan_forward(P: torch.Tensor, D: torch.Tensor, b: torch.Tensor, x0: torch.Tensor | None,
                 chunk: int | None = None) -> torch.Tensor:
    """Forward on flattened [F, L, N] inputs (P int64)."""
    return _chunked_scan(P, D, b, x0, gather=False, chunk=chunk)


def scan_backward(P: torch.Tensor, D: torch.Tensor, x0: torch.Tensor | None, x: torch.Tensor,
                  grad_x: torch.Tensor, chunk: int | None = None):
    """Gradients (grad_D, grad_b, grad_x0) of the forward scan, on flattened [F, L, N] tensors.

    lam_t = g_t + conj(D_{t+1}) * lam_{t+1}[P_{t+1}] runs backwards in time: flipped, it is a forward gather
    scan whose step j uses the transition of original time L-j.
    """
    F, L, N = x.shape
    idx = torch.arange(N, device=x.device).expand(F, 1, N)
    Pf, Df = P.flip(1), _conj(D).flip(1)
    Q = torch.cat([idx, Pf[:, :-1]], dim=1)
    c = torch.cat([Df.new_zeros(F, 1, N), Df[:, :-1]], dim=1)
    lam = _chunked_scan(Q, c, grad_x.flip(1), None, gather=True, chunk=chunk).flip(1)
    x_prev = torch.cat([(x.new_zeros(F, 1, N) if x0 is None else x0.to(x.dtype).unsqueeze(1)), x[:, :-1]], dim=1)
    lam_at_dest = lam.gather(-1, P)
    grad_D = _conj(x_prev) * lam_at_dest
    grad_x0 = _conj(D[:, 0]) * lam_at_dest[:, 0] if x0 is not None else None
    return grad_D, lam, grad_x0

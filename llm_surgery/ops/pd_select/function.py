"""Flash PD-SSM's hard selection with straight-through gradients, in O(B*L*H*N + H*K*N*N) memory.

Forward (hard): P_dict[h,k,m] = argmax_n M[h,k,n,m]; k* = argmax_k sel; P_t = P_dict[h, k*]; x = pd_scan.
Backward: the gradients of the dense surrogate in `naive.py` (paper, Proposition 2), computed without ever
building an N x N matrix per token: with lam = dL/db and dx_t = D_t * x_{t-1},
  G[h,k]      = sum_{tokens with k*=k} Re(conj(lam_t) outer dx_t)           (grouped outer products)
  r[b,h,t,k]  = sum_m Re(conj(lam_t[P_dict[h,k,m]]) * dx_t[m])               (one gather-dot per member)
then the tempered-softmax Jacobians turn G into dL/dM and r into dL/dsel.
"""

from __future__ import annotations

import math

import torch

from .. import fast_path
from ..pd_scan import check_pd_inputs, pd_scan, pd_scan_backward


def column_argmax(M: torch.Tensor) -> torch.Tensor:
    """[H,K,N,N] dictionary logits -> [H,K,N] int16 destinations (the column one-hot matrices)."""
    return M.argmax(dim=-2).to(torch.int16)


def gather_transitions(P_dict: torch.Tensor, kstar: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """P_dict [H,K,N], k* [B,H,L] -> P_t [B,H,L,N] (int16) with no N x N intermediate.
    Where mask [B,L] is 0 (padding) the transition is the identity."""
    H = P_dict.shape[0]
    heads = torch.arange(H, device=kstar.device).view(1, H, 1)
    P = P_dict[heads, kstar]
    if mask is not None:
        ident = torch.arange(P.shape[-1], device=P.device, dtype=P.dtype)
        P = torch.where(mask.to(torch.bool)[:, None, :, None], P, ident)
    return P


def _real_dot_parts(t: torch.Tensor) -> torch.Tensor:
    """Stack real and imaginary parts along the token dim so Re(conj(a) b) becomes a plain real dot."""
    return torch.cat([t.real, t.imag], dim=-2) if t.is_complex() else t


def dictionary_grad(kstar: torch.Tensor, lam: torch.Tensor, dx: torch.Tensor, K: int) -> torch.Tensor:
    """G[h,k,n,m] = sum_{b,t: k*=k} Re(conj(lam[b,h,t,n]) dx[b,h,t,m]), as one matmul per (head, member)."""
    B, H, L, N = lam.shape
    G = torch.zeros(H, K, N, N, dtype=lam.real.dtype if lam.is_complex() else lam.dtype, device=lam.device)
    ks = kstar.permute(1, 0, 2).reshape(H, B * L)
    lam_h = lam.permute(1, 0, 2, 3).reshape(H, B * L, N)
    dx_h = dx.permute(1, 0, 2, 3).reshape(H, B * L, N)
    order = torch.argsort(ks, dim=-1, stable=True)
    counts = torch.stack([torch.bincount(ks[h], minlength=K) for h in range(H)]).tolist()
    for h in range(H):
        lam_s = lam_h[h].index_select(0, order[h])
        dx_s = dx_h[h].index_select(0, order[h])
        for k, (a, c) in enumerate(zip(torch.split(lam_s, counts[h]), torch.split(dx_s, counts[h]))):
            if a.shape[0]:
                G[h, k] = _real_dot_parts(a).transpose(0, 1) @ _real_dot_parts(c)
    return G


def selector_grad(P_dict: torch.Tensor, lam: torch.Tensor, dx: torch.Tensor) -> torch.Tensor:
    """r[b,h,t,k] = sum_m Re(conj(lam[b,h,t,P_dict[h,k,m]]) dx[b,h,t,m]), one [B,H,L,N] temporary at a time."""
    B, H, L, N = lam.shape
    K = P_dict.shape[1]
    r = []
    for k in range(K):
        idx = P_dict[:, k].long().view(1, H, 1, N).expand(B, H, L, N)
        prod = lam.gather(-1, idx).conj() * dx if lam.is_complex() else lam.gather(-1, idx) * dx
        r.append(prod.real.sum(-1) if prod.is_complex() else prod.sum(-1))
    return torch.stack(r, dim=-1)


def straight_through_tau(tau, where: str):
    """tau as the straight-through backward takes it: a scalar tensor as it is (`FlashPDSSM.tau_held`, checked
    where it is set), a number as a float, refused unless positive and finite."""
    if isinstance(tau, torch.Tensor):
        return tau
    if not (math.isfinite(tau) and tau > 0):
        raise ValueError(f"{where}: tau must be a positive finite number, got {tau}")
    return float(tau)


def softmax_jacobian_apply(logits: torch.Tensor, grad: torch.Tensor, tau: float | torch.Tensor,
                           dim: int) -> torch.Tensor:
    """Vector-Jacobian product of softmax(logits / tau) along dim (tau a number or a scalar tensor)."""
    cd = torch.promote_types(logits.dtype, torch.float32)
    s = torch.softmax(logits.to(cd) / tau, dim=dim)
    g = grad.to(cd)
    return (s * (g - (s * g).sum(dim, keepdim=True)) / tau).to(logits.dtype)


def _ste_grads(M, sel, P_dict, kstar, lam, D, x, x0, mask, tau):
    """(dL/dM, dL/dsel): G and r from the Triton kernels on CUDA (dx rebuilt inside them), else in torch."""
    if fast_path.cuda_fast_path(lam, triton=True):
        from .triton_ste import ste_grads_triton
        G, r = ste_grads_triton(P_dict, kstar, lam, D, x, x0, mask, M.shape[1])
    else:
        x_prev = torch.cat([torch.zeros_like(x[:, :, :1]) if x0 is None else x0.unsqueeze(2), x[:, :, :-1]], dim=2)
        dx = D * x_prev
        if mask is not None:  # padding steps used the identity, not a dictionary member: no STE signal there
            dx = dx * mask.to(dx.real.dtype)[:, None, :, None]
        G, r = dictionary_grad(kstar, lam, dx, M.shape[1]), selector_grad(P_dict, lam, dx)
    return softmax_jacobian_apply(M, G, tau, dim=-2), softmax_jacobian_apply(sel, r, tau, dim=-1)


class _PDSelectScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, M, sel, D, b, x0, tau, mask):
        P_dict = column_argmax(M)
        kstar = sel.argmax(-1)
        P = gather_transitions(P_dict, kstar, mask)
        with torch.no_grad():
            x = pd_scan(P, D, b, x0, check_values=False)   # argmaxes: in range by construction
        ctx.save_for_backward(M, sel, D, x0, x, P_dict, kstar, mask)
        ctx.tau = tau
        return x

    @staticmethod
    def backward(ctx, grad_x):
        M, sel, D, x0, x, P_dict, kstar, mask = ctx.saved_tensors
        P = gather_transitions(P_dict, kstar, mask)
        gD, lam, gx0 = pd_scan_backward(P, D, x0, x, grad_x, check_values=False)
        gM, gsel = _ste_grads(M, sel, P_dict, kstar, lam, D, x, x0, mask, ctx.tau)
        return gM, gsel, gD, lam, gx0, None, None


def pd_select_scan(M: torch.Tensor, sel: torch.Tensor, D: torch.Tensor, b: torch.Tensor,
                   x0: torch.Tensor | None = None, tau: float | torch.Tensor = 1.0,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
    """Hard-selected PD scan with straight-through gradients for the dictionary M and the selector logits.

    M [H,K,N,N] real; sel [B,H,L,K] real; D, b [B,H,L,N] (real or complex, same dtype); x0 [B,H,N];
    mask [B,L] (0 = padding: that step's transition is the identity, whatever is selected). tau: a number, or a
    scalar tensor read when the backward runs (`FlashPDSSM.tau_held`; its value is checked where it is set).
    """
    if M.dim() != 4 or M.shape[-1] != M.shape[-2]:
        raise ValueError(f"pd_select_scan: M must be [H, K, N, N], got {tuple(M.shape)}")
    H, K, N, _ = M.shape
    if b.dim() != 4 or b.shape[1] != H or b.shape[-1] != N:
        raise ValueError(f"pd_select_scan: b must be [B, H={H}, L, N={N}], got {tuple(b.shape)}")
    if sel.shape != b.shape[:3] + (K,):
        raise ValueError(f"pd_select_scan: sel must be {tuple(b.shape[:3] + (K,))} ([B, H, L, K]), "
                         f"got {tuple(sel.shape)}")
    tau = straight_through_tau(tau, "pd_select_scan")
    check_pd_inputs(torch.zeros((), dtype=torch.int16, device=b.device).expand(b.shape), D, b, x0,
                    check_values=False)
    if mask is not None and mask.shape != (b.shape[0], b.shape[2]):
        raise ValueError(f"pd_select_scan: mask must be [B, L] = {(b.shape[0], b.shape[2])}, got {tuple(mask.shape)}")
    return _PDSelectScan.apply(M, sel, D, b, x0, tau, mask)

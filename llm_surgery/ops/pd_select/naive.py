"""Dense reference of Flash PD-SSM's straight-through selection: builds the L x N x N surrogate transition
matrices explicitly, so autograd gives the gradients the fast function must reproduce. Tiny sizes only."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def straight_through(hard: torch.Tensor, soft: torch.Tensor) -> torch.Tensor:
    """Forward value `hard`, gradient of `soft`."""
    return hard + soft - soft.detach()


def pd_select_scan_dense(M: torch.Tensor, sel: torch.Tensor, D: torch.Tensor, b: torch.Tensor,
                         x0: torch.Tensor | None = None, tau: float = 1.0) -> torch.Tensor:
    """M [H,K,N,N] (rows n, columns m), sel [B,H,L,K], D/b [B,H,L,N], x0 [B,H,N] -> x [B,H,L,N].

    P_t = sum_k w_k Pi_k with w = ST(onehot(argmax sel), softmax(sel/tau)) and
    Pi_k = ST(column-one-hot(argmax_n M_k), softmax(M_k/tau, over rows)).
    """
    N = M.shape[-1]
    Pi_hard = F.one_hot(M.argmax(dim=-2), N).transpose(-1, -2).to(M.dtype)  # [H,K,N(rows),N(cols)]
    Pi = straight_through(Pi_hard, torch.softmax(M / tau, dim=-2))
    w_hard = F.one_hot(sel.argmax(-1), sel.shape[-1]).to(sel.dtype)
    w = straight_through(w_hard, torch.softmax(sel / tau, dim=-1))  # [B,H,L,K]
    P = torch.einsum("bhlk,hknm->bhlnm", w, Pi).to(D.dtype)  # [B,H,L,N,N]
    x = torch.zeros_like(b[:, :, 0]) if x0 is None else x0
    out = []
    for t in range(b.shape[2]):
        x = b[:, :, t] + (P[:, :, t] @ (D[:, :, t] * x).unsqueeze(-1)).squeeze(-1)
        out.append(x)
    return torch.stack(out, dim=2)

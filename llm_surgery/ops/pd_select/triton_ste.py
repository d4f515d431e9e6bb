"""Triton kernels for the two straight-through gradients of the hard selection (see function.py):

  r[b,h,t,k]  = sum_m Re(conj(lam[b,h,t,P_dict[h,k,m]]) * dx[b,h,t,m])   one program per (token block, head, batch):
                lam and dx are loaded once, every member's gather happens in registers (tl.gather).
  G[h,k,n,m]  = sum_{tokens with k*=k} Re(conj(lam[n]) dx[m])            tokens sorted by (head, k*), then one
                program per (head, member, slice of SEG tokens, output tile) runs a GEMM over its slice with
                tl.dot and adds it into G atomically. Slicing matters: selections are often skewed (early in
                training one member takes most tokens of a head), and one program per member would then walk
                all B*L tokens alone.

Both read lam and dx once (plus the sort's index), so the backward of the selection costs about as much memory
traffic as one more pass over the state, instead of K passes. Used on CUDA when Triton imports.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _selector_grad_kernel(lam_ptr, dx_ptr, p_ptr, r_ptr, L,
                          s_b, s_h, s_l, s_n, r_sb, r_sh, r_sl,
                          K: tl.constexpr, N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
                          COMPLEX: tl.constexpr):
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    n = tl.arange(0, BLOCK_N)
    mask = (t[:, None] < L) & (n[None, :] < N)
    off = b * s_b + h * s_h + t[:, None] * s_l + n[None, :] * s_n
    lre = tl.load(lam_ptr + off, mask=mask, other=0.0)
    dre = tl.load(dx_ptr + off, mask=mask, other=0.0)
    if COMPLEX:
        lim = tl.load(lam_ptr + off + 1, mask=mask, other=0.0)
        dim = tl.load(dx_ptr + off + 1, mask=mask, other=0.0)
    for k in range(K):
        idx = tl.load(p_ptr + (h * K + k) * N + n, mask=n < N, other=0).to(tl.int32)
        idx2 = tl.broadcast_to(idx[None, :], (BLOCK_T, BLOCK_N))
        acc = tl.gather(lre, idx2, axis=1) * dre
        if COMPLEX:
            acc += tl.gather(lim, idx2, axis=1) * dim
        tl.store(r_ptr + b * r_sb + h * r_sh + t * r_sl + k, tl.sum(acc, axis=1), mask=t < L)


@triton.jit
def _dictionary_grad_kernel(lam_ptr, dx_ptr, order_ptr, start_ptr, g_ptr, L, T,
                            s_b, s_h, s_l, s_n, TILES,
                            K: tl.constexpr, N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
                            SEG: tl.constexpr, COMPLEX: tl.constexpr):
    hk = tl.program_id(0)
    piece = tl.program_id(1)
    tile = tl.program_id(2)
    tile_n = tile // TILES
    tile_m = tile - tile_n * TILES
    h = hk // K
    k = hk - h * K
    first = tl.load(start_ptr + h * (K + 1) + k)
    last = tl.load(start_ptr + h * (K + 1) + k + 1)
    begin = first + piece * SEG
    end = tl.minimum(last, begin + SEG)
    n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tile_m * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, BLOCK_T)
    acc = tl.zeros((BLOCK_N, BLOCK_N), dtype=tl.float32)
    for s in range(begin, end, BLOCK_T):
        valid = s + j < end
        tok = tl.load(order_ptr + h * T + s + j, mask=valid, other=0)
        bb = tok // L
        ll = tok - bb * L
        row = bb * s_b + h * s_h + ll * s_l
        ln = row[:, None] + n[None, :] * s_n
        dm = row[:, None] + m[None, :] * s_n
        lmask = valid[:, None] & (n[None, :] < N)
        dmask = valid[:, None] & (m[None, :] < N)
        a = tl.load(lam_ptr + ln, mask=lmask, other=0.0)
        c = tl.load(dx_ptr + dm, mask=dmask, other=0.0)
        acc += tl.dot(tl.trans(a), c, input_precision="ieee")
        if COMPLEX:
            a = tl.load(lam_ptr + ln + 1, mask=lmask, other=0.0)
            c = tl.load(dx_ptr + dm + 1, mask=dmask, other=0.0)
            acc += tl.dot(tl.trans(a), c, input_precision="ieee")
    out = g_ptr + hk * N * N + n[:, None] * N + m[None, :]
    tl.atomic_add(out, acc, mask=(n[:, None] < N) & (m[None, :] < N) & (begin < end), sem="relaxed")


def _planes(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A float32 view with element strides, and whether it is complex (imaginary part at offset +1)."""
    if t.is_complex():
        return torch.view_as_real(t.to(torch.complex64).contiguous()), True
    return t.float().contiguous(), False


def ste_grads_triton(P_dict: torch.Tensor, kstar: torch.Tensor, lam: torch.Tensor, dx: torch.Tensor, K: int):
    """(G [H,K,N,N] float32, r [B,H,L,K] float32) for CUDA tensors; lam, dx [B,H,L,N] real or complex."""
    B, H, L, N = lam.shape
    lam_f, cplx = _planes(lam)
    dx_f, _ = _planes(dx)
    s_b, s_h, s_l, s_n = (s for s in lam_f.stride()[:4])
    P = P_dict.to(torch.int32).contiguous()
    block_n = max(16, triton.next_power_of_2(N))
    r = torch.empty(B, H, L, K, device=lam.device, dtype=torch.float32)
    block_t = max(1, min(64, 8192 // block_n))
    _selector_grad_kernel[(triton.cdiv(L, block_t), H, B)](
        lam_f, dx_f, P, r, L, s_b, s_h, s_l, s_n, *r.stride()[:3],
        K=K, N=N, BLOCK_N=block_n, BLOCK_T=block_t, COMPLEX=cplx, num_warps=4)

    T = B * L
    keys = kstar.permute(1, 0, 2).reshape(H, T)
    order = torch.argsort(keys, dim=-1, stable=True).to(torch.int32).contiguous()  # token = b * L + l
    counts = torch.zeros(H, K, device=lam.device, dtype=torch.int64).scatter_add_(1, keys, torch.ones_like(keys))
    starts = torch.cat([counts.new_zeros(H, 1), counts.cumsum(1)], dim=1).to(torch.int32).contiguous()  # [H, K+1]
    G = torch.zeros(H, K, N, N, device=lam.device, dtype=torch.float32)
    bn = min(64, block_n)
    seg = 512
    pieces = max(1, triton.cdiv(int(counts.max()), seg))   # one host sync: the grid must cover the largest member
    tiles = triton.cdiv(N, bn)
    _dictionary_grad_kernel[(H * K, pieces, tiles * tiles)](
        lam_f, dx_f, order, starts, G, L, T, s_b, s_h, s_l, s_n, tiles,
        K=K, N=N, BLOCK_N=bn, BLOCK_T=32, SEG=seg, COMPLEX=cplx, num_warps=4)
    return G, r

"""Triton kernels for `pd_transition` (maths and layout in naive.py). One program per (token block, head, batch).

forward:  proj (bf16/fp32, read once) -> D_re, D_im [B,H,L,N] float32, k* [B,H,L] (argmax of the selector
          logits, first index on ties as torch.argmax) and P_t = P_dict[h, k*] [B,H,L,N] int16 (the identity at
          padding steps). Replaces a float32 copy of the projection, its slices, sigmoid, polar, argmax and
          the transition gather: about ten passes over state-sized tensors in torch.
backward: (dL/dD planes, r = the selector's straight-through sums [B,H,L,K]) -> dL/dproj in proj's dtype and
          dL/d decay_bias. The tempered-softmax Jacobian of the selector, the polar and sigmoid derivatives and
          the write into the projection's interleaved layout happen in registers; without it autograd filled a
          zero tensor of the projection's size for each of the three slices and added them up.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _tokens(L, H, W, BLOCK_T: tl.constexpr):
    """This program's batch b, head h, tokens t [BLOCK_T] (and which exist), the offsets of their rows in the
    projection [B, L, H, W] and their sequence-major index (b, h, t) in the [B, H, L, *] outputs."""
    h = tl.program_id(1)
    b = tl.program_id(2)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row = ((b.to(tl.int64) * L + t) * H + h) * W
    seq = (b.to(tl.int64) * H + h) * L + t
    return b, h, t, t < L, row, seq


@triton.jit
def polar_parts(proj_ptr, bias, row, n, tmask, snap_scale, phase_step, K: tl.constexpr, N: tl.constexpr,
                SNAP: tl.constexpr, LEVELS: tl.constexpr):
    """(|D|, d|D|/da, cos phi, sin phi, a) tiles [T, BLOCK_N] of the rows `row` (offsets of each token's head
    block), a = decay logit + `bias` (the head's [BLOCK_N] float32 decay bias, loaded once by the caller).
    SNAP: |D| = min(1, snap_scale * sigmoid(-a)); LEVELS: phi rounded to a multiple of phase_step. The one home of
    D_t's maths on the GPU: these kernels and the one-kernel middle (ops/pd_select/triton_middle.py) call it."""
    valid = tmask[:, None] & (n[None, :] < N)
    a = tl.load(proj_ptr + row[:, None] + K + n[None, :], mask=valid, other=0.0).to(tl.float32)
    a += bias[None, :]
    phase = tl.load(proj_ptr + row[:, None] + K + N + n[None, :], mask=valid, other=0.0).to(tl.float32)
    mag = 1.0 / (1.0 + tl.exp(a))  # sigmoid(-a) = exp(-softplus(a))
    dmag = -mag * (1.0 - mag)
    if SNAP:
        dmag = tl.where(mag * snap_scale <= 1.0, dmag * snap_scale, 0.0)
        mag = tl.minimum(mag * snap_scale, 1.0)
    if LEVELS:
        phase = tl.floor(phase / phase_step + 0.5) * phase_step
    return mag, dmag, tl.cos(phase), tl.sin(phase), a


@triton.jit
def _transition_fwd_kernel(proj_ptr, bias_ptr, mask_ptr, pdict_ptr, dre_ptr, dim_ptr, kstar_ptr, p_ptr, L, H, W,
                           snap_scale, phase_step, K: tl.constexpr, N: tl.constexpr, BLOCK_K: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, HAS_MASK: tl.constexpr,
                           SNAP: tl.constexpr, LEVELS: tl.constexpr):
    b, h, t, tmask, row, seq = _tokens(L, H, W, BLOCK_T)
    k = tl.arange(0, BLOCK_K)
    n = tl.arange(0, BLOCK_N)
    sel = tl.load(proj_ptr + row[:, None] + k[None, :], mask=tmask[:, None] & (k[None, :] < K),
                  other=float("-inf")).to(tl.float32)
    kstar = tl.argmax(sel, axis=1, tie_break_left=True)
    bias = tl.load(bias_ptr + h * N + n, mask=n < N, other=0.0).to(tl.float32)
    mag, _, cos, sin, _ = polar_parts(proj_ptr, bias, row, n, tmask, snap_scale, phase_step, K, N, SNAP, LEVELS)
    d_re = mag * cos
    d_im = mag * sin
    valid = tmask[:, None] & (n[None, :] < N)
    P = tl.load(pdict_ptr + (h * K + kstar[:, None]) * N + n[None, :], mask=valid, other=0)
    if HAS_MASK:
        keep = (tl.load(mask_ptr + b * L + t, mask=tmask, other=1) != 0)[:, None]
        d_re = tl.where(keep, d_re, 1.0)
        d_im = tl.where(keep, d_im, 0.0)
        P = tl.where(keep, P, n[None, :])
    out = seq[:, None] * N + n[None, :]
    tl.store(dre_ptr + out, d_re, mask=valid)
    tl.store(dim_ptr + out, d_im, mask=valid)
    tl.store(p_ptr + out, P.to(tl.int16), mask=valid)
    tl.store(kstar_ptr + seq, kstar.to(tl.int64), mask=tmask)


@triton.jit
def _transition_bwd_kernel(proj_ptr, bias_ptr, mask_ptr, gre_ptr, gim_ptr, r_ptr, gproj_ptr, gbias_ptr, L, H, W,
                           tau_ptr, snap_scale, phase_step, K: tl.constexpr, N: tl.constexpr, BLOCK_K: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr,
                           HAS_MASK: tl.constexpr, SNAP: tl.constexpr, LEVELS: tl.constexpr):
    b, h, t, tmask, row, seq = _tokens(L, H, W, BLOCK_T)
    k = tl.arange(0, BLOCK_K)
    n = tl.arange(0, BLOCK_N)
    kvalid = tmask[:, None] & (k[None, :] < K)
    # selector: dL/dsel = s * (r - sum_k s r) / tau with s = softmax(sel / tau)
    inv_tau = 1.0 / tl.load(tau_ptr)
    sel = tl.load(proj_ptr + row[:, None] + k[None, :], mask=kvalid, other=float("-inf")).to(tl.float32) * inv_tau
    s = tl.exp(sel - tl.max(sel, axis=1)[:, None])
    s = tl.where(kvalid, s / tl.sum(s, axis=1)[:, None], 0.0)
    r = tl.load(r_ptr + seq[:, None] * K + k[None, :], mask=kvalid, other=0.0)
    g_sel = s * (r - tl.sum(s * r, axis=1)[:, None]) * inv_tau
    # D = |D| (cos phi + i sin phi), |D| = sigmoid(-a) (or its snapped form): chain rule from the planes'
    # gradients; a rounded phase passes its gradient straight through
    bias = tl.load(bias_ptr + h * N + n, mask=n < N, other=0.0).to(tl.float32)
    mag, dmag, cos, sin, _ = polar_parts(proj_ptr, bias, row, n, tmask, snap_scale, phase_step, K, N, SNAP, LEVELS)
    valid = tmask[:, None] & (n[None, :] < N)
    out = seq[:, None] * N + n[None, :]
    g_re = tl.load(gre_ptr + out, mask=valid, other=0.0).to(tl.float32)
    g_im = tl.load(gim_ptr + out, mask=valid, other=0.0).to(tl.float32)
    g_mag = g_re * cos + g_im * sin
    g_phase = mag * (g_im * cos - g_re * sin)
    g_a = g_mag * dmag
    if HAS_MASK:  # padding steps used the identity: nothing flows back from them
        keep = (tl.load(mask_ptr + b * L + t, mask=tmask, other=1) != 0)[:, None]
        g_sel = tl.where(keep, g_sel, 0.0)
        g_a = tl.where(keep, g_a, 0.0)
        g_phase = tl.where(keep, g_phase, 0.0)
    g_a = tl.where(valid, g_a, 0.0)
    dtype = gproj_ptr.dtype.element_ty
    tl.store(gproj_ptr + row[:, None] + k[None, :], g_sel.to(dtype), mask=kvalid)
    tl.store(gproj_ptr + row[:, None] + K + n[None, :], g_a.to(dtype), mask=valid)
    tl.store(gproj_ptr + row[:, None] + K + N + n[None, :], g_phase.to(dtype), mask=valid)
    if BLOCK_E > 0:  # columns this op does not read (e.g. the b-gate): their gradient from here is zero
        e = tl.arange(0, BLOCK_E)
        zero = tl.zeros((BLOCK_T, BLOCK_E), dtype=dtype)
        tl.store(gproj_ptr + row[:, None] + K + 2 * N + e[None, :], zero,
                 mask=tmask[:, None] & (K + 2 * N + e[None, :] < W))
    tl.atomic_add(gbias_ptr + h * N + n, tl.sum(g_a, axis=0), mask=n < N, sem="relaxed")


def _launch_shape(L: int, H: int, B: int, K: int, N: int):
    block_k, block_n = triton.next_power_of_2(K), triton.next_power_of_2(N)
    block_t = max(1, min(64, 4096 // max(block_k, block_n)))
    return block_k, block_n, block_t, (triton.cdiv(L, block_t), H, B)


def _check(proj, decay_bias, K, N):
    if proj.dim() != 4 or proj.shape[-1] < K + 2 * N:
        raise ValueError(f"pd_transition: proj must be [B, L, H, W >= K + 2N = {K + 2 * N}], got {tuple(proj.shape)}")
    if decay_bias.numel() != proj.shape[2] * N:
        raise ValueError(f"pd_transition: decay_bias must hold H * N = {proj.shape[2] * N} values, "
                         f"got {decay_bias.numel()}")
    return proj.contiguous(), decay_bias.contiguous()


def _drift_options(unit_snap: float, phase_levels: int):
    """Kernel arguments of FlashPDSSM's unit_snap and phase_levels (naive.py): (scale, step, SNAP, LEVELS)."""
    if unit_snap < 0 or phase_levels < 0:
        raise ValueError(f"pd_transition: unit_snap and phase_levels must be >= 0, got {unit_snap}, {phase_levels}")
    step = 2 * math.pi / phase_levels if phase_levels else 1.0
    return 1.0 + float(unit_snap), step, bool(unit_snap), bool(phase_levels)


def transition_fwd_triton(proj, decay_bias, P_dict, K: int, N: int, mask=None, unit_snap: float = 0.0,
                          phase_levels: int = 0):
    """proj [B,L,H,W], decay_bias [H*N], P_dict [H,K,N] -> (D_re, D_im, k* int64 [B,H,L], P int16 [B,H,L,N])."""
    proj, decay_bias = _check(proj, decay_bias, K, N)
    B, L, H, W = proj.shape
    D_re = torch.empty(B, H, L, N, device=proj.device, dtype=torch.float32)
    D_im = torch.empty_like(D_re)
    P = torch.empty(B, H, L, N, device=proj.device, dtype=torch.int16)
    kstar = torch.empty(B, H, L, device=proj.device, dtype=torch.int64)
    if B * L == 0:
        return D_re, D_im, kstar, P
    block_k, block_n, block_t, grid = _launch_shape(L, H, B, K, N)
    mask_t = mask.to(torch.int8).contiguous() if mask is not None else kstar
    scale, step, snap, levels = _drift_options(unit_snap, phase_levels)
    _transition_fwd_kernel[grid](proj, decay_bias, mask_t, P_dict.to(torch.int32).contiguous(), D_re, D_im, kstar, P,
                                 L, H, W, scale, step, K=K, N=N, BLOCK_K=block_k, BLOCK_N=block_n, BLOCK_T=block_t,
                                 HAS_MASK=mask is not None, SNAP=snap, LEVELS=levels, num_warps=4)
    return D_re, D_im, kstar, P


def tau_in_memory(tau, device) -> torch.Tensor:
    """The straight-through temperature as the float32 scalar the backward kernels load: a tensor given (the
    layer's `tau_held`, which a CUDA graph replays with its current value) as it is, a number as a new one."""
    if isinstance(tau, torch.Tensor):
        return tau if tau.dtype == torch.float32 and tau.device == device else tau.to(device, torch.float32)
    return torch.full((), float(tau), dtype=torch.float32, device=device)


def transition_bwd_triton(proj, decay_bias, gD_re, gD_im, r, tau, K: int, N: int, mask=None,
                          unit_snap: float = 0.0, phase_levels: int = 0):
    """(dL/dproj [B,L,H,W] in proj's dtype, dL/d decay_bias in its dtype and shape) from dL/dD planes
    [B,H,L,N] and the selector's straight-through sums r [B,H,L,K]."""
    proj, bias_c = _check(proj, decay_bias, K, N)
    B, L, H, W = proj.shape
    gproj = torch.empty_like(proj)
    gbias = torch.zeros(H * N, device=proj.device, dtype=torch.float32)
    if B * L:
        block_k, block_n, block_t, grid = _launch_shape(L, H, B, K, N)
        extra = W - K - 2 * N
        mask_t = mask.to(torch.int8).contiguous() if mask is not None else gbias
        scale, step, snap, levels = _drift_options(unit_snap, phase_levels)
        _transition_bwd_kernel[grid](proj, bias_c, mask_t, gD_re.contiguous(), gD_im.contiguous(), r.contiguous(),
                                     gproj, gbias, L, H, W, tau_in_memory(tau, proj.device), scale, step, K=K, N=N,
                                     BLOCK_K=block_k, BLOCK_N=block_n,
                                     BLOCK_E=triton.next_power_of_2(extra) if extra else 0, BLOCK_T=block_t,
                                     HAS_MASK=mask is not None, SNAP=snap, LEVELS=levels, num_warps=4)
    return gproj, gbias.to(decay_bias.dtype).view(decay_bias.shape)

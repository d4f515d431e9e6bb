"""Triton kernels for the per-head matrix products around the scan in `layers/flash_pdssm_fused.py`, one program
per (token block, head, sequence), reading u, y and their gradients in the layer's own [b, L, H*P] layout:

  injection forward:  b = (B_re u, B_im u) as float32 planes
  readout forward:    y = x_re C_re^T - x_im C_im^T + D_skip * u
  readout backward:   dL/dx = (g C_re, -g C_im) as planes; dL/dC += (g^T x_re, -g^T x_im); dL/dD_skip += sum g * u
  injection backward: dL/du (before x_proj) = g * D_skip + gb_re B_re + gb_im B_im;  dL/dB += (gb_re^T u, gb_im^T u)

In torch each of these was a handful of batched products over float32 copies of u and g in the scan's [b, H, L, *]
layout, plus the transposes, casts and sums between them. Weight gradients are summed per program over
REPEAT token blocks and added atomically. Products run as tl.dot in float32 ("ieee") or TF32 (half layers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_ste import _tile


@triton.jit
def _rows(L, H, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, blk):
    h = tl.program_id(1)
    b = tl.program_id(2)
    t = blk * BLOCK_L + tl.arange(0, BLOCK_L)
    return h, b, t, tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_P)


@triton.jit
def _head_cols(b, t, h, p, s_b, s_l, P: tl.constexpr):
    """Offsets of head h's P columns at tokens t of sequence b in a [b, L, H*P] tensor (strides s_b, s_l, 1)."""
    return b.to(tl.int64) * s_b + t[:, None].to(tl.int64) * s_l + h * P + p[None, :]


@triton.jit
def _readout_fwd_kernel(xre_ptr, xim_ptr, c_ptr, skip_ptr, u_ptr, y_ptr, L, H, su_b, su_l, sy_b, sy_l,
                        N: tl.constexpr, P: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_P: tl.constexpr, PRECISION: tl.constexpr):
    h, b, t, n, p = _rows(L, H, BLOCK_L, BLOCK_N, BLOCK_P, tl.program_id(0))
    tm = t < L
    xo = ((b.to(tl.int64) * H + h) * L + t[:, None]) * N + n[None, :]
    xm = tm[:, None] & (n[None, :] < N)
    x_re = tl.load(xre_ptr + xo, mask=xm, other=0.0).to(tl.float32)
    x_im = tl.load(xim_ptr + xo, mask=xm, other=0.0).to(tl.float32)
    cw = c_ptr + ((h * P + p[None, :]) * N + n[:, None]) * 2                  # C[h, p, n, :] as [n, p]
    cmask = (n[:, None] < N) & (p[None, :] < P)
    y = tl.dot(x_re, tl.load(cw, mask=cmask, other=0.0).to(tl.float32), input_precision=PRECISION)
    y -= tl.dot(x_im, tl.load(cw + 1, mask=cmask, other=0.0).to(tl.float32), input_precision=PRECISION)
    pm = tm[:, None] & (p[None, :] < P)
    u = tl.load(u_ptr + _head_cols(b, t, h, p, su_b, su_l, P), mask=pm, other=0.0).to(tl.float32)
    y += tl.load(skip_ptr + h * P + p, mask=p < P, other=0.0).to(tl.float32)[None, :] * u
    tl.store(y_ptr + _head_cols(b, t, h, p, sy_b, sy_l, P), y.to(y_ptr.dtype.element_ty), mask=pm)


@triton.jit
def _injection_fwd_kernel(u_ptr, bw_ptr, bre_ptr, bim_ptr, L, H, su_b, su_l, N: tl.constexpr, P: tl.constexpr,
                          BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
                          PRECISION: tl.constexpr):
    h, b, t, n, p = _rows(L, H, BLOCK_L, BLOCK_N, BLOCK_P, tl.program_id(0))
    tm = t < L
    u = tl.load(u_ptr + _head_cols(b, t, h, p, su_b, su_l, P),
                mask=tm[:, None] & (p[None, :] < P), other=0.0).to(tl.float32)
    bw = bw_ptr + ((h * N + n[None, :]) * P + p[:, None]) * 2                 # B[h, n, p, :] as [p, n]
    wmask = (p[:, None] < P) & (n[None, :] < N)
    xo = ((b.to(tl.int64) * H + h) * L + t[:, None]) * N + n[None, :]
    xm = tm[:, None] & (n[None, :] < N)
    b_re = tl.dot(u, tl.load(bw, mask=wmask, other=0.0).to(tl.float32), input_precision=PRECISION)
    b_im = tl.dot(u, tl.load(bw + 1, mask=wmask, other=0.0).to(tl.float32), input_precision=PRECISION)
    tl.store(bre_ptr + xo, b_re.to(bre_ptr.dtype.element_ty), mask=xm)
    tl.store(bim_ptr + xo, b_im.to(bim_ptr.dtype.element_ty), mask=xm)


@triton.jit
def _readout_bwd_kernel(gy_ptr, xre_ptr, xim_ptr, c_ptr, u_ptr, gre_ptr, gim_ptr, gc_ptr, gskip_ptr, L, H,
                        sg_b, sg_l, su_b, su_l, REPEAT, N: tl.constexpr, P: tl.constexpr, BLOCK_L: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, PRECISION: tl.constexpr):
    h = tl.program_id(1)
    n = tl.arange(0, BLOCK_N)
    p = tl.arange(0, BLOCK_P)
    cw = c_ptr + ((h * P + p[:, None]) * N + n[None, :]) * 2                  # C[h, p, n, :] as [p, n]
    cmask = (p[:, None] < P) & (n[None, :] < N)
    c_re = tl.load(cw, mask=cmask, other=0.0).to(tl.float32)
    c_im = tl.load(cw + 1, mask=cmask, other=0.0).to(tl.float32)
    gc_re = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    gc_im = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    gskip = tl.zeros((BLOCK_P,), dtype=tl.float32)
    for r in range(REPEAT):
        h, b, t, n, p = _rows(L, H, BLOCK_L, BLOCK_N, BLOCK_P, tl.program_id(0) * REPEAT + r)
        tm = t < L
        pm = tm[:, None] & (p[None, :] < P)
        g = tl.load(gy_ptr + _head_cols(b, t, h, p, sg_b, sg_l, P), mask=pm, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + _head_cols(b, t, h, p, su_b, su_l, P), mask=pm, other=0.0).to(tl.float32)
        gskip += tl.sum(g * u, axis=0)
        xo = ((b.to(tl.int64) * H + h) * L + t[:, None]) * N + n[None, :]
        xm = tm[:, None] & (n[None, :] < N)
        tl.store(gre_ptr + xo, tl.dot(g, c_re, input_precision=PRECISION).to(gre_ptr.dtype.element_ty), mask=xm)
        tl.store(gim_ptr + xo, (-tl.dot(g, c_im, input_precision=PRECISION)).to(gim_ptr.dtype.element_ty), mask=xm)
        gt = tl.trans(g)
        x_re = tl.load(xre_ptr + xo, mask=xm, other=0.0).to(tl.float32)
        x_im = tl.load(xim_ptr + xo, mask=xm, other=0.0).to(tl.float32)
        gc_re += tl.dot(gt, x_re, input_precision=PRECISION)
        gc_im -= tl.dot(gt, x_im, input_precision=PRECISION)
    go = (h * P + p[:, None]) * N + n[None, :]
    tl.atomic_add(gc_ptr + go, gc_re, mask=cmask, sem="relaxed")
    tl.atomic_add(gc_ptr + H * P * N + go, gc_im, mask=cmask, sem="relaxed")
    tl.atomic_add(gskip_ptr + h * P + p, gskip, mask=p < P, sem="relaxed")


@triton.jit
def _injection_bwd_kernel(gbre_ptr, gbim_ptr, gy_ptr, u_ptr, skip_ptr, bw_ptr, gu_ptr, gbw_ptr, L, H, sg_b, sg_l,
                          su_b, su_l, REPEAT, N: tl.constexpr, P: tl.constexpr, BLOCK_L: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, HAS_B: tl.constexpr,
                          PRECISION: tl.constexpr):
    h = tl.program_id(1)
    n = tl.arange(0, BLOCK_N)
    p = tl.arange(0, BLOCK_P)
    wmask = (n[:, None] < N) & (p[None, :] < P)
    bw = bw_ptr + ((h * N + n[:, None]) * P + p[None, :]) * 2                 # B[h, n, p, :]
    b_re = tl.load(bw, mask=wmask, other=0.0).to(tl.float32)
    b_im = tl.load(bw + 1, mask=wmask, other=0.0).to(tl.float32)
    skip = tl.load(skip_ptr + h * P + p, mask=p < P, other=0.0).to(tl.float32)
    gb_re_w = tl.zeros((BLOCK_N, BLOCK_P), dtype=tl.float32)
    gb_im_w = tl.zeros((BLOCK_N, BLOCK_P), dtype=tl.float32)
    for r in range(REPEAT):
        h, b, t, n, p = _rows(L, H, BLOCK_L, BLOCK_N, BLOCK_P, tl.program_id(0) * REPEAT + r)
        tm = t < L
        pm = tm[:, None] & (p[None, :] < P)
        g = tl.load(gy_ptr + _head_cols(b, t, h, p, sg_b, sg_l, P), mask=pm, other=0.0).to(tl.float32)
        gu = g * skip[None, :]
        if HAS_B:
            u = tl.load(u_ptr + _head_cols(b, t, h, p, su_b, su_l, P), mask=pm, other=0.0).to(tl.float32)
            xo = ((b.to(tl.int64) * H + h) * L + t[:, None]) * N + n[None, :]
            xm = tm[:, None] & (n[None, :] < N)
            gre = tl.load(gbre_ptr + xo, mask=xm, other=0.0).to(tl.float32)
            gim = tl.load(gbim_ptr + xo, mask=xm, other=0.0).to(tl.float32)
            gu += tl.dot(gre, b_re, input_precision=PRECISION)
            gu += tl.dot(gim, b_im, input_precision=PRECISION)
            gb_re_w += tl.dot(tl.trans(gre), u, input_precision=PRECISION)
            gb_im_w += tl.dot(tl.trans(gim), u, input_precision=PRECISION)
        tl.store(gu_ptr + ((b.to(tl.int64) * L + t[:, None]) * H + h) * P + p[None, :],
                 gu.to(gu_ptr.dtype.element_ty), mask=pm)
    if HAS_B:
        go = (h * N + n[:, None]) * P + p[None, :]
        tl.atomic_add(gbw_ptr + go, gb_re_w, mask=wmask, sem="relaxed")
        tl.atomic_add(gbw_ptr + H * N * P + go, gb_im_w, mask=wmask, sem="relaxed")


BLOCK_L = 64   # the forward kernels' tokens per block
# the backward kernels' launch for heads of up to 32 x 32 (state x width; the registry's defaults): tokens per block,
# blocks per program (whose weight gradients are summed before the program's atomic adds), warps. From `python
# bench/ste_kernels.py --readout-only` (`git show 8438c3e:bench/ste_kernels.py`) and an A/B in the layer (H100,
# width 1024, B=32): 0.9% off forward + backward at L=8192 against LARGE_HEAD_BWD_CONFIG for both, within noise at
# 2048-4096 (BENCHMARKS.md). Larger heads, whose
# weight tiles these sizes were not measured with, keep LARGE_HEAD_BWD_CONFIG (TF32) or the float32 one below.
READOUT_BWD_CONFIG = {"block_l": 64, "repeat": 4, "num_warps": 2}
INJECTION_BWD_CONFIG = {"block_l": 128, "repeat": 8, "num_warps": 4}
LARGE_HEAD_BWD_CONFIG = {"block_l": 64, "repeat": 8, "num_warps": 4}
# Float32 layers' exact ("ieee") products run on the CUDA cores, where a large head's 64-token tiles outgrow the
# registers: 16-token tiles took the backward kernels 16-22x faster at 70 heads of 64 x 64 (Nemotron-H 9B's
# layers), B=8, L=2048 (one H200, 2026-11-29; docs/bench/layer.md, "Float32 layers").
IEEE_LARGE_HEAD_BLOCK_L = 16
IEEE_LARGE_HEAD_BWD_CONFIG = {"block_l": IEEE_LARGE_HEAD_BLOCK_L, "repeat": 8, "num_warps": 4}


def _blocks(N, P):
    """The tiles' sides for a head's state and width (`triton_ste._tile`: one rule for every fused kernel)."""
    return _tile(N), _tile(P)


def _large_head(bn, bp):
    """Heads past 32 x 32 tiles (the registry's default sizes), whose launches were measured apart."""
    return bn * bp > 32 * 32


def _fwd_block_l(bn, bp, precision):
    """Tokens per forward block: BLOCK_L, but IEEE_LARGE_HEAD_BLOCK_L for a large head's exact products."""
    return IEEE_LARGE_HEAD_BLOCK_L if precision == "ieee" and _large_head(bn, bp) else BLOCK_L


def _bwd_config(config, default, bn, bp, precision):
    """The given launch config, else `default` for heads of up to 32 x 32 and a large-head config beyond."""
    if config is not None:
        return config
    if not _large_head(bn, bp):
        return default
    return IEEE_LARGE_HEAD_BWD_CONFIG if precision == "ieee" else LARGE_HEAD_BWD_CONFIG


def readout_fwd(x_re, x_im, C, D_skip, u, y, precision: str):
    """y [b, L, H*P] (written in place, any row strides) = Re(C_h x_t) + D_skip * u_t; x planes [b, H, L, N]
    contiguous float32 or bfloat16, C [H, P, N, 2] and D_skip [H, P] contiguous (any float dtype: read as float32,
    so a layer's bf16 parameters need no float32 copy), u [b, L, H*P]."""
    b, H, L, N = x_re.shape
    P = C.shape[1]
    bn, bp = _blocks(N, P)
    block_l = _fwd_block_l(bn, bp, precision)
    if b * L:
        _readout_fwd_kernel[(triton.cdiv(L, block_l), H, b)](
            x_re, x_im, C, D_skip, u, y, L, H, u.stride(0), u.stride(1), y.stride(0), y.stride(1), N=N, P=P,
            BLOCK_L=block_l, BLOCK_N=bn, BLOCK_P=bp, PRECISION=precision, num_warps=4)


def injection_fwd(u, Bw, precision: str, dtype: torch.dtype = torch.float32):
    """The injection planes (B_h u_t) [b, H, L, N] (re, im) of `dtype` (products in float32) from u [b, L, H*P]
    and Bw [H, N, P, 2] contiguous (any float dtype, read as float32)."""
    b, L = u.shape[:2]
    H, N, P = Bw.shape[:3]
    bn, bp = _blocks(N, P)
    b_re = torch.empty(b, H, L, N, device=u.device, dtype=dtype)
    b_im = torch.empty_like(b_re)
    block_l = _fwd_block_l(bn, bp, precision)
    if b * L:
        _injection_fwd_kernel[(triton.cdiv(L, block_l), H, b)](
            u, Bw, b_re, b_im, L, H, u.stride(0), u.stride(1), N=N, P=P, BLOCK_L=block_l, BLOCK_N=bn, BLOCK_P=bp,
            PRECISION=precision, num_warps=4)
    return b_re, b_im


def readout_bwd(g_y, x_re, x_im, C, u, gC, gskip, precision: str, config: dict | None = None):
    """(dL/dx_re, dL/dx_im) [b, H, L, N] in the x planes' dtype from g_y [b, L, H*P]; adds into gC [2, H, P, N]
    (re, im) and gskip [H, P] (float32). config: READOUT_BWD_CONFIG's shape (default: `_bwd_config`'s)."""
    b, H, L, N = x_re.shape
    P = C.shape[1]
    bn, bp = _blocks(N, P)
    cfg = _bwd_config(config, READOUT_BWD_CONFIG, bn, bp, precision)
    g_re, g_im = torch.empty_like(x_re), torch.empty_like(x_im)
    if b * L:
        rep = min(cfg["repeat"], triton.cdiv(L, cfg["block_l"]))
        _readout_bwd_kernel[(triton.cdiv(L, cfg["block_l"] * rep), H, b)](
            g_y, x_re, x_im, C, u, g_re, g_im, gC, gskip, L, H, g_y.stride(0), g_y.stride(1), u.stride(0),
            u.stride(1), rep, N=N, P=P, BLOCK_L=cfg["block_l"], BLOCK_N=bn, BLOCK_P=bp, PRECISION=precision,
            num_warps=cfg["num_warps"])
    return g_re, g_im


def injection_bwd(gb_re, gb_im, g_y, u, D_skip, Bw, gBw, precision: str, config: dict | None = None):
    """dL/du from the skip and the injection, [b, L, H*P] in u's dtype; adds dL/dB into gBw [2, H, N, P]
    (float32). gb planes None: no injection (b_gate "off"), only the skip's part. config: INJECTION_BWD_CONFIG's
    shape (default: `_bwd_config`'s)."""
    b, L = u.shape[:2]
    H, N, P = Bw.shape[:3]
    bn, bp = _blocks(N, P)
    cfg = _bwd_config(config, INJECTION_BWD_CONFIG, bn, bp, precision)
    g_u = torch.empty(b, L, H * P, device=u.device, dtype=u.dtype)
    has_b = gb_re is not None
    if b * L:
        rep = min(cfg["repeat"], triton.cdiv(L, cfg["block_l"]))
        _injection_bwd_kernel[(triton.cdiv(L, cfg["block_l"] * rep), H, b)](
            gb_re if has_b else g_u, gb_im if has_b else g_u, g_y, u, D_skip, Bw, g_u, gBw if has_b else g_u, L, H,
            g_y.stride(0), g_y.stride(1), u.stride(0), u.stride(1), rep, N=N, P=P, BLOCK_L=cfg["block_l"],
            BLOCK_N=bn, BLOCK_P=bp, HAS_B=has_b, PRECISION=precision, num_warps=cfg["num_warps"])
    return g_u

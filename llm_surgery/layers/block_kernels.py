"""Triton kernels for two pieces of the Mamba2-style block around a mixer (`common.py` holds the maths and the torch
path, which is their reference): the gated RMSNorm and the causal depthwise convolution followed by SiLU.

In torch each of them is a chain of element-wise passes over [B, L, d] tensors (the norm in float32: about eight
passes forward and fifteen backward; the convolution two transposes, a concatenation, the convolution and SiLU),
which took ~8 of the Flash PD-SSM layer's 40 ms per forward + backward at B=32, L=2048 on an H100. Here each
piece reads its inputs once and writes its outputs once per pass; the backward recomputes what it needs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# ---- gated RMSNorm: out = RMSNorm_group(x * silu(z)) * weight ------------------------------------------------------
@triton.jit
def _norm_tile(x_ptr, z_ptr, row, g, j, sx, sz, NG, GS, mask):
    offs_x = row[:, None, None] * sx + g[None, :, None] * GS + j[None, None, :]
    offs_z = row[:, None, None] * sz + g[None, :, None] * GS + j[None, None, :]
    x = tl.load(x_ptr + offs_x, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + offs_z, mask=mask, other=0.0).to(tl.float32)
    return x, z


@triton.jit
def _gated_norm_fwd_kernel(x_ptr, z_ptr, w_ptr, out_ptr, R, NG, GS, sx, sz, eps,
                           BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_S)
    mask = (row[:, None, None] < R) & (g[None, :, None] < NG) & (j[None, None, :] < GS)
    x, z = _norm_tile(x_ptr, z_ptr, row, g, j, sx, sz, NG, GS, mask)
    h = x * z / (1.0 + tl.exp(-z))
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=2) / GS + eps)
    w = tl.load(w_ptr + g[:, None] * GS + j[None, :], mask=(g[:, None] < NG) & (j[None, :] < GS), other=0.0)
    out = h * rstd[:, :, None] * w.to(tl.float32)[None, :, :]
    offs = row[:, None, None] * (NG * GS) + g[None, :, None] * GS + j[None, None, :]
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_norm_bwd_kernel(x_ptr, z_ptr, w_ptr, go_ptr, dx_ptr, dz_ptr, dw_ptr, R, NG, GS, sx, sz, sgo, eps,
                           ROWS_PER_PROG, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr):
    """One program: ROWS_PER_PROG rows x BLOCK_G groups (program_id 1 picks the groups: each group's norm is its
    own), BLOCK_R rows at a time; dw's partial sums go to the program's own row of dw_ptr."""
    pid = tl.program_id(0)
    g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_S)
    gj = (g[:, None] < NG) & (j[None, :] < GS)
    w = tl.load(w_ptr + g[:, None] * GS + j[None, :], mask=gj, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_G, BLOCK_S), dtype=tl.float32)
    for r0 in range(0, ROWS_PER_PROG, BLOCK_R):
        row = pid * ROWS_PER_PROG + r0 + tl.arange(0, BLOCK_R)
        mask = (row[:, None, None] < R) & (r0 + tl.arange(0, BLOCK_R)[:, None, None] < ROWS_PER_PROG) & gj[None]
        x, z = _norm_tile(x_ptr, z_ptr, row, g, j, sx, sz, NG, GS, mask)
        go = tl.load(go_ptr + row[:, None, None] * sgo + g[None, :, None] * GS + j[None, None, :], mask=mask,
                     other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-z))
        sz_ = z * sig
        hg = x * sz_
        rstd = 1.0 / tl.sqrt(tl.sum(hg * hg, axis=2) / GS + eps)
        h = hg * rstd[:, :, None]
        dw += tl.sum(go * h, axis=0)
        dh = go * w[None, :, :]
        dg = rstd[:, :, None] * (dh - h * (tl.sum(dh * h, axis=2) / GS)[:, :, None])
        offs = row[:, None, None] * (NG * GS) + g[None, :, None] * GS + j[None, None, :]
        tl.store(dx_ptr + offs, (dg * sz_).to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dz_ptr + offs, (dg * x * sig * (1.0 + z * (1.0 - sig))).to(dz_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_ptr + pid * NG * GS + g[:, None] * GS + j[None, :], dw, mask=gj)


def _norm_launch(d: int, group_size: int, tile: int = 4096, split_groups: bool = False):
    """(BLOCK_R, BLOCK_G, BLOCK_S): rows x groups x entries of a tile of about `tile` entries. The forward's tile
    holds all of a row's groups; the backward's (`split_groups`) at most a tile's worth, the rest in other programs."""
    block_s = triton.next_power_of_2(group_size)
    block_g = triton.next_power_of_2(d // group_size)
    if split_groups:
        block_g = min(block_g, max(1, tile // block_s))
    block_r = max(1, tile // (block_s * block_g))
    return block_r, block_g, block_s


def gated_norm_fwd(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float):
    """x, z [R, d] with unit stride in d (rows may be strided) -> [R, d] contiguous in x's dtype."""
    R, d = x.shape
    out = torch.empty(R, d, device=x.device, dtype=x.dtype)
    br, bg, bs = _norm_launch(d, group_size)
    if R:
        _gated_norm_fwd_kernel[(triton.cdiv(R, br),)](x, z, weight, out, R, d // group_size, group_size, x.stride(0),
                                                      z.stride(0), eps, BLOCK_R=br, BLOCK_G=bg, BLOCK_S=bs,
                                                      num_warps=4)
    return out


# the backward's tile (rows x groups x entries per step) and warps. A whole row in one tile (4096 entries, as the
# forward) took 0.45 / 0.47 / 0.95 ms at R x d = 2048 x 2560 (groups of 40) / 65536 x 1024 / 65536 x 2048 (groups
# of 32), this config 0.14 / 0.38 / 0.59 (bf16, one H100; `bench/ste_kernels.py --norm-only` of commit 8438c3e,
# docs/bench/data/gated_norm_bwd_h100_2026-11-28.md)
NORM_BWD_CONFIG = {"tile": 1024, "num_warps": 8}


def gated_norm_bwd(x, z, weight, grad_out, group_size: int, eps: float, config: dict | None = None):
    """(dx, dz, dweight) of `gated_norm_fwd`; dweight summed over rows in float32, returned in weight's dtype.
    config: NORM_BWD_CONFIG's shape (benchmarks sweep it)."""
    cfg = NORM_BWD_CONFIG if config is None else config
    R, d = x.shape
    ng = d // group_size
    dx = torch.empty(R, d, device=x.device, dtype=x.dtype)
    dz = torch.empty(R, d, device=x.device, dtype=z.dtype)
    br, bg, bs = _norm_launch(d, group_size, cfg["tile"], split_groups=True)
    group_blocks = triton.cdiv(ng, bg)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    progs = max(1, min(triton.cdiv(R, br), triton.cdiv(8 * sms, group_blocks)))
    rows = triton.cdiv(triton.cdiv(R, progs), br) * br
    progs = triton.cdiv(R, rows) if R else 1
    dw = torch.zeros(progs, d, device=x.device, dtype=torch.float32)
    if R:
        _gated_norm_bwd_kernel[(progs, group_blocks)](x, z, weight, grad_out, dx, dz, dw, R, ng, group_size,
                                                      x.stride(0), z.stride(0), grad_out.stride(0), eps, rows,
                                                      BLOCK_R=br, BLOCK_G=bg, BLOCK_S=bs,
                                                      num_warps=cfg["num_warps"])
    return dx, dz, dw.sum(0).to(weight.dtype)


# ---- causal depthwise convolution + SiLU: y_t = silu(bias + sum_j w_j x_{t - (W-1) + j}) -------------------------
@triton.jit
def _conv_pre(x_ptr, w_ptr, b_ptr, bb, t, c, L, C, sxb, sxl, W: tl.constexpr):
    """The convolution before SiLU at rows t [BLOCK_L] and channels c [BLOCK_C] (zeros before the first row)."""
    cm = c < C
    acc = tl.zeros((t.shape[0], c.shape[0]), dtype=tl.float32) + tl.load(b_ptr + c, mask=cm, other=0.0).to(
        tl.float32)[None, :]
    for j in tl.static_range(W):
        src = t - (W - 1) + j
        ok = (src >= 0) & (src < L)
        xv = tl.load(x_ptr + bb.to(tl.int64) * sxb + src[:, None].to(tl.int64) * sxl + c[None, :],
                     mask=ok[:, None] & cm[None, :], other=0.0).to(tl.float32)
        acc += xv * tl.load(w_ptr + c * W + j, mask=cm, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _conv_silu_fwd_kernel(x_ptr, w_ptr, b_ptr, y_ptr, L, C, sxb, sxl, W: tl.constexpr, BLOCK_L: tl.constexpr,
                          BLOCK_C: tl.constexpr):
    t = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    bb = tl.program_id(2)
    pre = _conv_pre(x_ptr, w_ptr, b_ptr, bb, t, c, L, C, sxb, sxl, W)
    y = pre / (1.0 + tl.exp(-pre))
    offs = (bb.to(tl.int64) * L + t[:, None]) * C + c[None, :]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=(t[:, None] < L) & (c[None, :] < C))


@triton.jit
def _conv_silu_gpre_kernel(x_ptr, w_ptr, b_ptr, gy_ptr, gpre_ptr, dw_ptr, db_ptr, L, C, sxb, sxl, sgb, sgl,
                           BLOCKS_PER_PROG, W: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr):
    """gpre = dL/d(conv before SiLU), stored; the weights' gradients summed over this program's rows. The taps'
    inputs come as one [rows, W, channels] tile, and the weight gradient stays a tile of that shape until the
    program ends: summing it over rows per block (a cross-warp reduction each time) made this kernel ~6x its
    memory time."""
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    bb = tl.program_id(2)
    cm = c < C
    jw = tl.arange(0, W)
    w = tl.load(w_ptr + c[None, :] * W + jw[:, None], mask=cm[None, :], other=0.0).to(tl.float32)   # [W, C]
    bias = tl.load(b_ptr + c, mask=cm, other=0.0).to(tl.float32)
    xb = x_ptr + bb.to(tl.int64) * sxb
    dw = tl.zeros((BLOCK_L, W, BLOCK_C), dtype=tl.float32)
    db = tl.zeros((BLOCK_L, BLOCK_C), dtype=tl.float32)
    for i in range(BLOCKS_PER_PROG):
        t = (tl.program_id(0) * BLOCKS_PER_PROG + i) * BLOCK_L + tl.arange(0, BLOCK_L)
        ok = (t[:, None] < L) & cm[None, :]
        src = t[:, None] - (W - 1) + jw[None, :]                                               # [BLOCK_L, W]
        xv = tl.load(xb + src[:, :, None].to(tl.int64) * sxl + c[None, None, :],
                     mask=((src >= 0) & (src < L))[:, :, None] & cm[None, None, :], other=0.0).to(tl.float32)
        pre = tl.sum(xv * w[None, :, :], axis=1) + bias[None, :]
        sig = 1.0 / (1.0 + tl.exp(-pre))
        gy = tl.load(gy_ptr + bb.to(tl.int64) * sgb + t[:, None].to(tl.int64) * sgl + c[None, :], mask=ok,
                     other=0.0).to(tl.float32)
        gpre = gy * sig * (1.0 + pre * (1.0 - sig))
        tl.store(gpre_ptr + (bb.to(tl.int64) * L + t[:, None]) * C + c[None, :],
                 gpre.to(gpre_ptr.dtype.element_ty), mask=ok)
        db += gpre
        dw += gpre[:, None, :] * xv
    tl.atomic_add(dw_ptr + c[None, :] * W + jw[:, None], tl.sum(dw, axis=0), mask=cm[None, :], sem="relaxed")
    tl.atomic_add(db_ptr + c, tl.sum(db, axis=0), mask=cm, sem="relaxed")


@triton.jit
def _conv_dx_kernel(gpre_ptr, w_ptr, dx_ptr, L, C, W: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr):
    """dx_t = sum_s w_{W-1-s} gpre_{t+s}: the convolution's transpose."""
    t = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    bb = tl.program_id(2)
    cm = c < C
    dx = tl.zeros((BLOCK_L, BLOCK_C), dtype=tl.float32)
    for s in tl.static_range(W):
        ts = t + s
        g = tl.load(gpre_ptr + (bb.to(tl.int64) * L + ts[:, None]) * C + c[None, :],
                    mask=(ts[:, None] < L) & cm[None, :], other=0.0).to(tl.float32)
        dx += g * tl.load(w_ptr + c * W + (W - 1 - s), mask=cm, other=0.0).to(tl.float32)[None, :]
    tl.store(dx_ptr + (bb.to(tl.int64) * L + t[:, None]) * C + c[None, :], dx.to(dx_ptr.dtype.element_ty),
             mask=(t[:, None] < L) & cm[None, :])


_CONV_BLOCK_L, _CONV_BLOCK_C = 32, 128
_GPRE_BLOCK_L = 8   # rows per step of the backward's first pass: its [rows, W, channels] tiles stay in registers


def conv_silu_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """x [B, L, C] (unit stride in C), weight [C, W] (W a power of two), bias [C] -> silu(conv) [B, L, C]."""
    B, L, C = x.shape
    y = torch.empty(B, L, C, device=x.device, dtype=x.dtype)
    if B * L:
        grid = (triton.cdiv(L, _CONV_BLOCK_L), triton.cdiv(C, _CONV_BLOCK_C), B)
        _conv_silu_fwd_kernel[grid](x, weight, bias, y, L, C, x.stride(0), x.stride(1), W=weight.shape[1],
                                    BLOCK_L=_CONV_BLOCK_L, BLOCK_C=_CONV_BLOCK_C, num_warps=4)
    return y


def conv_silu_bwd(x, weight, bias, grad_y):
    """(dx [B, L, C] in x's dtype, dweight, dbias in their dtypes) of `conv_silu_fwd`: one pass for the gradient
    before SiLU (kept in x's dtype, as the torch path's convolution backward has it) and the weights' sums, one
    for dx."""
    B, L, C = x.shape
    W = weight.shape[1]
    dx = torch.empty(B, L, C, device=x.device, dtype=x.dtype)
    dw = torch.zeros(C, W, device=x.device, dtype=torch.float32)
    db = torch.zeros(C, device=x.device, dtype=torch.float32)
    if B * L:
        gpre = torch.empty(B, L, C, device=x.device, dtype=x.dtype)
        rows = triton.cdiv(L, _GPRE_BLOCK_L)
        per = min(rows, 32)
        grid = (triton.cdiv(rows, per), triton.cdiv(C, _CONV_BLOCK_C), B)
        _conv_silu_gpre_kernel[grid](x, weight, bias, grad_y, gpre, dw, db, L, C, x.stride(0), x.stride(1),
                                     grad_y.stride(0), grad_y.stride(1), per, W=W, BLOCK_L=_GPRE_BLOCK_L,
                                     BLOCK_C=_CONV_BLOCK_C, num_warps=4)
        blocks = triton.cdiv(L, _CONV_BLOCK_L)
        _conv_dx_kernel[(blocks, triton.cdiv(C, _CONV_BLOCK_C), B)](gpre, weight, dx, L, C, W=W,
                                                                    BLOCK_L=_CONV_BLOCK_L, BLOCK_C=_CONV_BLOCK_C,
                                                                    num_warps=4)
    return dx, dw.to(weight.dtype), db.to(bias.dtype)

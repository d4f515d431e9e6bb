"""Triton kernels for the two straight-through gradients of the hard selection (see function.py). With
lam = dL/db and dx_t = D_t * x_{t-1} (x_{-1} = x0; zero at padding steps):

  r[b,h,t,k]  = sum_m Re(conj(lam[b,h,t,P_dict[h,k,m]]) * dx[b,h,t,m])   one program per (token block, head,
                batch). Exact float32 (float32 layers): [tokens, members, entries] tiles of gathers, which all
                read one row of lam, already in L1, with the entries across the lanes of a warp. TF32 (half-
                precision layers): on the tensor cores, as the tokens' outer products Re(conj(lam_t) dx_t^T),
                flattened to N*N columns, times the members' flattened 0/1 matrices [N*N, K]: N/2 times the
                multiply-adds of the gathers, but 1.3x faster alone at N = K = 32 and 2-4% off the layer's
                training step (BENCHMARKS.md); states over 32 entries keep the gathers (SELECTOR_DOT_MAX_BLOCK_N).
  G[h,k,n,m]  = sum_{tokens with k*=k} Re(conj(lam[n]) dx[m])            tokens sorted by (head, k*), then one
                program per (head, member, slice of SEG tokens, output tile) runs a GEMM over its slice with
                tl.dot and adds it into G atomically; the grid lists only non-empty slices. Slicing matters:
                selections are often skewed (early in training one member takes most tokens of a head), and
                one program per member would then walk all B*L tokens alone.

dx is never stored: both kernels rebuild it from D and the state x they load anyway (x_{t-1} is the previous
row of x), which saves two state-sized tensors (x_prev and dx) and their passes over memory. Complex tensors
arrive as float32 planes (re, im) sharing one set of element strides: interleaved views of complex64 tensors
(view_as_real) or separate planes (the layer's split form) alike. Used on CUDA when Triton imports.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _dx_tile(d_re, d_im, x_re, x_im, x0_re, x0_im, mask_ptr, b, h, t, n, L, base, s_l, s_n, x0_off,
             x0_sn, N: tl.constexpr, COMPLEX: tl.constexpr, HAS_X0: tl.constexpr, HAS_MASK: tl.constexpr):
    """dx = D_t * x_{t-1} for rows t (any shape [T]) and entries n: (re, im) float32 tiles [T, len(n)]."""
    valid = (t[:, None] < L) & (n[None, :] < N) & (t[:, None] >= 0)
    off = base[:, None] + t[:, None] * s_l + n[None, :] * s_n
    has_prev = valid & (t[:, None] > 0)
    dre = tl.load(d_re + off, mask=valid, other=0.0).to(tl.float32)
    xr = tl.load(x_re + off - s_l, mask=has_prev, other=0.0).to(tl.float32)
    if HAS_X0:
        first = valid & (t[:, None] == 0)
        x0 = x0_off[:, None] + n[None, :] * x0_sn
        xr += tl.load(x0_re + x0, mask=first, other=0.0)
    if COMPLEX:
        dim = tl.load(d_im + off, mask=valid, other=0.0).to(tl.float32)
        xi = tl.load(x_im + off - s_l, mask=has_prev, other=0.0).to(tl.float32)
        if HAS_X0:
            xi += tl.load(x0_im + x0, mask=first, other=0.0)
        out_re = dre * xr - dim * xi
        out_im = dre * xi + dim * xr
    else:
        out_re = dre * xr
        out_im = out_re
    if HAS_MASK:
        keep = tl.load(mask_ptr + b * L + t, mask=(t < L) & (t >= 0), other=0) != 0
        out_re = tl.where(keep[:, None], out_re, 0.0)
        out_im = tl.where(keep[:, None], out_im, 0.0)
    return out_re, out_im


@triton.jit
def _selector_grad_kernel(lam_re, lam_im, d_re, d_im, x_re, x_im, x0_re, x0_im, mask_ptr, p_ptr, r_ptr, L,
                          s_b, s_h, s_l, s_n, x0_sb, x0_sh, x0_sn,
                          K: tl.constexpr, N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          BLOCK_T: tl.constexpr, REPEAT: tl.constexpr, COMPLEX: tl.constexpr, HAS_X0: tl.constexpr,
                          HAS_MASK: tl.constexpr):
    for rep in range(REPEAT):   # REPEAT token blocks per program: fewer, longer programs
        _selector_block(lam_re, lam_im, d_re, d_im, x_re, x_im, x0_re, x0_im, mask_ptr, p_ptr, r_ptr, L,
                        s_b, s_h, s_l, s_n, x0_sb, x0_sh, x0_sn, tl.program_id(0) * REPEAT + rep, tl.program_id(1),
                        tl.program_id(2), K, N, BLOCK_N, BLOCK_K, BLOCK_T, COMPLEX, HAS_X0, HAS_MASK)


@triton.jit
def _selector_block(lam_re, lam_im, d_re, d_im, x_re, x_im, x0_re, x0_im, mask_ptr, p_ptr, r_ptr, L,
                    s_b, s_h, s_l, s_n, x0_sb, x0_sh, x0_sn, blk, h, b,
                    K: tl.constexpr, N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_T: tl.constexpr, COMPLEX: tl.constexpr, HAS_X0: tl.constexpr, HAS_MASK: tl.constexpr):
    t = blk * BLOCK_T + tl.arange(0, BLOCK_T)
    n = tl.arange(0, BLOCK_N)
    head = b.to(tl.int64) * s_b + h.to(tl.int64) * s_h
    base = tl.zeros((BLOCK_T,), dtype=tl.int64) + head
    x0_off = tl.zeros((BLOCK_T,), dtype=tl.int64) + (b * x0_sb + h * x0_sh)
    dre, dim = _dx_tile(d_re, d_im, x_re, x_im, x0_re, x0_im, mask_ptr, b, h, t, n, L, base, s_l, s_n, x0_off,
                        x0_sn, N, COMPLEX, HAS_X0, HAS_MASK)
    row = (base + t * s_l)[:, None, None]
    tmask = t < L
    out_row = ((b.to(tl.int64) * tl.num_programs(1) + h) * L + t) * K
    for k0 in tl.static_range(0, K, BLOCK_K):
        # [T, BLOCK_K, N] tile: every (token, member) pair gathers its row of lam through the member's map
        k = k0 + tl.arange(0, BLOCK_K)
        kn = (k[:, None] < K) & (n[None, :] < N)
        idx = tl.load(p_ptr + (h * K + k[:, None]) * N + n[None, :], mask=kn, other=0).to(tl.int64)
        src = row + idx[None, :, :] * s_n
        valid = tmask[:, None, None] & kn[None, :, :]
        acc = tl.load(lam_re + src, mask=valid, other=0.0).to(tl.float32) * dre[:, None, :]
        if COMPLEX:
            acc += tl.load(lam_im + src, mask=valid, other=0.0).to(tl.float32) * dim[:, None, :]
        tl.store(r_ptr + out_row[:, None] + k[None, :], tl.sum(acc, axis=2), mask=tmask[:, None] & (k[None, :] < K))


@triton.jit
def _selector_dot_kernel(lam_re, lam_im, d_re, d_im, x_re, x_im, x0_re, x0_im, mask_ptr, p_ptr, r_ptr, L,
                         s_b, s_h, s_l, s_n, x0_sb, x0_sh, x0_sn,
                         K: tl.constexpr, N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_T: tl.constexpr, ROWS: tl.constexpr, REPEAT: tl.constexpr, PRECISION: tl.constexpr,
                         BF16: tl.constexpr, COMPLEX: tl.constexpr, HAS_X0: tl.constexpr, HAS_MASK: tl.constexpr):
    """r on tensor cores: r[t, k] = sum_{n, m} Q_t[n, m] [P_k[m] == n] with Q_t[n, m] = Re(conj(lam_t[n]) dx_t[m]),
    i.e. the tokens' outer products [T, N*N] times the members' flattened indicator matrices [N*N, K], ROWS rows
    n of Q at a time: N/2 times the multiply-adds of the gathers, but on the tensor cores and with no gathers."""
    h = tl.program_id(1)
    b = tl.program_id(2)
    n = tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    j = tl.arange(0, ROWS)
    # the members' destinations, [m, k]; -1 outside N x K matches no row
    dest = tl.load(p_ptr + (h * K + k[None, :]) * N + n[:, None], mask=(n[:, None] < N) & (k[None, :] < K),
                   other=-1)
    head = b.to(tl.int64) * s_b + h.to(tl.int64) * s_h
    x0_off = tl.zeros((BLOCK_T,), dtype=tl.int64) + (b * x0_sb + h * x0_sh)
    for rep in range(REPEAT):
        t = (tl.program_id(0) * REPEAT + rep) * BLOCK_T + tl.arange(0, BLOCK_T)
        base = tl.zeros((BLOCK_T,), dtype=tl.int64) + head
        dre, dim = _dx_tile(d_re, d_im, x_re, x_im, x0_re, x0_im, mask_ptr, b, h, t, n, L, base, s_l, s_n, x0_off,
                            x0_sn, N, COMPLEX, HAS_X0, HAS_MASK)
        row = base + t * s_l
        tmask = t < L
        acc = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
        for n0 in tl.static_range(0, BLOCK_N, ROWS):
            src = row[:, None] + (n0 + j[None, :]) * s_n
            lmask = tmask[:, None] & (n0 + j[None, :] < N)
            q = tl.load(lam_re + src, mask=lmask, other=0.0).to(tl.float32)[:, :, None] * dre[:, None, :]
            if COMPLEX:
                q += tl.load(lam_im + src, mask=lmask, other=0.0).to(tl.float32)[:, :, None] * dim[:, None, :]
            pick = (dest[None, :, :] == (n0 + j)[:, None, None])                           # [ROWS, m, k]
            q = tl.reshape(q, (BLOCK_T, ROWS * BLOCK_N))
            pick = tl.reshape(pick, (ROWS * BLOCK_N, BLOCK_K))
            if BF16:
                acc += tl.dot(q.to(tl.bfloat16), pick.to(tl.bfloat16))
            else:
                acc += tl.dot(q, pick.to(tl.float32), input_precision=PRECISION)
        out_row = ((b.to(tl.int64) * tl.num_programs(1) + h) * L + t) * K
        tl.store(r_ptr + out_row[:, None] + k[None, :], acc, mask=tmask[:, None] & (k[None, :] < K))


@triton.jit
def _dictionary_grad_kernel(lam_re, lam_im, d_re, d_im, x_re, x_im, x0_re, x0_im, mask_ptr, order_ptr, count_ptr,
                            g_ptr, L, T, ITEMS, s_b, s_h, s_l, s_n, x0_sb, x0_sh, x0_sn, TILES,
                            K: tl.constexpr, N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_T: tl.constexpr, SEG: tl.constexpr, PRECISION: tl.constexpr,
                            COMPLEX: tl.constexpr, HAS_X0: tl.constexpr, HAS_MASK: tl.constexpr,
                            DX_GIVEN: tl.constexpr = False):
    # one work item = one SEG-token piece of one (head, member) group: item j of head h is piece j of the members'
    # pieces laid end to end (from the head's member counts, here); items past the real count are empty
    item = tl.program_id(0)
    tile = tl.program_id(1)
    tile_n = tile // TILES
    tile_m = tile - tile_n * TILES
    h = item // ITEMS
    jt = item - h * ITEMS
    kk = tl.arange(0, BLOCK_K)
    cnt = tl.load(count_ptr + h * K + kk, mask=kk < K, other=0).to(tl.int32)
    pcs = (cnt + SEG - 1) // SEG
    piece_end = tl.cumsum(pcs, axis=0)
    k = tl.sum((piece_end <= jt).to(tl.int32), axis=0)          # K: past the last piece
    own = kk == k
    last = tl.sum(tl.where(own, tl.cumsum(cnt, axis=0), 0), axis=0)
    first = last - tl.sum(tl.where(own, cnt, 0), axis=0)
    piece = jt - tl.sum(tl.where(own, piece_end - pcs, 0), axis=0)
    hk = h * K + k
    begin = first + piece * SEG
    end = tl.minimum(last, begin + SEG)
    n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tile_m * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, BLOCK_T)
    acc = tl.zeros((BLOCK_N, BLOCK_N), dtype=tl.float32)
    for s in range(0, SEG, BLOCK_T):    # a fixed trip count (the interpreter cannot loop to a loaded bound)
        valid = begin + s + j < end
        tok = tl.load(order_ptr + h * T + begin + s + j, mask=valid, other=0)
        bb = tok // L
        ll = tl.where(valid, tok - bb * L, -1)          # -1: a row outside the slice, loads nothing
        base = bb.to(tl.int64) * s_b + h.to(tl.int64) * s_h
        x0_off = bb.to(tl.int64) * x0_sb + h * x0_sh
        lmask = valid[:, None] & (n[None, :] < N)
        ln = base[:, None] + ll[:, None] * s_l + n[None, :] * s_n
        if DX_GIVEN:   # the x planes hold dx itself (the fused backward wrote it)
            cm = valid[:, None] & (m[None, :] < N)
            co = base[:, None] + ll[:, None] * s_l + m[None, :] * s_n
            cre = tl.load(x_re + co, mask=cm, other=0.0).to(tl.float32)
            cim = tl.load(x_im + co, mask=cm, other=0.0).to(tl.float32)
        else:
            cre, cim = _dx_tile(d_re, d_im, x_re, x_im, x0_re, x0_im, mask_ptr, bb, h, ll, m, L, base, s_l, s_n,
                                x0_off, x0_sn, N, COMPLEX, HAS_X0, HAS_MASK)
        a = tl.load(lam_re + ln, mask=lmask, other=0.0).to(tl.float32)
        acc += tl.dot(tl.trans(a), cre, input_precision=PRECISION)
        if COMPLEX:
            a = tl.load(lam_im + ln, mask=lmask, other=0.0).to(tl.float32)
            acc += tl.dot(tl.trans(a), cim, input_precision=PRECISION)
    out = g_ptr + hk * N * N + n[:, None] * N + m[None, :]
    # the emptiness test as a full tile: Triton 3.9's interpreter rejects an atomic mask built with a scalar
    nonempty = (tl.zeros((BLOCK_N, BLOCK_N), dtype=tl.int32) + (end - begin)) > 0
    tl.atomic_add(out, acc, mask=(n[:, None] < N) & (m[None, :] < N) & nonempty, sem="relaxed")


def float_planes(t: torch.Tensor | None):
    """(re, im) float32 views of a real or complex tensor (im None for real); complex64 views cost nothing."""
    if t is None:
        return None, None
    if t.is_complex():
        v = torch.view_as_real(t.to(torch.complex64).contiguous())
        return v[..., 0], v[..., 1]
    return t.float().contiguous(), None


# Launch configurations, chosen by timing alternatives on the GPU with bench/ste_kernels.py (in git:
# `git show 8438c3e:bench/ste_kernels.py`).
SELECTOR_CONFIG = {"tile": 1024, "num_warps": 1, "repeat": 8}   # tile = tokens x members x entries per step
# the tensor-core form, where products may round to TF32 (half-precision layers): tokens per block, rows of Q per
# product, blocks per program (more run out of shared memory: the loop is software-pipelined), and bf16 operands
# instead of TF32 (another 1-2% off the layer's step at L = 4096 and 8192; off: 8-bit mantissas). From 64 members
# on (width 2048's defaults) 128 tokens of 2 rows: 2.17 ms a call against 2.47 at B=16, L=2048, 64 heads, N=32
# on an H100 (docs/bench/data/ste_kernels_k64_h100_2026-11-27.md), where at 32 members it is 0.69 against 0.63
# (docs/bench/data/selector_tensor_cores_h100_2026-11-27.md)
SELECTOR_DOT_CONFIG = {"block_t": 64, "rows": 4, "num_warps": 4, "repeat": 1, "bf16": False}
SELECTOR_DOT_CONFIG_WIDE = dict(SELECTOR_DOT_CONFIG, block_t=128, rows=2)   # K > 32

# the tensor-core form holds [tokens, BLOCK_N] tiles of dx and the members' [BLOCK_N, BLOCK_K] destinations in
# registers: from BLOCK_N = 64 (states of 33-64 entries, e.g. 48 in granite-4.0-h-1b's and -h-tiny's layers) ptxas
# spills for sm_90 at every block size and row count tried (255 registers and 0.2-4 KB of stack a thread; 215
# registers and none at N = K = 32), so larger states keep the gathers
SELECTOR_DOT_MAX_BLOCK_N = 32   # `git show 8438c3e:bench/selector_dot_registers.py` compiled them
DICTIONARY_CONFIG = {"seg": 256, "block_t": 32, "num_warps": 4}   # seg: the longest piece (`_dictionary`)


def selector_dot_config(K: int) -> dict:
    """The tensor-core selector kernel's default launch configuration for K dictionary members."""
    return SELECTOR_DOT_CONFIG_WIDE if K > 32 else SELECTOR_DOT_CONFIG


def ste_grads_triton(P_dict: torch.Tensor, kstar: torch.Tensor, lam, D, x, x0=None, mask=None, K: int | None = None,
                     selector_config: dict | None = None, dictionary_config: dict | None = None,
                     parts: tuple[str, ...] = ("dictionary", "selector"), precision: str = "ieee",
                     dictionary_into: torch.Tensor | None = None):
    """(G [H,K,N,N] float32, r [B,H,L,K] float32) for CUDA tensors (None for a part left out of `parts`;
    the configs override the defaults below, for timing alternatives). dictionary_into: a contiguous float32
    [H,K,N,N] tensor the dictionary sum is added into (and returned as G), for a caller that sums over slices.

    lam, D, x: (re, im) planes [B,H,L,N] (float32, or bfloat16: read as float32) with one set of strides (im None
    for a real scan), or real / complex tensors (split with `float_planes`); x0: planes or a tensor [B,H,N], or
    None (zero initial state); mask [B,L] (0 = padding: no straight-through signal). K defaults to P_dict's member
    count. precision: the products' input precision, "ieee" (exact float32: the selector sum gathers) or "tf32"
    (tensor cores for both sums, the selector's for N <= SELECTOR_DOT_MAX_BLOCK_N; for half-precision layers).
    """
    lam, D, x, x0 = (p if isinstance(p, tuple) else float_planes(p) for p in (lam, D, x, x0))
    (lre, lim), (dre, dim), (xre, xim) = lam, D, x
    B, H, L, N = lre.shape
    K = P_dict.shape[1] if K is None else K
    cplx = lim is not None
    strides = lre.stride()
    for plane in (lim, dre, dim, xre, xim):
        if plane is not None and (plane.stride() != strides or plane.shape != lre.shape):
            raise ValueError("ste_grads_triton: lam, D and x planes must share one shape and one set of strides")
    has_x0 = x0[0] is not None
    x0re, x0im = (x0 if has_x0 else (lre, lim))
    x0_strides = x0re.stride() if has_x0 else (0, 0, 0)
    has_mask = mask is not None
    mask_t = mask.to(torch.int8).contiguous() if has_mask else kstar
    im = lambda p, fallback: p if p is not None else fallback  # noqa: E731 - real scans pass the re plane twice
    planes = (lre, im(lim, lre), dre, im(dim, dre), xre, im(xim, xre), x0re, im(x0im, x0re), mask_t)
    P = P_dict.to(torch.int32).contiguous()
    block_n = _tile(N)
    G = r = None
    if "selector" in parts:
        if not selector_on_tensor_cores(N, precision):
            r = _selector(planes, P, B, H, L, N, K, strides, x0_strides, cplx, has_x0, has_mask, block_n,
                          SELECTOR_CONFIG if selector_config is None else selector_config)
        else:
            r = _selector_dot(planes, P, B, H, L, N, K, strides, x0_strides, cplx, has_x0, has_mask,
                              selector_dot_config(K) if selector_config is None else selector_config, precision)
    if "dictionary" in parts:
        G = _dictionary(planes, kstar, B, H, L, N, K, strides, x0_strides, cplx, has_x0, has_mask, block_n,
                        DICTIONARY_CONFIG if dictionary_config is None else dictionary_config, precision,
                        into=dictionary_into)
    return G, r


def _tile(n: int) -> int:
    """The side of a kernel tile that holds n entries: a power of two, at least tl.dot's 16."""
    return max(16, triton.next_power_of_2(n))


def selector_on_tensor_cores(N: int, precision: str) -> bool:
    """Whether `ste_grads_triton` runs the selector sum's tensor-core form (its `selector_config` is then one of
    SELECTOR_DOT_CONFIG's shape) rather than the gathers (SELECTOR_CONFIG's)."""
    return precision != "ieee" and _tile(N) <= SELECTOR_DOT_MAX_BLOCK_N


def selector_dot_sizes(N: int, K: int, cfg: dict) -> dict:
    """The tensor-core selector kernel's block sizes for N state entries, K members and a SELECTOR_DOT_CONFIG-shaped
    config."""
    block_n = _tile(N)
    return dict(BLOCK_N=block_n, BLOCK_K=_tile(K), BLOCK_T=cfg["block_t"], ROWS=min(cfg["rows"], block_n))


def _selector(planes, P, B, H, L, N, K, strides, x0_strides, cplx, has_x0, has_mask, block_n, cfg):
    r = torch.empty(B, H, L, K, device=P.device, dtype=torch.float32)
    block_k = min(triton.next_power_of_2(K), max(1, cfg["tile"] // block_n))
    block_t = max(1, cfg["tile"] // (block_k * block_n))
    repeat = max(1, min(cfg["repeat"], triton.cdiv(L, block_t)))
    _selector_grad_kernel[(triton.cdiv(L, block_t * repeat), H, B)](
        *planes, P, r, L, *strides, *x0_strides,
        K=K, N=N, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_T=block_t, REPEAT=repeat, COMPLEX=cplx, HAS_X0=has_x0,
        HAS_MASK=has_mask, num_warps=cfg["num_warps"])
    return r


def _selector_dot(planes, P, B, H, L, N, K, strides, x0_strides, cplx, has_x0, has_mask, cfg, precision):
    r = torch.empty(B, H, L, K, device=P.device, dtype=torch.float32)
    sizes = selector_dot_sizes(N, K, cfg)
    repeat = max(1, min(cfg["repeat"], triton.cdiv(L, sizes["BLOCK_T"])))
    _selector_dot_kernel[(triton.cdiv(L, sizes["BLOCK_T"] * repeat), H, B)](
        *planes, P, r, L, *strides, *x0_strides,
        K=K, N=N, **sizes, REPEAT=repeat, PRECISION=precision, BF16=cfg.get("bf16", False), COMPLEX=cplx,
        HAS_X0=has_x0, HAS_MASK=has_mask, num_warps=cfg["num_warps"])
    return r


def dictionary_grad_from_dx(kstar: torch.Tensor, lam, dx, K: int, precision: str = "ieee",
                            into: torch.Tensor | None = None) -> torch.Tensor:
    """G [H,K,N,N] float32 from lam and dx = D_t x_{t-1} given as (re, im) float32 planes [B,H,L,N] of one shape and
    strides (dx zero at padding): the dictionary sum for a caller that already has dx (the fused backward).
    into: as ste_grads_triton's dictionary_into."""
    (lre, lim), (xre, xim) = lam, dx
    B, H, L, N = lre.shape
    planes = (lre, lim, xre, xim, xre, xim, xre, xim, kstar)
    return _dictionary(planes, kstar, B, H, L, N, K, lre.stride(), (0, 0, 0), True, False, False,
                       _tile(N), DICTIONARY_CONFIG, precision, dx_given=True, into=into)


def _dictionary(planes, kstar, B, H, L, N, K, strides, x0_strides, cplx, has_x0, has_mask, block_n, dcfg,
                precision="ieee", dx_given=False, into=None):
    device = kstar.device
    T = B * L
    keys = kstar.permute(1, 0, 2).reshape(H, T)
    # token = b * L + l; 16-bit keys: a quarter of the radix passes of int64 ones (0.44 -> 0.18 ms a layer step)
    order = torch.argsort(keys.to(torch.int16), dim=-1, stable=True).to(torch.int32)
    ones = keys.new_ones(()).expand_as(keys)   # no fill: scatter_add_ only reads it
    counts = torch.zeros(H, K, device=device, dtype=torch.int64).scatter_add_(1, keys, ones)
    G = torch.zeros(H, K, N, N, device=device, dtype=torch.float32) if into is None else into
    bn = min(64, block_n)
    # a piece's loop has a fixed trip count (seg / block_t), so a piece runs its whole length even where its member
    # has fewer tokens: with few tokens per member (a batch of one, 64 members: ~32 each) pieces of the mean count
    # (at least one block), not of the config's length, which stays the cap
    seg = min(dcfg["seg"], max(dcfg["block_t"], triton.next_power_of_2(max(1, T // K))))
    # the grid holds only pieces, not (member x largest piece count): selections are skewed (one member may take
    # most tokens of a head while others take none). A head has at most T/seg + K pieces, so that bound sizes the
    # grid with no host sync; each program finds its member and piece from the head's counts (the kernel), so the
    # work list costs no launches of its own
    items = -(-T // seg) + K
    tiles = triton.cdiv(N, bn)
    if T:
        _dictionary_grad_kernel[(H * items, tiles * tiles)](
            *planes, order, counts, G, L, T, items, *strides, *x0_strides, tiles,
            K=K, N=N, BLOCK_K=_tile(K), BLOCK_N=bn, BLOCK_T=dcfg["block_t"], SEG=seg, PRECISION=precision,
            COMPLEX=cplx, HAS_X0=has_x0, HAS_MASK=has_mask, DX_GIVEN=dx_given, num_warps=dcfg["num_warps"])
    return G

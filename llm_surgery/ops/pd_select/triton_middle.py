"""The forward of a complex Flash PD-SSM layer's middle as ONE Triton kernel per (sequence, head), from the x_proj
output and u to the readout y, with the state kept on chip (`middle_fwd`).

Per chunk of T tokens, vectorised over the chunk:
  k* = argmax of the K selector logits, P_t = P_dict[h, k*] (identity at padding),
  D_t = |D| e^{i phi} with |D| = sigmoid(-(a + bias)) (unit_snap, phase_levels as pd_transition/naive.py; 1 at
  padding), b_t = gate * (B_h u_t) as a tensor-core product [T, P] @ [P, N];
then token by token x_t = P_t (D_t x_{t-1}) + b_t (the scatter as a one-hot [N, N] reduction in registers);
then y = Re(C_h x) + D_skip u as [T, N] @ [N, P] products. The chunk's rows pass between the vectorised and the
per-token phases through a small per-program scratch that stays in L1/L2.

Nothing state-sized goes through HBM except the states themselves, and only when the backward needs them
(`store_states`); the separate transition, injection, scan and readout kernels wrote and re-read the D, P_t and
b planes. One program walks one whole sequence, so this pays only with many (sequence, head) pairs (a training
batch, a decode step of a batch); `middle_fwd_pays` says when. The same kernel at L = 1 is the decode step.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

GATES = {None: 0, "sigmoid": 1, "hard": 2, "decay": 3, "off": 4}


@triton.jit
def _middle_fwd_kernel(proj_ptr, u_ptr, bw_ptr, c_ptr, skip_ptr, bias_ptr, pdict_ptr, x0re_ptr, x0im_ptr, mask_ptr,
                       y_ptr, xsre_ptr, xsim_ptr, lastre_ptr, lastim_ptr, fscr_ptr, iscr_ptr,
                       L, H, W, su_b, su_l, sy_b, sy_l, snap_scale, phase_step,
                       K: tl.constexpr, N: tl.constexpr, P: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, T: tl.constexpr, GATE: tl.constexpr,
                       HAS_MASK: tl.constexpr, SNAP: tl.constexpr, LEVELS: tl.constexpr, STORE_STATES: tl.constexpr,
                       PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // H
    h = pid - b * H
    n = tl.arange(0, BLOCK_N)
    p = tl.arange(0, BLOCK_P)
    k = tl.arange(0, BLOCK_K)
    j = tl.arange(0, T)
    nm = n < N
    pm = p < P
    # per-head weights, on chip for the whole sequence: B as [p, n], C as [n, p] (re, im planes)
    wmask = pm[:, None] & nm[None, :]
    bw = bw_ptr + ((h * N + n[None, :]) * P + p[:, None]) * 2
    b_re_w = tl.load(bw, mask=wmask, other=0.0)
    b_im_w = tl.load(bw + 1, mask=wmask, other=0.0)
    cmask = nm[:, None] & pm[None, :]
    cw = c_ptr + ((h * P + p[None, :]) * N + n[:, None]) * 2
    c_re_w = tl.load(cw, mask=cmask, other=0.0)
    c_im_w = tl.load(cw + 1, mask=cmask, other=0.0)
    skip = tl.load(skip_ptr + h * P + p, mask=pm, other=0.0)
    bias = tl.load(bias_ptr + h * N + n, mask=nm, other=0.0)
    seq = b.to(tl.int64) * H + h
    x_re = tl.load(x0re_ptr + seq * N + n, mask=nm, other=0.0)
    x_im = tl.load(x0im_ptr + seq * N + n, mask=nm, other=0.0)
    fscr = fscr_ptr + pid.to(tl.int64) * (6 * T * BLOCK_N)       # D_re, D_im, b_re, b_im, x_re, x_im rows
    iscr = iscr_ptr + pid.to(tl.int64) * (T * BLOCK_N)           # P_t rows
    tile = j[:, None] * BLOCK_N + n[None, :]
    PLANE: tl.constexpr = T * BLOCK_N
    for c in range(0, L, T):
        # ---- the chunk, vectorised: selection, transition, injection ----
        t = c + j
        tm = t < L
        row = ((b.to(tl.int64) * L + t) * H + h) * W
        sel = tl.load(proj_ptr + row[:, None] + k[None, :], mask=tm[:, None] & (k[None, :] < K),
                      other=float("-inf")).to(tl.float32)
        kstar = tl.argmax(sel, axis=1, tie_break_left=True)
        valid = tm[:, None] & nm[None, :]
        a = tl.load(proj_ptr + row[:, None] + K + n[None, :], mask=valid, other=0.0).to(tl.float32) + bias[None, :]
        phase = tl.load(proj_ptr + row[:, None] + K + N + n[None, :], mask=valid, other=0.0).to(tl.float32)
        mag = 1.0 / (1.0 + tl.exp(a))
        if SNAP:
            mag = tl.minimum(mag * snap_scale, 1.0)
        if LEVELS:
            phase = tl.floor(phase / phase_step + 0.5) * phase_step
        d_re = mag * tl.cos(phase)
        d_im = mag * tl.sin(phase)
        pt = tl.load(pdict_ptr + (h * K + kstar[:, None]) * N + n[None, :], mask=valid, other=0)
        if HAS_MASK:
            keep = (tl.load(mask_ptr + b.to(tl.int64) * L + t, mask=tm, other=1) != 0)[:, None]
            d_re = tl.where(keep, d_re, 1.0)
            d_im = tl.where(keep, d_im, 0.0)
            pt = tl.where(keep, pt, n[None, :])
        ucols = b.to(tl.int64) * su_b + t[:, None].to(tl.int64) * su_l + h * P + p[None, :]
        u = tl.load(u_ptr + ucols, mask=tm[:, None] & pm[None, :], other=0.0).to(tl.float32)
        if GATE == 4:   # "off": no injection
            inj_re = tl.zeros((T, BLOCK_N), dtype=tl.float32)
            inj_im = tl.zeros((T, BLOCK_N), dtype=tl.float32)
        else:
            inj_re = tl.dot(u, b_re_w, input_precision=PRECISION)
            inj_im = tl.dot(u, b_im_w, input_precision=PRECISION)
            if GATE == 1 or GATE == 2:
                g = tl.load(proj_ptr + row + W - 1, mask=tm, other=0.0).to(tl.float32)
                if GATE == 1:
                    g = 1.0 / (1.0 + tl.exp(-g))
                else:
                    g = tl.minimum(tl.maximum(0.5 + g, 0.0), 1.0)
                inj_re = inj_re * g[:, None]
                inj_im = inj_im * g[:, None]
            if GATE == 3:   # 1 - |D| (before padding's identity; u is zero there anyway)
                if SNAP:
                    g2 = tl.maximum(1.0 - snap_scale / (1.0 + tl.exp(a)), 0.0)
                else:
                    g2 = 1.0 / (1.0 + tl.exp(-a))
                inj_re = inj_re * g2
                inj_im = inj_im * g2
        tl.store(fscr + tile, d_re)
        tl.store(fscr + PLANE + tile, d_im)
        tl.store(fscr + 2 * PLANE + tile, inj_re)
        tl.store(fscr + 3 * PLANE + tile, inj_im)
        tl.store(iscr + tile, pt)
        tl.debug_barrier()
        # ---- token by token: x_t = P_t (D_t x_{t-1}) + b_t, the scatter as a one-hot reduction ----
        for i in tl.static_range(T):
            o = i * BLOCK_N + n
            dr = tl.load(fscr + o)
            di = tl.load(fscr + PLANE + o)
            br = tl.load(fscr + 2 * PLANE + o)
            bi = tl.load(fscr + 3 * PLANE + o)
            dest = tl.load(iscr + o)
            dxr = dr * x_re - di * x_im
            dxi = dr * x_im + di * x_re
            hit = dest[None, :] == n[:, None]                       # [destination n, source m]
            nr = tl.sum(tl.where(hit, dxr[None, :], 0.0), axis=1) + br
            ni = tl.sum(tl.where(hit, dxi[None, :], 0.0), axis=1) + bi
            live = c + i < L
            x_re = tl.where(live, nr, x_re)
            x_im = tl.where(live, ni, x_im)
            tl.store(fscr + 4 * PLANE + o, x_re)
            tl.store(fscr + 5 * PLANE + o, x_im)
        tl.debug_barrier()
        # ---- the chunk's readout y = Re(C x) + D_skip u ----
        xr = tl.load(fscr + 4 * PLANE + tile)
        xi = tl.load(fscr + 5 * PLANE + tile)
        y = tl.dot(xr, c_re_w, input_precision=PRECISION) - tl.dot(xi, c_im_w, input_precision=PRECISION)
        y += skip[None, :] * u
        ycols = b.to(tl.int64) * sy_b + t[:, None].to(tl.int64) * sy_l + h * P + p[None, :]
        tl.store(y_ptr + ycols, y.to(y_ptr.dtype.element_ty), mask=tm[:, None] & pm[None, :])
        if STORE_STATES:
            xo = (seq * L + t[:, None]) * N + n[None, :]
            tl.store(xsre_ptr + xo, xr, mask=valid)
            tl.store(xsim_ptr + xo, xi, mask=valid)
        tl.debug_barrier()
    tl.store(lastre_ptr + seq * N + n, x_re, mask=nm)
    tl.store(lastim_ptr + seq * N + n, x_im, mask=nm)


# Tokens per chunk and warps per program; bench/fused_middle.py times alternatives on the GPU.
CONFIG = {"chunk": 16, "num_warps": 1}
MAX_STATE = 64   # the [N, N] one-hot step costs N^2 per token; larger states take the separate kernels


def middle_fwd_pays(batch: int, heads: int, state_size: int, length: int, device: torch.device) -> bool:
    """Whether the one-program-per-sequence kernel beats the separate kernels (whose scan splits a sequence into
    chunks): enough (sequence, head) pairs to fill the GPU, or a single token (decode), and N <= MAX_STATE."""
    if state_size > MAX_STATE:
        return False
    if length == 1 or torch.device(device).type != "cuda":   # off CUDA: only Triton's interpreter runs it
        return True
    return batch * heads >= 4 * torch.cuda.get_device_properties(device).multi_processor_count


def middle_fwd(proj, u, Bw, C, D_skip, decay_bias, P_dict, x0_re, x0_im, mask=None, b_gate=None,
               unit_snap: float = 0.0, phase_levels: int = 0, states=None, y=None, last=None,
               precision: str = "ieee", config: dict | None = None):
    """(y [b, L, H*P] in u's dtype, last state (re, im) [b, H, N] float32); every state written into `states`
    ((re, im) [b, H, L, N] float32 contiguous) when given, for the backward.

    proj [b, L, H, W] the x_proj output (K selector logits | N decay logits | N phases | gate column), u [b, L, H*P]
    (unit last stride), Bw [H, N, P, 2] and C [H, P, N, 2] float32 contiguous, D_skip [H, P] float32, decay_bias
    [H*N], P_dict [H, K, N] (int), x0 planes [b, H, N] float32, mask [b, L] (0 = padding) or None; b_gate one of
    GATES. y, last: outputs to write into (y with any row strides), else new tensors. precision: the products'
    tl.dot input precision ("ieee" exact float32, "tf32" for half layers)."""
    cfg = CONFIG if config is None else config
    bsz, L, H, W = proj.shape
    K, N = P_dict.shape[1], P_dict.shape[2]
    P = C.shape[1]
    dev = proj.device
    if y is None:
        y = torch.empty(bsz, L, H * P, device=dev, dtype=u.dtype)
    if last is None:
        last = (torch.empty(bsz, H, N, device=dev, dtype=torch.float32),
                torch.empty(bsz, H, N, device=dev, dtype=torch.float32))
    if bsz * H == 0:
        return y, last
    T = cfg["chunk"]
    bn = max(16, triton.next_power_of_2(N))
    fscr = torch.empty(bsz * H * 6 * T * bn, device=dev, dtype=torch.float32)
    iscr = torch.empty(bsz * H * T * bn, device=dev, dtype=torch.int32)
    mask_t = mask.to(torch.int8).contiguous() if mask is not None else iscr
    step = 2 * math.pi / phase_levels if phase_levels else 1.0
    _middle_fwd_kernel[(bsz * H,)](
        proj.contiguous(), u, Bw, C, D_skip, decay_bias.contiguous(), P_dict.to(torch.int32).contiguous(),
        x0_re.contiguous(), x0_im.contiguous(), mask_t, y, *(states if states is not None else last), *last,
        fscr, iscr, L, H, W, u.stride(0), u.stride(1), y.stride(0), y.stride(1), 1.0 + float(unit_snap), step,
        K=K, N=N, P=P, BLOCK_K=triton.next_power_of_2(K), BLOCK_N=bn, BLOCK_P=max(16, triton.next_power_of_2(P)),
        T=T, GATE=GATES[b_gate], HAS_MASK=mask is not None, SNAP=bool(unit_snap), LEVELS=bool(phase_levels),
        STORE_STATES=states is not None, PRECISION=precision, num_warps=cfg["num_warps"])
    return y, last

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
b planes. One program walks one whole sequence, so it can pay only with many (sequence, head) pairs;
`middle_fwd_pays` says when it runs. The same kernel at L = 1 is the decode step. `middle_bwd` is its backward,
also one kernel per (sequence, head).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..pd_transition.triton_fused import polar_parts, tau_in_memory

GATES = {None: 0, "sigmoid": 1, "hard": 2, "decay": 3, "off": 4}


@triton.jit
def _chunk_transition(proj_ptr, pdict_ptr, mask_ptr, bias, b, h, t, tm, n, k, L, H, W, snap_scale, phase_step,
                      K: tl.constexpr, N: tl.constexpr, HAS_MASK: tl.constexpr, SNAP: tl.constexpr,
                      LEVELS: tl.constexpr):
    """One chunk's selection and transition, as both kernels need them: the tokens' row offsets, the selector
    logits and k*, D_t's polar parts and planes (zero outside the tokens and the state), P_t (the selected member)
    and `keep` (False at padding, where a step is the identity: D = 1, P = I; all True without a mask)."""
    row = ((b.to(tl.int64) * L + t) * H + h) * W
    sel = tl.load(proj_ptr + row[:, None] + k[None, :], mask=tm[:, None] & (k[None, :] < K),
                  other=float("-inf")).to(tl.float32)
    kstar = tl.argmax(sel, axis=1, tie_break_left=True)
    valid = tm[:, None] & (n[None, :] < N)
    mag, dmag, cos, sin, a = polar_parts(proj_ptr, bias, row, n, tm, snap_scale, phase_step, K, N, SNAP, LEVELS)
    d_re = tl.where(valid, mag * cos, 0.0)
    d_im = tl.where(valid, mag * sin, 0.0)
    pt = tl.load(pdict_ptr + (h * K + kstar[:, None]) * N + n[None, :], mask=valid, other=0)
    keep = tm[:, None] | True
    if HAS_MASK:
        keep = (tl.load(mask_ptr + b.to(tl.int64) * L + t, mask=tm, other=1) != 0)[:, None]
        d_re = tl.where(keep, d_re, 1.0)
        d_im = tl.where(keep, d_im, 0.0)
        pt = tl.where(keep, pt, n[None, :])
    return row, sel, kstar, valid, mag, dmag, cos, sin, a, d_re, d_im, pt, keep


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
    bias = tl.load(bias_ptr + h * N + n, mask=nm, other=0.0).to(tl.float32)
    seq = b.to(tl.int64) * H + h
    x_re = tl.load(x0re_ptr + seq * N + n, mask=nm, other=0.0)
    x_im = tl.load(x0im_ptr + seq * N + n, mask=nm, other=0.0)
    fscr = fscr_ptr + pid.to(tl.int64) * (4 * T * BLOCK_N)       # D_re, D_im, b_re, b_im rows
    iscr = iscr_ptr + pid.to(tl.int64) * (T * BLOCK_N)           # P_t rows
    tile = j[:, None] * BLOCK_N + n[None, :]
    PLANE: tl.constexpr = T * BLOCK_N
    for c in range(0, L, T):
        # ---- the chunk, vectorised: selection, transition, injection ----
        t = c + j
        tm = t < L
        row, _, _, valid, _, _, _, _, a, d_re, d_im, pt, _ = _chunk_transition(
            proj_ptr, pdict_ptr, mask_ptr, bias, b, h, t, tm, n, k, L, H, W, snap_scale, phase_step, K, N, HAS_MASK,
            SNAP, LEVELS)
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
        # only loads in this loop (the states go into register tiles). The token and dictionary loops are not
        # unrolled: unrolled, one specialisation took 8-16 s to compile (sm_90), the CUDA test's ~70 over ten minutes
        xr = tl.zeros((T, BLOCK_N), dtype=tl.float32)
        xi = tl.zeros((T, BLOCK_N), dtype=tl.float32)
        for i in range(T):
            o = i * BLOCK_N + n
            dr = tl.load(fscr + o)
            di = tl.load(fscr + PLANE + o)
            br = tl.load(fscr + 2 * PLANE + o)
            bi = tl.load(fscr + 3 * PLANE + o)
            dest = tl.load(iscr + o)
            dxr = dr * x_re - di * x_im
            dxi = dr * x_im + di * x_re
            # [source m, destination n]: summed over axis 0, which Triton keeps inside each thread (a thread per
            # destination); the transposed tile sums across lanes, ~10x the shuffles, and ran ~10x slower
            hit = dest[:, None] == n[None, :]
            nr = tl.sum(tl.where(hit, dxr[:, None], 0.0), axis=0) + br
            ni = tl.sum(tl.where(hit, dxi[:, None], 0.0), axis=0) + bi
            live = c + i < L
            x_re = tl.where(live, nr, x_re)
            x_im = tl.where(live, ni, x_im)
            xr = tl.where(j[:, None] == i, x_re[None, :], xr)
            xi = tl.where(j[:, None] == i, x_im[None, :], xi)
        # ---- the chunk's readout y = Re(C x) + D_skip u ----
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


# Tokens per chunk and warps per program (timed against alternatives on the GPU by bench/fused_middle.py,
# now in git: `git show 8438c3e:bench/fused_middle.py`). decode /
# min_pairs_per_sm: where these kernels replace the separate ones: decode=True runs a one-token step here (one
# launch instead of ~20: 0.78 ms a layer step at batch 32 against fla DeltaNet's 1.06 on an H100), and
# min_pairs_per_sm=k runs longer sequences here once batch x heads >= k x the multiprocessors. The latter stays off:
# at B=32, L=2048 (bf16, width 1024, H100) the layer takes 17.9 ms forward + backward this way against 16.0 with
# the separate kernels, its backward kernel alone 8.0 ms (docs/kernels.md). `bench/layer_compare.py --kinds pdssm
# pdssm-one` compares the two.
CONFIG = {"chunk": 16, "num_warps": 1, "decode": True, "min_pairs_per_sm": None}
MAX_STATE = 64   # the [N, N] one-hot step costs N^2 per token; larger states take the separate kernels


def middle_fwd_pays(batch: int, heads: int, state_size: int, length: int, device: torch.device) -> bool:
    """Whether the one-program-per-sequence kernels run instead of the separate ones (whose scan splits a sequence
    into chunks): with CONFIG["decode"], a single token (one launch instead of ~20), or CONFIG["min_pairs_per_sm"]
    reached; and N <= MAX_STATE."""
    if state_size > MAX_STATE:
        return False
    if torch.device(device).type != "cuda":   # off CUDA: only Triton's interpreter runs it
        return True
    if length == 1:
        return bool(CONFIG["decode"])
    if CONFIG["min_pairs_per_sm"] is None:
        return False
    return batch * heads >= CONFIG["min_pairs_per_sm"] * torch.cuda.get_device_properties(device).multi_processor_count


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
    fscr = torch.empty(bsz * H * 4 * T * bn, device=dev, dtype=torch.float32)
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


@triton.jit
def _middle_bwd_kernel(proj_ptr, u_ptr, gy_ptr, xsre_ptr, xsim_ptr, x0re_ptr, x0im_ptr, glre_ptr, glim_ptr, mask_ptr,
                       bw_ptr, c_ptr, skip_ptr, bias_ptr, pdict_ptr,
                       gproj_ptr, gu_ptr, lamre_ptr, lamim_ptr, dxre_ptr, dxim_ptr, kstar_ptr, gx0re_ptr, gx0im_ptr,
                       gc_ptr, gskip_ptr, gbw_ptr, gbias_ptr, fscr_ptr, iscr_ptr,
                       L, H, W, su_b, su_l, sg_b, sg_l, tau_ptr, snap_scale, phase_step,
                       K: tl.constexpr, N: tl.constexpr, P: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, T: tl.constexpr,
                       GATE: tl.constexpr, HAS_MASK: tl.constexpr, HAS_GLAST: tl.constexpr, SNAP: tl.constexpr,
                       LEVELS: tl.constexpr, PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // H
    h = pid - b * H
    n = tl.arange(0, BLOCK_N)
    p = tl.arange(0, BLOCK_P)
    k = tl.arange(0, BLOCK_K)
    j = tl.arange(0, T)
    nm = n < N
    pm = p < P
    km = k < K
    # per-head weights: C as [p, n] (dL/dx = g C), B as [n, p] (dL/du = dL/db B) and its transpose (b = u B^T)
    pn = pm[:, None] & nm[None, :]
    cw = c_ptr + ((h * P + p[:, None]) * N + n[None, :]) * 2
    c_re = tl.load(cw, mask=pn, other=0.0)
    c_im = tl.load(cw + 1, mask=pn, other=0.0)
    np_mask = nm[:, None] & pm[None, :]
    bw = bw_ptr + ((h * N + n[:, None]) * P + p[None, :]) * 2
    b_re = tl.load(bw, mask=np_mask, other=0.0)
    b_im = tl.load(bw + 1, mask=np_mask, other=0.0)
    skip = tl.load(skip_ptr + h * P + p, mask=pm, other=0.0)
    bias = tl.load(bias_ptr + h * N + n, mask=nm, other=0.0).to(tl.float32)
    gc_re = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    gc_im = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    gb_re_w = tl.zeros((BLOCK_N, BLOCK_P), dtype=tl.float32)
    gb_im_w = tl.zeros((BLOCK_N, BLOCK_P), dtype=tl.float32)
    gskip = tl.zeros((BLOCK_P,), dtype=tl.float32)
    gbias = tl.zeros((BLOCK_N,), dtype=tl.float32)
    seq = b.to(tl.int64) * H + h
    if HAS_GLAST:   # dL/d(last state) enters lam at the last token
        carry_re = tl.load(glre_ptr + seq * N + n, mask=nm, other=0.0)
        carry_im = tl.load(glim_ptr + seq * N + n, mask=nm, other=0.0)
    else:
        carry_re = tl.zeros((BLOCK_N,), dtype=tl.float32)
        carry_im = tl.zeros((BLOCK_N,), dtype=tl.float32)
    fscr = fscr_ptr + pid.to(tl.int64) * (6 * T * BLOCK_N)
    iscr = iscr_ptr + pid.to(tl.int64) * (T * BLOCK_N)
    tile = j[:, None] * BLOCK_N + n[None, :]
    PLANE: tl.constexpr = T * BLOCK_N
    gdt = gproj_ptr.dtype.element_ty
    chunks = tl.cdiv(L, T)
    for ci in range(chunks):
        c = (chunks - 1 - ci) * T          # chunks last-first
        t = c + j
        tm = t < L
        kmask = tm[:, None] & km[None, :]
        row, sel, kstar, valid, mag, dmag, cos, sin, a, d_re, d_im, pt, keep = _chunk_transition(
            proj_ptr, pdict_ptr, mask_ptr, bias, b, h, t, tm, n, k, L, H, W, snap_scale, phase_step, K, N, HAS_MASK,
            SNAP, LEVELS)
        tl.store(kstar_ptr + seq * L + t, kstar.to(tl.int64), mask=tm)
        sig = 1.0 / (1.0 + tl.exp(a))      # sigmoid(-a) before the snap: the decay gate's derivative
        # readout backward: dL/dx = (g C_re, -g C_im); dL/dC += (g^T x_re, -g^T x_im); dL/dD_skip += sum g u
        pmask = tm[:, None] & pm[None, :]
        gcols = b.to(tl.int64) * sg_b + t[:, None].to(tl.int64) * sg_l + h * P + p[None, :]
        gy = tl.load(gy_ptr + gcols, mask=pmask, other=0.0).to(tl.float32)
        ucols = b.to(tl.int64) * su_b + t[:, None].to(tl.int64) * su_l + h * P + p[None, :]
        u = tl.load(u_ptr + ucols, mask=pmask, other=0.0).to(tl.float32)
        xo = (seq * L + t[:, None]) * N + n[None, :]
        x_re = tl.load(xsre_ptr + xo, mask=valid, other=0.0)
        x_im = tl.load(xsim_ptr + xo, mask=valid, other=0.0)
        gyt = tl.trans(gy)
        gc_re += tl.dot(gyt, x_re, input_precision=PRECISION)
        gc_im -= tl.dot(gyt, x_im, input_precision=PRECISION)
        gskip += tl.sum(gy * u, axis=0)
        gx_re = tl.dot(gy, c_re, input_precision=PRECISION)
        gx_im = -tl.dot(gy, c_im, input_precision=PRECISION)
        # x_{t-1}: the previous row of the states, x0 before the first token
        has_prev = valid & (t[:, None] > 0)
        xp_re = tl.load(xsre_ptr + xo - N, mask=has_prev, other=0.0)
        xp_im = tl.load(xsim_ptr + xo - N, mask=has_prev, other=0.0)
        first = valid & (t[:, None] == 0)
        xp_re += tl.load(x0re_ptr + seq * N + n[None, :] + 0 * t[:, None], mask=first, other=0.0)
        xp_im += tl.load(x0im_ptr + seq * N + n[None, :] + 0 * t[:, None], mask=first, other=0.0)
        tl.store(fscr + tile, d_re)
        tl.store(fscr + PLANE + tile, d_im)
        tl.store(fscr + 2 * PLANE + tile, gx_re)
        tl.store(fscr + 3 * PLANE + tile, gx_im)
        tl.store(fscr + 4 * PLANE + tile, xp_re)
        tl.store(fscr + 5 * PLANE + tile, xp_im)
        tl.store(iscr + tile, pt)
        tl.debug_barrier()
        # ---- token by token, last first: lam_t = dL/dx_t + conj(D_{t+1}) lam_{t+1}[P_{t+1}] (a gather) ----
        # only loads in this loop; what it produces goes into register tiles (as in the forward)
        gd_re = tl.zeros((T, BLOCK_N), dtype=tl.float32)
        gd_im = tl.zeros((T, BLOCK_N), dtype=tl.float32)
        lam_re = tl.zeros((T, BLOCK_N), dtype=tl.float32)
        lam_im = tl.zeros((T, BLOCK_N), dtype=tl.float32)
        for i in range(T):
            o = (T - 1 - i) * BLOCK_N + n
            dr = tl.load(fscr + o)
            di = tl.load(fscr + PLANE + o)
            gr = tl.load(fscr + 2 * PLANE + o)
            gi = tl.load(fscr + 3 * PLANE + o)
            xpr = tl.load(fscr + 4 * PLANE + o)
            xpi = tl.load(fscr + 5 * PLANE + o)
            dest = tl.load(iscr + o)
            live = c + (T - 1 - i) < L
            lr = tl.where(live, gr + carry_re, 0.0)
            li = tl.where(live, gi + carry_im, 0.0)
            glr = tl.gather(lr, dest, 0)
            gli = tl.gather(li, dest, 0)
            carry_re = tl.where(live, dr * glr + di * gli, carry_re)
            carry_im = tl.where(live, dr * gli - di * glr, carry_im)
            here = j[:, None] == T - 1 - i
            gd_re = tl.where(here, (xpr * glr + xpi * gli)[None, :], gd_re)      # dL/dD = conj(x_{t-1}) lam[P]
            gd_im = tl.where(here, (xpr * gli - xpi * glr)[None, :], gd_im)
            lam_re = tl.where(here, lr[None, :], lam_re)                          # lam = dL/db
            lam_im = tl.where(here, li[None, :], lam_im)
        dx_re = d_re * xp_re - d_im * xp_im                                       # dx = D_t x_{t-1}
        dx_im = d_re * xp_im + d_im * xp_re
        if HAS_MASK:   # padding steps used the identity, not a dictionary member: no straight-through signal
            dx_re = tl.where(keep, dx_re, 0.0)
            dx_im = tl.where(keep, dx_im, 0.0)
        tl.store(lamre_ptr + xo, lam_re, mask=valid)
        tl.store(lamim_ptr + xo, lam_im, mask=valid)
        tl.store(dxre_ptr + xo, dx_re, mask=valid)
        tl.store(dxim_ptr + xo, dx_im, mask=valid)
        tl.debug_barrier()   # every thread is done with the scratch rows: dx takes their place
        tl.store(fscr + tile, dx_re)
        tl.store(fscr + PLANE + tile, dx_im)
        tl.debug_barrier()
        # selector sums r[t, k] = sum_m Re(conj(lam_t[P_dict[h, k, m]]) dx_t[m]): per source entry m one gather of
        # lam's columns P_dict[h, :, m] times dx's column m, so nothing is summed across lanes
        r = tl.zeros((T, BLOCK_K), dtype=tl.float32)
        for m in range(N):
            idx = tl.load(pdict_ptr + (h * K + k) * N + m, mask=km, other=0)
            idx = tl.broadcast_to(idx[None, :], (T, BLOCK_K))
            cr = tl.load(fscr + j * BLOCK_N + m)
            cim = tl.load(fscr + PLANE + j * BLOCK_N + m)
            r += tl.gather(lam_re, idx, 1) * cr[:, None] + tl.gather(lam_im, idx, 1) * cim[:, None]
        # the transition's backward: tempered softmax of the selector, polar and sigmoid derivatives
        inv_tau = 1.0 / tl.load(tau_ptr)
        sel = sel * inv_tau
        s = tl.exp(sel - tl.max(sel, axis=1)[:, None])
        s = tl.where(kmask, s / tl.sum(s, axis=1)[:, None], 0.0)
        g_sel = s * (r - tl.sum(s * r, axis=1)[:, None]) * inv_tau
        g_a = (gd_re * cos + gd_im * sin) * dmag
        g_phase = mag * (gd_im * cos - gd_re * sin)
        if HAS_MASK:
            g_sel = tl.where(keep, g_sel, 0.0)
            g_a = tl.where(keep, g_a, 0.0)
            g_phase = tl.where(keep, g_phase, 0.0)
        # the injection b = gate * (B u): its gate's gradient, dL/du and dL/dB
        gu = gy * skip[None, :]
        if GATE != 4:
            gb_re = lam_re
            gb_im = lam_im
            if GATE != 0:
                b0_re = tl.dot(u, tl.trans(b_re), input_precision=PRECISION)
                b0_im = tl.dot(u, tl.trans(b_im), input_precision=PRECISION)
                gg = lam_re * b0_re + lam_im * b0_im               # dL/d gate, per entry
                if GATE == 3:
                    if SNAP:
                        gate = tl.maximum(1.0 - snap_scale * sig, 0.0)
                        g_a += tl.where(gate > 0.0, gg * (1.0 - gate) * (1.0 - sig), 0.0)
                    else:
                        gate = 1.0 - sig
                        g_a += gg * gate * sig
                    gb_re = lam_re * gate
                    gb_im = lam_im * gate
                else:
                    z = tl.load(proj_ptr + row + W - 1, mask=tm, other=0.0).to(tl.float32)
                    g_gate = tl.sum(gg, axis=1)
                    if GATE == 1:
                        gate1 = 1.0 / (1.0 + tl.exp(-z))
                        g_col = g_gate * gate1 * (1.0 - gate1)
                    else:
                        gate1 = tl.minimum(tl.maximum(0.5 + z, 0.0), 1.0)
                        g_col = tl.where((0.5 + z >= 0.0) & (0.5 + z <= 1.0), g_gate, 0.0)
                    tl.store(gproj_ptr + row + W - 1, g_col.to(gdt), mask=tm)
                    gb_re = lam_re * gate1[:, None]
                    gb_im = lam_im * gate1[:, None]
            gu += tl.dot(gb_re, b_re, input_precision=PRECISION) + tl.dot(gb_im, b_im, input_precision=PRECISION)
            gb_re_w += tl.dot(tl.trans(gb_re), u, input_precision=PRECISION)
            gb_im_w += tl.dot(tl.trans(gb_im), u, input_precision=PRECISION)
        g_a = tl.where(valid, g_a, 0.0)
        gbias += tl.sum(g_a, axis=0)
        tl.store(gproj_ptr + row[:, None] + k[None, :], g_sel.to(gdt), mask=kmask)
        tl.store(gproj_ptr + row[:, None] + K + n[None, :], g_a.to(gdt), mask=valid)
        tl.store(gproj_ptr + row[:, None] + K + N + n[None, :], g_phase.to(gdt), mask=valid)
        if BLOCK_E > 0:   # columns this op does not read (a gate column is written above): zero gradient
            e = tl.arange(0, BLOCK_E)
            last_free = W - 1 if (GATE == 1 or GATE == 2) else W
            tl.store(gproj_ptr + row[:, None] + K + 2 * N + e[None, :], tl.zeros((T, BLOCK_E), dtype=gdt),
                     mask=tm[:, None] & (K + 2 * N + e[None, :] < last_free))
        tl.store(gu_ptr + ucols, gu.to(gu_ptr.dtype.element_ty), mask=pmask)
        tl.debug_barrier()
    tl.store(gx0re_ptr + seq * N + n, carry_re, mask=nm)    # dL/dx0 = conj(D_0) lam_0[P_0]
    tl.store(gx0im_ptr + seq * N + n, carry_im, mask=nm)
    go = (h * P + p[:, None]) * N + n[None, :]
    tl.atomic_add(gc_ptr + go, gc_re, mask=pn, sem="relaxed")
    tl.atomic_add(gc_ptr + H * P * N + go, gc_im, mask=pn, sem="relaxed")
    tl.atomic_add(gskip_ptr + h * P + p, gskip, mask=pm, sem="relaxed")
    tl.atomic_add(gbias_ptr + h * N + n, gbias, mask=nm, sem="relaxed")
    if GATE != 4:
        gw = (h * N + n[:, None]) * P + p[None, :]
        tl.atomic_add(gbw_ptr + gw, gb_re_w, mask=np_mask, sem="relaxed")
        tl.atomic_add(gbw_ptr + H * N * P + gw, gb_im_w, mask=np_mask, sem="relaxed")


BWD_CONFIG = {"chunk": 16, "num_warps": 4}


def middle_bwd(proj, u, g_y, states, x0, g_last, Bw, C, D_skip, decay_bias, P_dict, gC, gskip, gBw, gbias,
               tau, mask=None, b_gate=None, unit_snap: float = 0.0, phase_levels: int = 0,
               precision: str = "ieee", config: dict | None = None):
    """The backward of `middle_fwd` for one batch slice, per (sequence, head), chunks last-first:
    -> (dL/dproj [b, L, H, W] in proj's dtype, dL/du's skip and injection part [b, L, H*P] in u's dtype,
        lam = dL/db planes and dx = D_t x_{t-1} planes [b, H, L, N] float32 (zero at padding; for the dictionary's
        straight-through sum), k* [b, H, L] int64, dL/dx0 planes [b, H, N] float32).
    Adds into gC [2, H, P, N], gskip [H, P], gBw [2, H, N, P] (unless b_gate "off") and gbias [H*N] (float32).
    states: the forward's (x_re, x_im) [b, H, L, N]; x0, g_last: (re, im) planes [b, H, N] (g_last may be None).
    The selector's straight-through sums and the transition's backward happen inside; g_y [b, L, H*P] any row
    strides with a unit last stride."""
    cfg = BWD_CONFIG if config is None else config
    bsz, L, H, W = proj.shape
    K, N = P_dict.shape[1], P_dict.shape[2]
    P = C.shape[1]
    dev = proj.device
    proj = proj.contiguous()
    gproj = torch.empty_like(proj)
    g_u = torch.empty(bsz, L, H * P, device=dev, dtype=u.dtype)
    lam = (torch.empty(bsz, H, L, N, device=dev, dtype=torch.float32),
           torch.empty(bsz, H, L, N, device=dev, dtype=torch.float32))
    dx = (torch.empty_like(lam[0]), torch.empty_like(lam[0]))
    kstar = torch.empty(bsz, H, L, device=dev, dtype=torch.int64)
    gx0 = (torch.empty(bsz, H, N, device=dev, dtype=torch.float32),
           torch.empty(bsz, H, N, device=dev, dtype=torch.float32))
    if bsz * H == 0 or L == 0:
        return gproj, g_u, lam, dx, kstar, gx0
    T = cfg["chunk"]
    bn = max(16, triton.next_power_of_2(N))
    fscr = torch.empty(bsz * H * 6 * T * bn, device=dev, dtype=torch.float32)
    iscr = torch.empty(bsz * H * T * bn, device=dev, dtype=torch.int32)
    mask_t = mask.to(torch.int8).contiguous() if mask is not None else iscr
    step = 2 * math.pi / phase_levels if phase_levels else 1.0
    extra = W - K - 2 * N
    glast = g_last if g_last is not None else gx0
    _middle_bwd_kernel[(bsz * H,)](
        proj, u, g_y, states[0], states[1], x0[0].contiguous(), x0[1].contiguous(), glast[0].contiguous(),
        glast[1].contiguous(), mask_t, Bw, C, D_skip, decay_bias.contiguous(), P_dict.to(torch.int32).contiguous(),
        gproj, g_u, *lam, *dx, kstar, *gx0, gC, gskip, gBw if gBw is not None else gC, gbias, fscr, iscr,
        L, H, W, u.stride(0), u.stride(1), g_y.stride(0), g_y.stride(1), tau_in_memory(tau, dev),
        1.0 + float(unit_snap),
        step, K=K, N=N, P=P, BLOCK_K=triton.next_power_of_2(K), BLOCK_N=bn,
        BLOCK_P=max(16, triton.next_power_of_2(P)), BLOCK_E=triton.next_power_of_2(extra) if extra else 0, T=T,
        GATE=GATES[b_gate], HAS_MASK=mask is not None, HAS_GLAST=g_last is not None, SNAP=bool(unit_snap),
        LEVELS=bool(phase_levels), PRECISION=precision, num_warps=cfg["num_warps"])
    return gproj, g_u, lam, dx, kstar, gx0

"""The fused middle of a complex Flash PD-SSM layer on the GPU, from its input u to its readout, in one autograd
node (`fused_middle`); the layer runs it under `backend="auto"` or `"kernel"`.

    u --x_proj--> proj --pd_transition--> D planes, k*, P_t ;  u --B--> b planes
        --pd_scan (split planes)--> x planes --> y = Re(C x) + D_skip u
    backward, one batch slice at a time: dL/dx from dL/dy -> scan backward (gather) -> straight-through sums
    (dx rebuilt in the kernels) -> pd_transition backward -> dL/du and the weights' gradients

Same maths as the layer's torch path (`_ssm_inputs` + `pd_select_scan` + `_readout`), which is its reference in
tests; the difference is memory traffic and peak memory. Complex values stay split in real planes (float32, or for
half-precision layers bfloat16 but for D: `_FusedMiddle.HALF_PLANES`), so no complex tensor and no float32 copy of
the projection is ever made; the backward keeps only u, the projection (in u's dtype), the states and the weights:
D, P_t and k* are recomputed per slice, and every state-sized temporary lives for one batch slice. The per-head
products around the scan (readout, its backward, the injection's backward) are Triton kernels
(`ops/pd_select/triton_readout.py`) that read u, y and their gradients in the layer's [B, L, H*P] layout.

Second form, where `one_kernel_pays` (`triton_middle.CONFIG`: decode steps by default; longer sequences only when
asked, slower there): after the projection, each pass is one Triton kernel per (sequence, head) with the state on
chip (`ops/pd_select/triton_middle.py`); the backward adds only the dictionary's grouped sum and the projection's
products. It needs no pd_scan extension.
CUDA only: `usable(u)` says whether it can run.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..ops import fast_path
from ..ops.pd_select.function import column_argmax, softmax_jacobian_apply, straight_through_tau


# Head sizes (state N, head width P) the fused op serves: its Triton products keep a head's [P, N] weight planes and
# their gradients on chip, and at 96 (blocks of 128) they outgrow an H100's shared memory (360 of 232 KB asked).
# Larger heads run the layer's torch path, whose scan is still the pd_scan CUDA kernels.
MAX_HEAD_SIZE = 64


def fits(state_size: int, head_dim: int) -> bool:
    """Whether a layer's heads are small enough for the fused op (`MAX_HEAD_SIZE`)."""
    return max(state_size, head_dim) <= MAX_HEAD_SIZE


def usable(u: torch.Tensor, triton_only: bool = False) -> bool:
    """Whether `fused_middle` can run for the layer input u: a CUDA tensor of float32/bfloat16/float16, Triton
    importable and (unless `triton_only`: where `one_kernel_pays`, which needs no pd_scan extension) the pd_scan
    kernels built (`ops.fast_path`)."""
    return fast_path.cuda_fast_path(u, dtypes=fast_path.FLOAT_DTYPES, scan_kernels=not triton_only, triton=True)


def one_kernel_pays(batch: int, heads: int, state_size: int, length: int, device) -> bool:
    """Whether the forward runs as one kernel per (sequence, head) (`ops/pd_select/triton_middle.py`)."""
    from ..ops.pd_select.triton_middle import middle_fwd_pays
    return middle_fwd_pays(batch, heads, state_size, length, device)


def _batch_slices(B: int, bytes_per_sequence: int, budget: int):
    """As few batch slices as the budget allows, of near-equal size (16 in 3 slices: 6, 5, 5)."""
    n = -(-B // max(1, budget // max(1, bytes_per_sequence)))
    bounds = [B * i // n for i in range(n + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


B_GATES = (None, "sigmoid", "hard", "decay", "off")


def _gate(proj: torch.Tensor, decay_bias: torch.Tensor, b_gate: str | None, K: int, N: int, unit_snap: float = 0.0):
    """The b-gate of FlashPDSSM from one slice of the projection [b, L, H, W]: float32 [b, H, L, 1 or N]
    (None for no gate): sigmoid / hard of the last column, or 1 - |D_t| for "decay" (= sigmoid(a_t), or
    max(0, 1 - (1 + unit_snap) sigmoid(-a_t)) with the snapped magnitude)."""
    if b_gate == "sigmoid":
        return torch.sigmoid(proj[..., -1].float()).transpose(1, 2).unsqueeze(-1)
    if b_gate == "hard":
        return (0.5 + proj[..., -1].float()).clamp(0, 1).transpose(1, 2).unsqueeze(-1)
    if b_gate == "decay":
        H = proj.shape[2]
        a = proj[..., K:K + N].float() + decay_bias.float().view(H, N)
        if unit_snap:
            return (1 - (1 + unit_snap) * torch.sigmoid(-a)).clamp_min(0).transpose(1, 2)
        return torch.sigmoid(a).transpose(1, 2)
    return None


def _gate_backward(proj, gate, g_gate, gproj, b_gate, K, N, unit_snap: float = 0.0):
    """Adds the gate's gradient (g_gate, shaped like gate) into gproj; returns its part of dL/d decay_bias."""
    if b_gate == "decay":
        if unit_snap:  # gate = 1 - c s with s = sigmoid(-a), c = 1 + unit_snap: d gate / da = c s (1 - s), 0 if clamped
            s = (1 - gate) / (1 + unit_snap)
            g_a = torch.where(gate > 0, g_gate * (1 - gate) * (1 - s), torch.zeros_like(gate)).transpose(1, 2)
        else:
            g_a = (g_gate * gate * (1 - gate)).transpose(1, 2)                    # [b, L, H, N]
        gproj[..., K:K + N] += g_a.to(gproj.dtype)
        return g_a.sum((0, 1)).reshape(-1)
    if b_gate == "sigmoid":
        g_col = g_gate * gate * (1 - gate)
    else:  # hard: (0.5 + z).clamp(0, 1) passes the gradient where it is not clamped
        z = 0.5 + proj[..., -1].float().transpose(1, 2).unsqueeze(-1)
        g_col = torch.where((z >= 0) & (z <= 1), g_gate, torch.zeros_like(g_gate))
    gproj[..., -1] += g_col.squeeze(-1).transpose(1, 2).to(gproj.dtype)
    return None


class _Grads:
    """The input and weight gradients that both backwards (separate kernels, one kernel) accumulate over the
    batch slices, and the autograd return built from them. The small ones sum in float32; the x projection's
    weight gradient, as large as the weight, sums in u's dtype through the GEMM's own accumulator (one rounding
    a slice, as autograd's linear layer rounds once): a float32 copy cost a zero fill, a cast and an add over it
    per slice (~0.2 ms of a 3.4 ms layer step at width 2560, B=1, by its bytes; docs/bench/layer.md, "Where the
    GPU time goes")."""

    def __init__(self, u, Wx, M, C, b_gate):
        B, dev = u.shape[0], u.device
        H, K, N = M.shape[:3]
        P = C.shape[1]
        self.u = torch.empty_like(u)
        self.x0 = torch.empty(B, H, N, dtype=torch.complex64, device=dev)
        # the small sums share one zeroed buffer: one fill instead of five launches (the backward is host-bound at
        # small shapes; docs/bench/layer.md, "Host time")
        shapes = [(H, K, N, N), (2, H, P, N), (H, P), (H * N,), (2, H, N, P) if b_gate != "off" else (0,)]
        sizes = [math.prod(shape) for shape in shapes]
        sums = torch.zeros(sum(sizes), dtype=torch.float32, device=dev).split(sizes)
        # G: the dictionary sums, before the softmax's Jacobian
        self.G, self.C, self.skip, self.bias, Bw = (t.view(shape) for t, shape in zip(sums, shapes))
        self.Bw = None if b_gate == "off" else Bw
        self.Wx = None

    def add_projection(self, sl, gproj, g_ub, u, Wu):
        """The projection proj = u Wx^T of batch slice `sl`: dL/dWx += dL/dproj^T u, and dL/du = dL/dproj Wx plus
        `g_ub`, the skip's and the injection's part."""
        b, L, d = u[sl].shape
        gp = gproj.reshape(b * L, -1)
        ub = u[sl].reshape(b * L, d)
        self.Wx = gp.t() @ ub if self.Wx is None else self.Wx.addmm_(gp.t(), ub)
        torch.addmm(g_ub.view(b * L, d), gp, Wu, out=self.u[sl].view(b * L, d))

    def result(self, tau, Wx, decay_bias, M, Bw, C, D_skip):
        """fused_middle's gradients, in its inputs' order and dtypes (None for the non-tensor inputs)."""
        gM = softmax_jacobian_apply(M, self.G, tau, dim=-2)
        gC = torch.stack([self.C[0], self.C[1]], dim=-1).to(C.dtype)
        gBw = None if self.Bw is None else torch.stack([self.Bw[0], self.Bw[1]], dim=-1).to(Bw.dtype)
        return (self.u, self.Wx.to(Wx.dtype), self.bias.to(decay_bias.dtype).view(decay_bias.shape), gM, gBw,
                self.x0, gC, self.skip.to(D_skip.dtype), None, None, None, None, None, None)


class _FusedMiddle(torch.autograd.Function):
    # Both passes walk the batch in slices whose temporaries (the projection and its gradient, b and D planes,
    # P_t, k*, dL/dx = dL/db, dL/dD, r) stay near this many bytes: the backward runs while the whole graph's
    # activations are alive, so they add straight onto the layer's peak memory, while each slice costs some
    # fixed launch work (bench/layer_compare.py --pdssm-slice-mib measures the trade-off). 3 GiB: at width 1024,
    # B=32 on an H100 (bf16 planes), 2 slices instead of 3 at L=2048 took 12.2-12.5 ms instead of 13.3-14.0, one
    # slice 11.9-12.1 but a peak of 2.9 GiB (fla DeltaNet's 4.6; BENCHMARKS.md)
    SLICE_BYTES = 3 << 30
    # the separate kernels' backward reads the projection again: kept from the forward (in u's dtype, 2W bytes a
    # token and head, less than the float32 states kept beside it) instead of a second x_proj product. At width
    # 1024, B=32 on an H100: 4% off forward + backward at L = 4096 and 8192, for 10-20% more peak (BENCHMARKS.md)
    KEEP_PROJECTION = True

    # the dtype of the state-sized planes (b, x, dL/dx, dL/dD) of the separate kernels' path: bfloat16 for
    # half-precision layers (D stays float32: pd_scan's mixed form), float32 for float32 layers, whose reference is
    # exact. At width 1024, B=32 on an H100: 9% off forward + backward at L = 4096 and 8192 (noisy at 2048), 17-22%
    # off the peak (BENCHMARKS.md); the README's main job on the GPU learns as with float32 planes
    HALF_PLANES = True

    @staticmethod
    def plane_dtype(dtype: torch.dtype) -> torch.dtype:
        return torch.bfloat16 if _FusedMiddle.HALF_PLANES and dtype != torch.float32 else torch.float32

    @staticmethod
    def _slices(B, L, H, N, K, P, W, plane_bytes):
        # bytes a token and head: D and P_t (10N, 12 with room), three pairs of state-sized planes of `plane_bytes`
        # (b or dL/dx = dL/db, dL/dD, the gate's b), r, the projection's gradient and u's
        per_sequence = L * H * ((12 + 6 * plane_bytes) * N + 4 * K + 12 * P + 4 * W + 8)
        return _batch_slices(B, per_sequence, _FusedMiddle.SLICE_BYTES)

    # the one-kernel path's programs each walk a whole sequence, so a launch needs this many (sequence, head) pairs
    # per multiprocessor to keep the GPU busy: slices of ~11 sequences x 32 heads (2.6 a multiprocessor on an H100)
    # made its kernels ~3x slower per step than their single-launch estimate (BENCHMARKS.md)
    PAIRS_PER_SM = 8

    @staticmethod
    def _slices_one_kernel(B, L, H, N, P, W, device):
        """Batch slices for the one-kernel path: as few as the memory budget allows (per sequence: the projection and
        its gradient, the lam and dx planes, dL/du's part), but never so small that a launch leaves the GPU idle."""
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        per_sequence = L * H * (4 * W + 16 * N + 2 * P + 8)
        fill = -(-_FusedMiddle.PAIRS_PER_SM * sms // H) * per_sequence
        return _batch_slices(B, per_sequence, max(_FusedMiddle.SLICE_BYTES, fill))

    @staticmethod
    def forward(ctx, u, Wx, decay_bias, M, Bw, x0, C, D_skip, tau, mask, b_gate, unit_snap, phase_levels, grad):
        from ..ops.pd_scan.cuda import pd_scan_fwd_cuda_split
        from ..ops.pd_transition.triton_fused import transition_fwd_triton
        from ..ops.pd_select import triton_middle
        from ..ops.pd_select.triton_readout import injection_fwd, readout_fwd

        if u.stride(-1) != 1:
            u = u.contiguous()
        B, L, _ = u.shape
        H, K, N = M.shape[:3]
        P = C.shape[1]
        W = Wx.shape[0] // H
        precision = "ieee" if u.dtype == torch.float32 else "tf32"
        Wu = Wx.to(u.dtype)
        # one kernel per (sequence, head) where there are enough of them (triton_middle.py); else the separate
        # transition, injection, scan and readout kernels. States are kept only for a backward.
        one_kernel = one_kernel_pays(B, H, N, L, u.device)
        keep_states = grad or not one_kernel   # (ctx.needs_input_grad is set under no_grad too)
        keep_proj = grad and not one_kernel and _FusedMiddle.KEEP_PROJECTION
        proj_kept = torch.empty(B, L, H * W, dtype=u.dtype, device=u.device) if keep_proj else None
        # the one-kernel path keeps its states in float32 (its backward rebuilds the steps from them)
        planes = torch.float32 if one_kernel else _FusedMiddle.plane_dtype(u.dtype)
        slices = (_FusedMiddle._slices_one_kernel(B, L, H, N, P, W, u.device) if one_kernel
                  else _FusedMiddle._slices(B, L, H, N, K, P, W, planes.itemsize))

        def project(sl):
            b = u[sl].shape[0]
            if keep_proj:
                return torch.matmul(u[sl], Wu.t(), out=proj_kept[sl]).view(b, L, H, W)
            return F.linear(u[sl], Wu).view(b, L, H, W)

        # the first slice's projection is queued before the setup below: its small launches cost more host time
        # than the GPU spends on them, and the GPU would otherwise wait for them (docs/bench/layer.md, "Host time")
        proj = project(slices[0]) if slices else None
        P_dict = column_argmax(M)
        x_re = torch.empty(B, H, L, N, dtype=planes, device=u.device) if keep_states else None
        x_im = torch.empty_like(x_re) if keep_states else None
        last_re = torch.empty(B, H, N, dtype=torch.float32, device=u.device)
        last_im = torch.empty_like(last_re)
        y = torch.empty_like(u)
        # the parameters as the kernels read them: float32 for the one kernel, their own dtype for the others
        if one_kernel:
            Ck, skip, Bk = C.float().contiguous(), D_skip.float().contiguous(), Bw.float().contiguous()
            x0_re, x0_im = x0.real.contiguous(), x0.imag.contiguous()
        else:
            Ck, skip, Bk = C.contiguous(), D_skip.contiguous(), Bw.contiguous()
        for i, sl in enumerate(slices):
            if i:
                proj = project(sl)
            m = None if mask is None else mask[sl]
            if one_kernel:
                triton_middle.middle_fwd(proj, u[sl], Bk, Ck, skip, decay_bias, P_dict, x0_re[sl], x0_im[sl], m,
                                         b_gate, unit_snap, phase_levels,
                                         states=(x_re[sl], x_im[sl]) if keep_states else None, y=y[sl],
                                         last=(last_re[sl], last_im[sl]), precision=precision)
                continue
            D_re, D_im, _, P_t = transition_fwd_triton(proj, decay_bias, P_dict, K, N, m, unit_snap, phase_levels)
            if b_gate == "off":
                b_re, b_im = torch.zeros_like(D_re, dtype=planes), torch.zeros_like(D_im, dtype=planes)
            else:
                b_re, b_im = injection_fwd(u[sl], Bk, precision, planes)
                gate = _gate(proj, decay_bias, b_gate, K, N, unit_snap)
                if gate is not None:
                    b_re.mul_(gate)
                    b_im.mul_(gate)
            del proj
            xr, xi = x_re[sl], x_im[sl]
            # the last state in float32 from the scan, whatever the planes' dtype
            pd_scan_fwd_cuda_split(P_t, D_re, D_im, b_re, b_im, x0[sl], out=(xr, xi),
                                   last=(last_re[sl], last_im[sl]))
            del D_re, D_im, P_t, b_re, b_im
            readout_fwd(xr, xi, Ck, skip, u[sl], y[sl], precision)     # y = Re(C x) + D_skip u, in u's layout
        ctx.save_for_backward(u, Wx, decay_bias, M, P_dict, Bw, x0, x_re, x_im, C, D_skip, mask, proj_kept)
        ctx.tau, ctx.b_gate, ctx.unit_snap, ctx.phase_levels = tau, b_gate, unit_snap, phase_levels
        ctx.one_kernel = one_kernel
        return y, last_re, last_im

    @staticmethod
    def backward(ctx, g_y, g_last_re, g_last_im):
        u, Wx, decay_bias, M, P_dict, Bw, x0, x_re, x_im, C, D_skip, mask, proj = ctx.saved_tensors
        # float32 layers keep exact float32 products (their reference's precision); half layers use TF32
        precision = "ieee" if u.dtype == torch.float32 else "tf32"
        if ctx.one_kernel:
            return _FusedMiddle._backward_one_kernel(ctx, g_y, g_last_re, g_last_im, u, Wx, decay_bias, M, P_dict,
                                                     Bw, x0, x_re, x_im, C, D_skip, mask, precision)
        return _FusedMiddle._backward(ctx, g_y, g_last_re, g_last_im, u, Wx, decay_bias, M, P_dict, Bw, x0, x_re,
                                      x_im, C, D_skip, mask, precision, proj)

    @staticmethod
    def _backward_one_kernel(ctx, g_y, g_last_re, g_last_im, u, Wx, decay_bias, M, P_dict, Bw, x0, x_re, x_im, C,
                             D_skip, mask, precision):
        """The backward of the one-kernel forward: per batch slice the projection again, then one kernel per
        (sequence, head) (`triton_middle.middle_bwd`), the dictionary's grouped sum and the projection's products."""
        from ..ops.pd_select import triton_middle
        from ..ops.pd_select.triton_ste import dictionary_grad_from_dx

        B, L, _ = u.shape
        H, K, N = M.shape[:3]
        P = C.shape[1]
        W = Wx.shape[0] // H
        dev = u.device
        Cf, skip, Bf = C.float().contiguous(), D_skip.float().contiguous(), Bw.float().contiguous()
        Wu = Wx.to(u.dtype)
        g = _Grads(u, Wx, M, C, ctx.b_gate)
        if g_y is None:
            g_y = torch.zeros_like(u)
        elif g_y.stride(-1) != 1:
            g_y = g_y.contiguous()
        g_last = None
        if g_last_re is not None or g_last_im is not None:
            zero = torch.zeros(B, H, N, device=dev, dtype=torch.float32)
            g_last = (zero if g_last_re is None else g_last_re.float(), zero if g_last_im is None else g_last_im.float())
        x0_re, x0_im = x0.real.contiguous(), x0.imag.contiguous()
        for sl in _FusedMiddle._slices_one_kernel(B, L, H, N, P, W, dev):
            b = u[sl].shape[0]
            proj = F.linear(u[sl], Wu).view(b, L, H, W)
            gproj, g_ub, lam, dx, kstar, (gr, gi) = triton_middle.middle_bwd(
                proj, u[sl], g_y[sl], (x_re[sl], x_im[sl]), (x0_re[sl], x0_im[sl]),
                None if g_last is None else (g_last[0][sl], g_last[1][sl]), Bf, Cf, skip, decay_bias, P_dict,
                g.C, g.skip, g.Bw, g.bias, ctx.tau, None if mask is None else mask[sl], ctx.b_gate, ctx.unit_snap,
                ctx.phase_levels, precision)
            del proj
            g.x0[sl] = torch.complex(gr, gi)
            dictionary_grad_from_dx(kstar, lam, dx, K, precision, into=g.G)
            del lam, dx, kstar
            g.add_projection(sl, gproj, g_ub, u, Wu)
            del gproj, g_ub
        return g.result(ctx.tau, Wx, decay_bias, M, Bw, C, D_skip)

    @staticmethod
    def _backward(ctx, g_y, g_last_re, g_last_im, u, Wx, decay_bias, M, P_dict, Bw, x0, x_re, x_im, C, D_skip, mask,
                  precision, proj_kept):
        from ..ops.pd_scan.cuda import pd_scan_bwd_cuda_split
        from ..ops.pd_transition.triton_fused import transition_bwd_triton, transition_fwd_triton
        from ..ops.pd_select.triton_readout import injection_bwd, injection_fwd, readout_bwd
        from ..ops.pd_select.triton_ste import float_planes, ste_grads_triton

        if g_y is not None and g_y.stride(-1) != 1:
            g_y = g_y.contiguous()
        b_gate, unit_snap, phase_levels = ctx.b_gate, ctx.unit_snap, ctx.phase_levels
        B, L, _ = u.shape
        H, K, N = M.shape[:3]
        P = C.shape[1]
        W = Wx.shape[0] // H
        Ck, skip, Bk = C.contiguous(), D_skip.contiguous(), Bw.contiguous()   # the kernels read them as float32
        Wu = Wx.to(u.dtype)
        bias_f = decay_bias.float()   # float32, so the transition's backward returns its bias gradient unrounded
        g = _Grads(u, Wx, M, C, b_gate)
        for sl in _FusedMiddle._slices(B, L, H, N, K, P, W, x_re.element_size()):
            m = None if mask is None else mask[sl]
            xr, xi = x_re[sl], x_im[sl]
            b = xr.shape[0]
            gy = torch.zeros_like(u[sl]) if g_y is None else g_y[sl]                 # [b, L, H*P]
            g_re, g_im = readout_bwd(gy, xr, xi, Ck, u[sl], g.C, g.skip, precision)
            if g_last_re is not None:
                g_re[:, :, -1] += g_last_re[sl]
            if g_last_im is not None:
                g_im[:, :, -1] += g_last_im[sl]
            # scan backward; dL/db overwrites dL/dx (the kernel stages each chunk of dL/dx before writing it)
            proj = (F.linear(u[sl], Wu) if proj_kept is None else proj_kept[sl]).view(b, L, H, W)
            D_re, D_im, kstar, P_t = transition_fwd_triton(proj, decay_bias, P_dict, K, N, m, unit_snap, phase_levels)
            gD_re, gD_im = torch.empty_like(xr), torch.empty_like(xi)    # the planes' dtype (plane_dtype)
            *_, g.x0[sl] = pd_scan_bwd_cuda_split(P_t, D_re, D_im, x0[sl], xr, xi, g_re, g_im,
                                                   out=(gD_re, gD_im, g_re, g_im))
            gb_re, gb_im = g_re, g_im
            del P_t
            # straight-through sums, then the transition's own backward
            _, r = ste_grads_triton(P_dict, kstar, (gb_re, gb_im), (D_re, D_im), (xr, xi), float_planes(x0[sl]),
                                    m, K, precision=precision, dictionary_into=g.G)
            del D_re, D_im, kstar
            gproj, gbias_s = transition_bwd_triton(proj, bias_f, gD_re, gD_im, r, ctx.tau, K, N, m,
                                                   unit_snap, phase_levels)
            g.bias += gbias_s.view(-1)
            del gD_re, gD_im, r
            # injection b = (B_h u_t) * gate
            if b_gate != "off":
                gate = _gate(proj, decay_bias, b_gate, K, N, unit_snap)
                if gate is not None:
                    b0_re, b0_im = injection_fwd(u[sl], Bk, precision)
                    gg = gb_re * b0_re + gb_im * b0_im
                    del b0_re, b0_im
                    g_gate = gg.sum(-1, keepdim=True) if gate.shape[-1] == 1 else gg
                    g_bias_gate = _gate_backward(proj, gate, g_gate, gproj, b_gate, K, N, unit_snap)
                    if g_bias_gate is not None:
                        g.bias += g_bias_gate
                    gb_re, gb_im = gb_re * gate, gb_im * gate
                g_ub = injection_bwd(gb_re, gb_im, gy, u[sl], skip, Bk, g.Bw, precision)
            else:
                g_ub = injection_bwd(None, None, gy, u[sl], skip, Bk, None, precision)
            g.add_projection(sl, gproj, g_ub, u, Wu)
            del gproj, g_ub, gy
        return g.result(ctx.tau, Wx, decay_bias, M, Bw, C, D_skip)


def fused_middle(u: torch.Tensor, Wx: torch.Tensor, decay_bias: torch.Tensor, M: torch.Tensor,
                             Bw: torch.Tensor, x0: torch.Tensor, C: torch.Tensor, D_skip: torch.Tensor,
                             tau: float | torch.Tensor = 1.0, mask: torch.Tensor | None = None,
                             b_gate: str | None = None,
                             unit_snap: float = 0.0, phase_levels: int = 0):
    """(y [B,L,H*P] in u's dtype, x_last_re [B,H,N], x_last_im [B,H,N] float32): the middle of a complex
    FlashPDSSM layer, from its input u to its readout y = Re(C_h x_t) + D_skip * u_t, with the hard-selected
    scan x_t = P_t D_t x_{t-1} + b_t, its last state, and straight-through gradients.

    u [B,L,H*P] (any strides that let its last dim split into heads); Wx [H*W, H*P] the x_proj weight, whose
    output per head and token is pd_transition's layout (K selector logits | N decay logits | N phases | the
    b-gate's column when it has one); decay_bias [H*N]; M [H,K,N,N] dictionary logits; Bw [H,N,P,2] (re, im)
    injection b_t = (B_h u_t) * gate; x0 [B,H,N] complex64 (the state before the first token); C [H,P,N,2]
    (re, im) readout; D_skip [H,P]; mask [B,L] (0 = padding); b_gate one of B_GATES, unit_snap and phase_levels
    (FlashPDSSM's options; pd_transition/naive.py gives their maths).
    CUDA only (`usable`). Everything state-sized (the projection, b, D, dL/dx, ...) exists one batch slice at a
    time, in both passes.
    """
    H, K, N, _ = M.shape
    if u.dim() != 3:
        raise ValueError(f"fused_middle: u must be [B, L, H*P], got {tuple(u.shape)}")
    B, L, d = u.shape
    if C.dim() != 4 or C.shape[0] != H or C.shape[2] != N or C.shape[3] != 2 or C.shape[1] * H != d:
        raise ValueError(f"fused_middle: C must be [H={H}, P={d // H}, N={N}, 2], got {tuple(C.shape)}")
    P = C.shape[1]
    if Wx.dim() != 2 or Wx.shape[1] != d or Wx.shape[0] % H or Wx.shape[0] // H < K + 2 * N:
        raise ValueError(f"fused_middle: Wx must be [H*W, {d}] with W >= K + 2N = {K + 2 * N}, "
                         f"got {tuple(Wx.shape)}")
    if decay_bias.numel() != H * N:
        raise ValueError(f"fused_middle: decay_bias must hold H*N = {H * N} values, "
                         f"got {decay_bias.numel()}")
    if D_skip.shape != (H, P):
        raise ValueError(f"fused_middle: D_skip must be [H, P] = {(H, P)}, got {tuple(D_skip.shape)}")
    if Bw.shape != (H, N, P, 2):
        raise ValueError(f"fused_middle: Bw must be [H, N, P, 2] = {(H, N, P, 2)}, got {tuple(Bw.shape)}")
    if b_gate not in B_GATES:
        raise ValueError(f"fused_middle: b_gate must be one of {B_GATES}, got {b_gate!r}")
    if b_gate in ("sigmoid", "hard") and Wx.shape[0] // H < K + 2 * N + 1:
        raise ValueError(f"fused_middle: b_gate={b_gate!r} needs a gate column after K + 2N per head")
    if x0.shape != (B, H, N) or x0.dtype != torch.complex64:
        raise ValueError(f"fused_middle: x0 must be complex64 [B, H, N] = {(B, H, N)}, "
                         f"got {x0.dtype} {tuple(x0.shape)}")
    if mask is not None and mask.shape != (B, L):
        raise ValueError(f"fused_middle: mask must be [B, L] = {(B, L)}, got {tuple(mask.shape)}")
    tau = straight_through_tau(tau, "fused_middle")
    if unit_snap < 0 or phase_levels < 0:
        raise ValueError(f"fused_middle: unit_snap and phase_levels must be >= 0, got {unit_snap}, "
                         f"{phase_levels}")
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (u, Wx, decay_bias, M, Bw, x0, C, D_skip))
    return _FusedMiddle.apply(u, Wx, decay_bias, M, Bw, x0, C, D_skip, tau, mask, b_gate, float(unit_snap),
                              int(phase_levels), grad)

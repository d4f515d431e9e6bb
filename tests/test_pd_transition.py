"""pd_transition: the Triton kernels against the torch reference (naive.py), forward and backward.

Runs on the GPU, and on the CPU under Triton's interpreter (a subprocess with TRITON_INTERPRET=1, as the
interpreter must be chosen before the kernels are defined) when triton is installed."""

import itertools
import os
import textwrap

import pytest
import torch
from interpreter import import_triton, run_interpreted

from llm_surgery.ops.pd_transition import transition_naive


DRIFT_OPTIONS = ({}, {"unit_snap": 0.3, "phase_levels": 12})  # snap 0.3: about a fifth of |D| clamp at 1


def _compare(device: str, cases=((4, 16, 0, False), (5, 12, 1, True), (32, 32, 0, True)), L: int = 19):
    """Max deviations of the Triton kernels from the reference over a few shapes, dtypes, masks and
    FlashPDSSM's drift options (unit_snap, phase_levels)."""
    from llm_surgery.ops.pd_select.function import softmax_jacobian_apply
    from llm_surgery.ops.pd_transition.triton_fused import transition_bwd_triton, transition_fwd_triton
    g = torch.Generator(device=device).manual_seed(0)
    worst = {"D": 0.0, "grad_proj": 0.0, "grad_bias": 0.0}
    for dtype, (K, N, extra, masked), opts in itertools.product((torch.float32, torch.bfloat16), cases,
                                                                DRIFT_OPTIONS):
        B, H = 2, 3
        proj = torch.randn(B, L, H, K + 2 * N + extra, device=device, generator=g).to(dtype).requires_grad_(True)
        bias = torch.randn(H * N, device=device, generator=g, requires_grad=True)
        mask = (torch.rand(B, L, device=device, generator=g) > 0.3).long() if masked else None
        P_dict = torch.randint(0, N, (H, K, N), device=device, generator=g).to(torch.int16)
        sel, D_re, D_im = transition_naive(proj, bias.view(H, N), K, N, mask, **opts)
        out_re, out_im, kstar, P = transition_fwd_triton(proj.detach(), bias.detach(), P_dict, K, N, mask, **opts)
        assert torch.equal(kstar, sel.argmax(-1)), "selected members differ"
        want_P = P_dict[torch.arange(H, device=device).view(1, H, 1), kstar]
        if mask is not None:
            ident = torch.arange(N, device=device, dtype=want_P.dtype)
            want_P = torch.where(mask.bool()[:, None, :, None], want_P, ident)
        assert torch.equal(P, want_P), "transitions P_t differ"
        worst["D"] = max(worst["D"], (out_re - D_re).abs().max().item(), (out_im - D_im).abs().max().item())
        g_re, g_im = torch.randn_like(D_re), torch.randn_like(D_im)
        r = torch.randn(B, H, L, K, device=device, generator=g)
        if mask is not None:
            r = r * mask[:, None, :, None]
        g_sel = softmax_jacobian_apply(sel.detach(), r, 0.7, dim=-1)
        want_proj, want_bias = torch.autograd.grad((sel, D_re, D_im), (proj, bias), (g_sel, g_re, g_im))
        got_proj, got_bias = transition_bwd_triton(proj.detach(), bias.detach(), g_re, g_im,
                                                   r, 0.7, K, N, mask, **opts)
        scale = want_proj.float().abs().max().item()
        worst["grad_proj"] = max(worst["grad_proj"], (got_proj.float() - want_proj.float()).abs().max().item() / scale)
        worst["grad_bias"] = max(worst["grad_bias"], (got_bias - want_bias).abs().max().item())
    return worst


def _check(worst):
    assert worst["D"] < 1e-5, worst
    assert worst["grad_proj"] < 8e-3, worst    # bf16 gradients: one rounding step of the largest value
    assert worst["grad_bias"] < 1e-4, worst


def test_naive_matches_polar_form():
    """The reference itself: D = sigmoid(-(a + bias)) e^{i phi}, the identity at padding, sel = the logits."""
    proj = torch.randn(2, 5, 3, 4 + 2 * 6, dtype=torch.float64)
    bias = torch.randn(3, 6, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 1, 1], [0, 1, 1, 1, 1]])
    sel, D_re, D_im = transition_naive(proj, bias, 4, 6, mask)
    p = proj.transpose(1, 2)
    D = torch.polar(torch.exp(-torch.nn.functional.softplus(p[..., 4:10] + bias[None, :, None])), p[..., 10:16])
    keep = mask.bool()[:, None, :, None]
    assert torch.equal(sel, p[..., :4])
    assert torch.allclose(torch.complex(D_re, D_im), torch.where(keep, D, torch.ones_like(D)))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_kernels_match_reference_cuda():
    _check(_compare("cuda", cases=((4, 16, 0, False), (5, 12, 1, True), (32, 32, 0, True), (16, 128, 1, True)),
                    L=300))


def test_triton_kernels_match_reference_interpreted():
    import_triton()
    code = textwrap.dedent("""
        import json, sys
        sys.path.insert(0, {tests!r})
        from test_pd_transition import _compare
        print(json.dumps(_compare("cpu")))
    """).format(tests=os.path.dirname(__file__))
    import json
    _check(json.loads(run_interpreted(code)))


def test_naive_drift_options():
    """unit_snap: |D| = min(1, (1 + s) sigmoid(-(a + bias))); phase_levels: phases on the 2 pi / Q grid, with the
    gradient of the unrounded phase (straight through)."""
    import math
    proj = torch.randn(2, 5, 3, 4 + 2 * 6, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(3, 6, dtype=torch.float64)
    _, D_re, D_im = transition_naive(proj, bias, 4, 6, unit_snap=0.5, phase_levels=8)
    D = torch.complex(D_re, D_im)
    p = proj.detach().transpose(1, 2)
    want_mag = (torch.sigmoid(-(p[..., 4:10] + bias[None, :, None])) * 1.5).clamp(max=1)
    assert torch.allclose(D.abs(), want_mag) and (D.abs() == 1).any()
    q = torch.angle(D) / (2 * math.pi / 8)
    assert torch.allclose(q, q.round(), atol=1e-9)
    D_im.sum().backward()  # d Im(D)/d phi = |D| cos(phi_rounded): the straight-through gradient
    assert torch.allclose(proj.grad.transpose(1, 2)[..., 10:16], D_re.detach())

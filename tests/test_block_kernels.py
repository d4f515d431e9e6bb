"""The Triton kernels of the block pieces (layers/block_kernels.py) against the torch path of common.py: the gated
RMSNorm and the causal conv + SiLU, values and every gradient. On the GPU through the layers' own dispatch; on the
CPU the kernels run under Triton's interpreter (subprocess, TRITON_INTERPRET=1)."""

import json
import os
import textwrap

import pytest
import torch
import torch.nn.functional as F
from interpreter import import_triton, run_interpreted


def _compare(device: str, dtype=torch.float32, direct: bool = False):
    """Relative deviations kernel vs torch path. direct=True calls the kernels' host functions (the interpreter
    on CPU); otherwise the public functions, which pick the kernels on CUDA."""
    from llm_surgery.layers import block_kernels as bk
    from llm_surgery.layers.common import GatedRMSNorm, _GatedRMSNormFn, causal_conv1d, causal_conv1d_silu
    g = torch.Generator(device=device).manual_seed(3)
    rel = {}

    def r(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    # norm: z a strided half of a projection, as in the blocks; width 96 = 3 groups of 32 (a non-power-of-two count)
    R, d, gs = 37, 96, 32
    xz = torch.randn(R, 2 * d, device=device, dtype=dtype, generator=g)
    x, z = torch.randn(R, d, device=device, dtype=dtype, generator=g), xz[:, d:]
    norm = GatedRMSNorm(d, group_size=gs).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(d, generator=g, device=device))
    go = torch.randn(R, d, device=device, dtype=dtype, generator=g)
    # reference: the torch path in float64
    xr, zr = x.double().requires_grad_(), z.double().requires_grad_()
    wr = norm.weight.detach().double().requires_grad_()
    h = xr * F.silu(zr)
    hg = h.view(R, d // gs, gs)
    ref = (hg * torch.rsqrt(hg.pow(2).mean(-1, keepdim=True) + norm.eps)).view(R, d) * wr
    ref.backward(go.double())
    if direct:
        out = bk.gated_norm_fwd(x, z, norm.weight, gs, norm.eps)
        dx, dz, dw = bk.gated_norm_bwd(x, z, norm.weight, go, gs, norm.eps)
    else:
        assert _GatedRMSNormFn._kernels(x, z) is not None, "CUDA present but the norm kernels are not used"
        xx, zz = x.clone().requires_grad_(), z.clone().requires_grad_()
        out = norm(xx, zz)
        out.backward(go)
        dx, dz, dw = xx.grad, zz.grad, norm.weight.grad
    rel.update(norm_out=r(out, ref), norm_dx=r(dx, xr.grad), norm_dz=r(dz, zr.grad), norm_dw=r(dw, wr.grad))
    if direct:   # the backward with groups split over programs (2 groups a tile: the last block half empty)
        dx, dz, dw = bk.gated_norm_bwd(x, z, norm.weight, go, gs, norm.eps, config={"tile": 64, "num_warps": 1})
        rel.update(norm_dx_split=r(dx, xr.grad), norm_dz_split=r(dz, zr.grad), norm_dw_split=r(dw, wr.grad))

    # conv + SiLU: x a strided half of a projection, L not a multiple of the kernels' row block
    B, L, C, W = 3, 77, 160, 4
    xin = torch.randn(B, L, 2 * C, device=device, dtype=dtype, generator=g)[:, :, :C]
    wt = torch.randn(C, W, device=device, dtype=dtype, generator=g)
    bias = torch.randn(C, device=device, dtype=dtype, generator=g)
    gy = torch.randn(B, L, C, device=device, dtype=dtype, generator=g)
    xr, wr, br = (t.detach().double().requires_grad_() for t in (xin, wt, bias))
    yr, state_r = causal_conv1d(xr, wr, br)
    yr = F.silu(yr)
    yr.backward(gy.double())
    if direct:
        y = bk.conv_silu_fwd(xin, wt, bias)
        dx, dw, db = bk.conv_silu_bwd(xin, wt, bias, gy)
        state = state_r
    else:
        xx, ww, bb = (t.clone().requires_grad_() for t in (xin, wt, bias))
        y, state = causal_conv1d_silu(xx, ww, bb)
        y.backward(gy)
        dx, dw, db = xx.grad, ww.grad, bb.grad
    rel.update(conv_out=r(y, yr), conv_dx=r(dx, xr.grad), conv_dw=r(dw, wr.grad), conv_db=r(db, br.grad),
               conv_state=r(state, state_r))
    return rel


def _assert_close(rel, tol):
    bad = {k: v for k, v in rel.items() if not v < tol}
    assert not bad, f"kernels deviate from the float64 torch path: {bad}"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_block_kernels_match_torch_cuda():
    _assert_close(_compare("cuda", torch.float32), 1e-5)
    _assert_close(_compare("cuda", torch.bfloat16), 1e-2)


def test_block_kernels_match_torch_interpreted():
    import_triton()
    code = textwrap.dedent("""
        import json, sys
        sys.path.insert(0, {tests!r})
        from test_block_kernels import _compare
        print(json.dumps(_compare("cpu", direct=True)))
    """).format(tests=os.path.dirname(__file__))
    _assert_close(json.loads(run_interpreted(code)), 1e-5)

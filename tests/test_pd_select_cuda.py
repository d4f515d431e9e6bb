"""The Triton straight-through kernels against the torch path (CUDA only)."""

import pytest
import torch

from llm_surgery.ops.pd_select.function import dictionary_grad, selector_grad

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _torch_dx(D, x, x0, mask):
    x_prev = torch.cat([torch.zeros_like(x[:, :, :1]) if x0 is None else x0.unsqueeze(2), x[:, :, :-1]], dim=2)
    dx = D * x_prev
    return dx if mask is None else dx * mask.to(dx.real.dtype)[:, None, :, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
@pytest.mark.parametrize("N,K", [(16, 4), (32, 32), (100, 7), (128, 16)])
@pytest.mark.parametrize("with_x0,with_mask", [(True, False), (False, True)])
@pytest.mark.parametrize("precision", ["ieee", "tf32"])
def test_triton_ste_grads_match_torch(dtype, N, K, with_x0, with_mask, precision):
    """ieee: exact float32 (the selector sum gathers); tf32: both sums on tensor cores, inputs rounded to 10 bits."""
    from llm_surgery.ops.pd_select.triton_ste import ste_grads_triton
    g = torch.Generator(device="cuda").manual_seed(N + K)
    B, H, L = 3, 4, 257
    lam, D, x = (torch.randn(B, H, L, N, dtype=dtype, device="cuda", generator=g) for _ in range(3))
    x0 = torch.randn(B, H, N, dtype=dtype, device="cuda", generator=g) if with_x0 else None
    mask = (torch.rand(B, L, device="cuda", generator=g) > 0.3).long() if with_mask else None
    kstar = torch.randint(0, K, (B, H, L), device="cuda", generator=g)
    P = torch.randint(0, N, (H, K, N), device="cuda", generator=g).to(torch.int16)
    G, r = ste_grads_triton(P, kstar, lam, D, x, x0, mask, K, precision=precision)
    dx = _torch_dx(D, x, x0, mask)
    G0, r0 = dictionary_grad(kstar, lam, dx, K), selector_grad(P, lam, dx)
    if precision == "ieee":
        assert torch.allclose(G, G0, rtol=1e-4, atol=1e-3)
        assert torch.allclose(r, r0, rtol=1e-4, atol=1e-4)
    else:   # each term rounded to TF32 (2^-11 relative): errors on the scale of the terms, not of their sum
        for got, ref in ((G, G0), (r, r0)):
            assert ((got - ref).abs().max() / ref.abs().max()).item() < 3e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
def test_triton_dictionary_grad_skewed_selection(dtype):
    """One member takes most tokens of every head (as early in training): the member's tokens are split over
    several programs whose partial sums meet in G; the result must still equal the torch path."""
    from llm_surgery.ops.pd_select.triton_ste import ste_grads_triton
    g = torch.Generator(device="cuda").manual_seed(5)
    B, H, L, N, K = 4, 3, 1500, 32, 8
    lam, D, x = (torch.randn(B, H, L, N, dtype=dtype, device="cuda", generator=g) for _ in range(3))
    kstar = torch.randint(0, K, (B, H, L), device="cuda", generator=g)
    kstar[..., : L - 100] = 3
    P = torch.randint(0, N, (H, K, N), device="cuda", generator=g).to(torch.int16)
    G, _ = ste_grads_triton(P, kstar, lam, D, x, None, None, K)
    G0 = dictionary_grad(kstar, lam, _torch_dx(D, x, None, None), K)
    assert torch.allclose(G, G0, rtol=1e-4, atol=2e-3)

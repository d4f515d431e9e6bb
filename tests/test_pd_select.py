"""The straight-through selection equals autograd through the dense surrogate P_hard + P_soft - P_soft.detach()."""

import textwrap

import pytest
import torch
from interpreter import import_triton, require_interpreter_kernels, run_interpreted

from llm_surgery.ops.pd_select import column_argmax, gather_transitions, pd_select_scan, pd_select_scan_dense
from llm_surgery.ops.pd_scan import pd_scan_naive


def _case(dtype, seed, B=2, H=3, L=9, N=5, K=4):
    g = torch.Generator().manual_seed(seed)
    M = torch.randn(H, K, N, N, dtype=torch.float64, generator=g)
    sel = torch.randn(B, H, L, K, dtype=torch.float64, generator=g)
    D = torch.randn(B, H, L, N, dtype=dtype, generator=g) * 0.8
    b = torch.randn(B, H, L, N, dtype=dtype, generator=g)
    x0 = torch.randn(B, H, N, dtype=dtype, generator=g)
    up = torch.randn(B, H, L, N, dtype=dtype, generator=g)
    return [M, sel, D, b, x0], up


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
@pytest.mark.parametrize("tau", [1.0, 0.25])
def test_ste_gradients_equal_dense_surrogate(dtype, tau):
    inputs, up = _case(dtype, seed=int(tau * 8))
    ref_in = [t.clone().requires_grad_() for t in inputs]
    got_in = [t.clone().requires_grad_() for t in inputs]
    ref = pd_select_scan_dense(*ref_in, tau=tau)
    got = pd_select_scan(*got_in, tau=tau)
    assert torch.allclose(ref, got, atol=1e-12)
    g_ref = torch.autograd.grad((ref * up.conj()).real.sum(), ref_in)
    g_got = torch.autograd.grad((got * up.conj()).real.sum(), got_in)
    for name, r, o in zip(["M", "sel", "D", "b", "x0"], g_ref, g_got):
        assert r.abs().max() > 0, name
        assert torch.allclose(r, o, rtol=1e-9, atol=1e-11), name


def test_forward_is_hard_selection():
    inputs, _ = _case(torch.float64, seed=1)
    M, sel, D, b, x0 = inputs
    P_dict = column_argmax(M)
    assert P_dict.dtype == torch.int16 and P_dict.shape == (3, 4, 5)
    P = gather_transitions(P_dict, sel.argmax(-1))
    for h in range(3):
        for k in range(4):
            assert torch.equal(P_dict[h, k].long(), M[h, k].argmax(0))
    assert torch.allclose(pd_select_scan(M, sel, D, b, x0), pd_scan_naive(P, D, b, x0), atol=1e-12)


def test_padding_steps_are_identity_and_get_no_ste_signal():
    inputs, up = _case(torch.float64, seed=2)
    M, sel, D, b, x0 = inputs
    mask = torch.ones(2, 9)
    mask[1, :4] = 0
    Dm, bm = D.clone(), b.clone()
    Dm[1, :, :4] = 1.0
    bm[1, :, :4] = 0.0
    x = pd_select_scan(M, sel, Dm, bm, x0, mask=mask)
    assert torch.allclose(x[1, :, 3], x0[1])  # four identity steps leave the initial state as it was
    sel_g = sel.clone().requires_grad_()
    (pd_select_scan(M, sel_g, Dm, bm, x0, mask=mask) * up).sum().backward()
    assert sel_g.grad[1, :, :4].abs().max() == 0 and sel_g.grad[1, :, 4:].abs().max() > 0


def test_shape_errors():
    inputs, _ = _case(torch.float64, seed=3)
    M, sel, D, b, x0 = inputs
    with pytest.raises(ValueError, match=r"\[H, K, N, N\]"):
        pd_select_scan(M[..., :4], sel, D, b, x0)
    with pytest.raises(ValueError, match=r"\[B, H, L, K\]"):
        pd_select_scan(M, sel[..., :3], D, b, x0)
    with pytest.raises(ValueError, match="tau"):
        pd_select_scan(M, sel, D, b, x0, tau=0.0)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.float32])
def test_selector_sum_on_tensor_cores_interpreted(dtype):
    """The TF32 form of the selector sum (the tokens' outer products times the members' indicator matrices,
    `triton_ste._selector_dot_kernel`) equals the gather form's maths under Triton's interpreter, where its products
    are exact: odd sizes, padding, an initial state, several token blocks and Q-row chunks per program."""
    require_interpreter_kernels()
    code = textwrap.dedent("""
        import torch
        from llm_surgery.ops.pd_select.function import selector_grad
        from llm_surgery.ops.pd_select.triton_ste import ste_grads_triton
        torch.manual_seed(0)
        worst = 0.0
        for N, K, with_x0 in ((20, 7, True), (32, 32, False)):
            B, H, L = 2, 3, 37   # 3 token blocks of 16, the last one part-filled
            lam, D, x = (torch.randn(B, H, L, N, dtype={dtype}) for _ in range(3))
            x0 = torch.randn(B, H, N, dtype={dtype}) if with_x0 else None
            mask = (torch.rand(B, L) > 0.3).long()
            kstar = torch.randint(0, K, (B, H, L))
            P = torch.randint(0, N, (H, K, N)).to(torch.int16)
            _, r = ste_grads_triton(P, kstar, lam, D, x, x0, mask, K, parts=("selector",), precision="tf32",
                                    selector_config={{"block_t": 16, "rows": 4, "num_warps": 4, "repeat": 2}})
            x_prev = torch.cat([torch.zeros_like(x[:, :, :1]) if x0 is None else x0.unsqueeze(2), x[:, :, :-1]], 2)
            r0 = selector_grad(P, lam, D * x_prev * mask[:, None, :, None])
            worst = max(worst, ((r - r0).abs().max() / r0.abs().max()).item())
        print(worst)
    """).format(dtype=dtype)
    assert float(run_interpreted(code)) < 1e-5


def test_straight_through_sums_read_bf16_planes_as_float32_interpreted():
    """The fused backward hands the straight-through sums bfloat16 lam and x planes (float32 D): both sums, in both
    selector forms, equal the sums over float32 copies of the same values (every load widened before any
    arithmetic), under Triton's interpreter."""
    require_interpreter_kernels()
    code = textwrap.dedent("""
        import torch
        from llm_surgery.ops.pd_select.triton_ste import ste_grads_triton
        torch.manual_seed(0)
        B, H, L, N, K = 2, 3, 45, 32, 8
        half = lambda: torch.randn(B, H, L, N).to(torch.bfloat16)
        lam, x = (half(), half()), (half(), half())
        D = (torch.randn(B, H, L, N), torch.randn(B, H, L, N))
        x0 = torch.randn(B, H, N, dtype=torch.complex64)
        kstar = torch.randint(0, K, (B, H, L))
        P = torch.randint(0, N, (H, K, N)).to(torch.int16)
        wide = lambda planes: tuple(p.float() for p in planes)
        worst = 0.0
        for precision in ("ieee", "tf32"):   # the gathers' selector form and the tensor cores' one
            G, r = ste_grads_triton(P, kstar, lam, D, x, x0, None, K, precision=precision)
            G0, r0 = ste_grads_triton(P, kstar, wide(lam), D, wide(x), x0, None, K, precision=precision)
            worst = max(worst, ((G - G0).abs().max() / G0.abs().max()).item(),
                        ((r - r0).abs().max() / r0.abs().max()).item())
        print(worst)
    """)
    assert float(run_interpreted(code)) < 1e-6


def test_dictionary_sum_with_skewed_selections_interpreted():
    """The dictionary sum's kernel finds each program's (member, piece) from the head's member counts: with one member
    taking most of a head's tokens (several pieces), one taking none and programs past the last piece, it equals the
    torch sum over the tokens grouped by member, and it adds into a given accumulator (`dictionary_into`), under
    Triton's interpreter."""
    require_interpreter_kernels()
    code = textwrap.dedent("""
        import torch
        from llm_surgery.ops.pd_select.function import dictionary_grad
        from llm_surgery.ops.pd_select.triton_ste import ste_grads_triton
        torch.manual_seed(0)
        B, H, L, N, K = 2, 3, 90, 12, 5
        lam, D, x = (torch.randn(B, H, L, N, dtype=torch.complex64) for _ in range(3))
        x0 = torch.randn(B, H, N, dtype=torch.complex64)
        mask = (torch.rand(B, L) > 0.2).long()
        kstar = torch.where(torch.rand(B, H, L) < 0.8, 0, torch.randint(1, K, (B, H, L)))
        kstar[kstar == 3] = 4                      # member 3 takes no token; member 0 about 144 of a head's 180
        P = torch.randint(0, N, (H, K, N)).to(torch.int16)
        into = torch.randn(H, K, N, N)
        before = into.clone()
        G, _ = ste_grads_triton(P, kstar, lam, D, x, x0, mask, K, parts=("dictionary",), precision="ieee",
                                dictionary_config={"seg": 32, "block_t": 16, "num_warps": 4}, dictionary_into=into)
        assert G is into
        x_prev = torch.cat([x0.unsqueeze(2), x[:, :, :-1]], 2)
        G0 = dictionary_grad(kstar, lam, D * x_prev * mask[:, None, :, None], K)
        assert G0[:, 0].abs().max() > 0 and G0[:, 3].abs().max() == 0
        print(((G - before - G0).abs().max() / G0.abs().max()).item())
    """)
    assert float(run_interpreted(code)) < 1e-5


@pytest.mark.parametrize("N,kernel", [(32, "_selector_dot"), (40, "_selector")])
def test_half_precision_selector_sum_uses_the_tensor_cores_only_where_its_kernel_fits(monkeypatch, N, kernel):
    """TF32 layers take the tensor-core selector sum up to 32 state entries; beyond, its kernel spills registers
    (`triton_ste.SELECTOR_DOT_MAX_BLOCK_N`) and the gathers run."""
    import_triton()   # the straight-through kernels' module needs it
    from llm_surgery.ops.pd_select import triton_ste
    called = []
    for name in ("_selector", "_selector_dot"):
        monkeypatch.setattr(triton_ste, name, lambda *args, name=name: called.append(name))
    planes = torch.zeros(1, 2, 5, N, dtype=torch.complex64)
    triton_ste.ste_grads_triton(torch.zeros(2, 3, N, dtype=torch.int16), torch.zeros(1, 2, 5, dtype=torch.long),
                                planes, planes, planes, parts=("selector",), precision="tf32")
    assert called == [kernel]

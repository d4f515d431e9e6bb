"""Mamba2Mixer and DeltaNetMixer: the torch paths against naive float64 per-step references, state
continuation, left padding, gradients, bf16, bad inputs, and the lazy library-kernel import."""

import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from llm_surgery.layers import deltanet as deltanet_mod
from llm_surgery.layers import mamba2 as mamba2_mod
from llm_surgery.layers.deltanet import DeltaNetMixer
from llm_surgery.layers.mamba2 import Mamba2Mixer

D_MODEL = 32


def _perturb(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Move every parameter off its init (norm weights of 1, D of 1, ...) so nothing is tested at a
    special value."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return module


def make_mamba2(**kw):
    torch.manual_seed(0)
    opts = dict(num_heads=4, head_dim=8, state_size=6, n_groups=2, chunk_size=16, backend="torch")
    return _perturb(Mamba2Mixer(D_MODEL, **{**opts, **kw}))


def make_deltanet(**kw):
    torch.manual_seed(0)
    opts = dict(num_heads=2, head_dim=8, value_head_dim=12, chunk_size=8, backend="torch")
    return _perturb(DeltaNetMixer(D_MODEL, **{**opts, **kw}))


MAKERS = {"mamba2": make_mamba2, "deltanet": make_deltanet}


# ---- naive float64 references (one step at a time, written independently of the modules) ----------
def _naive_conv_silu(u, weight, bias, mask):
    """Depthwise causal conv + SiLU, zero history; u [b, L, C], weight [C, W]."""
    u = u * mask[..., None]
    W = weight.shape[1]
    up = torch.cat([u.new_zeros(u.shape[0], W - 1, u.shape[2]), u], dim=1)
    out = torch.stack([(up[:, t:t + W] * weight.T).sum(1) for t in range(u.shape[1])], dim=1)
    if bias is not None:
        out = out + bias
    return F.silu(out) * mask[..., None]


def naive_mamba2(m: Mamba2Mixer, x, mask):
    b, L, _ = x.shape
    H, P, G, N = m.num_heads, m.head_dim, m.n_groups, m.state_size
    zxbcdt = x @ m.in_proj.weight.T
    z, xBC, dt = zxbcdt.split([H * P, H * P + 2 * G * N, H], dim=-1)
    xBC = _naive_conv_silu(xBC, m.conv1d.weight[:, 0], m.conv1d.bias, mask)
    xs, Bs, Cs = xBC.split([H * P, G * N, G * N], dim=-1)
    dt = F.softplus(dt + m.dt_bias) * mask[..., None]
    A = -torch.exp(m.A_log)
    group = torch.arange(H) // (H // G)
    h = x.new_zeros(b, H, P, N)
    ys = []
    for t in range(L):
        xt = xs[:, t].reshape(b, H, P)
        Bt = Bs[:, t].reshape(b, G, N)[:, group]  # [b, H, N]
        Ct = Cs[:, t].reshape(b, G, N)[:, group]
        a = torch.exp(dt[:, t] * A)[..., None, None]
        h = a * h + dt[:, t, :, None, None] * xt[..., None] * Bt[:, :, None, :]
        ys.append((h * Ct[:, :, None, :]).sum(-1) + m.D[:, None] * xt)
    y = torch.stack(ys, 1).reshape(b, L, H * P) * F.silu(z)
    yg = y.reshape(b, L, G, -1)
    y = (yg / torch.sqrt(yg.pow(2).mean(-1, keepdim=True) + m.norm.eps)).reshape(b, L, -1) * m.norm.weight
    return y @ m.out_proj.weight.T, h


def naive_deltanet(m: DeltaNetMixer, x, mask):
    b, L, _ = x.shape
    H, dk, dv = m.num_heads, m.head_k_dim, m.head_v_dim
    q = _naive_conv_silu(x @ m.q_proj.weight.T, m.q_conv1d.weight[:, 0], None, mask).reshape(b, L, H, dk)
    k = _naive_conv_silu(x @ m.k_proj.weight.T, m.k_conv1d.weight[:, 0], None, mask).reshape(b, L, H, dk)
    v = _naive_conv_silu(x @ m.v_proj.weight.T, m.v_conv1d.weight[:, 0], None, mask).reshape(b, L, H, dv)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) / dk ** 0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    beta = torch.sigmoid(x @ m.b_proj.weight.T) * mask[..., None]
    S = x.new_zeros(b, H, dk, dv)
    outs = []
    for t in range(L):
        kt, vt, bt = k[:, t], v[:, t], beta[:, t, :, None]
        old = torch.einsum("bhkv,bhk->bhv", S, kt)
        S = S + torch.einsum("bhk,bhv->bhkv", kt, bt * (vt - old))
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    o = torch.stack(outs, 1)
    o = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + m.o_norm.eps) * m.o_norm.weight
    o = o * F.silu((x @ m.g_proj.weight.T).reshape(b, L, H, dv))
    return o.reshape(b, L, H * dv) @ m.out_proj.weight.T, S


NAIVE = {"mamba2": naive_mamba2, "deltanet": naive_deltanet}


# ---- tests ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["mamba2", "deltanet"])
@pytest.mark.parametrize("padded", [False, True])
def test_torch_path_matches_naive_float64(kind, padded):
    m = MAKERS[kind]().double()
    x = torch.randn(3, 37, D_MODEL, dtype=torch.float64)  # several scan chunks, a ragged last one
    mask = torch.ones(3, 37, dtype=torch.float64)
    if padded:
        mask[1, :5] = 0
        mask[2, :30] = 0
    y, (_, state) = m(x, attention_mask=mask if padded else None, return_state=True)
    y_ref, state_ref = NAIVE[kind](m, x, mask)
    real = mask.bool()
    # common.GatedRMSNorm (Mamba2's output norm) computes in float32 even for float64 layers; the scan
    # itself is checked exactly through the state
    tol = 1e-5 if kind == "mamba2" else 1e-10
    torch.testing.assert_close(y[real], y_ref[real], rtol=tol, atol=tol)
    torch.testing.assert_close(state, state_ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", ["mamba2", "deltanet"])
def test_state_continuation_prefill_and_decode(kind):
    m = MAKERS[kind]().double()
    x = torch.randn(2, 23, D_MODEL, dtype=torch.float64)
    y_full, (conv_full, rec_full) = m(x, return_state=True)
    pieces, state = [], None
    for a, b in [(0, 9), (9, 20), (20, 21), (21, 22), (22, 23)]:  # two prefills, three one-token steps
        y, state = m(x[:, a:b], state=state, return_state=True)
        pieces.append(y)
    torch.testing.assert_close(torch.cat(pieces, 1), y_full, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state[0], conv_full, rtol=0, atol=1e-12)
    torch.testing.assert_close(state[1], rec_full, rtol=1e-10, atol=1e-10)
    assert state[0].shape[-1] == m.conv_kernel - 1


@pytest.mark.parametrize("kind", ["mamba2", "deltanet"])
def test_left_padding_equals_unpadded_rows(kind):
    m = MAKERS[kind]()
    L, lengths = 12, [12, 7, 2]
    x = torch.randn(3, L, D_MODEL) * 3  # garbage at padded positions must not leak
    mask = torch.zeros(3, L)
    for i, n in enumerate(lengths):
        mask[i, L - n:] = 1
    y, (conv, rec) = m(x, attention_mask=mask, return_state=True)
    assert torch.isfinite(y).all()
    for i, n in enumerate(lengths):
        yi, (ci, ri) = m(x[i:i + 1, L - n:], return_state=True)
        torch.testing.assert_close(y[i:i + 1, L - n:], yi, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(conv[i:i + 1], ci, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rec[i:i + 1], ri, rtol=1e-5, atol=1e-5)
    # a row of pure padding leaves the state at zero
    _, (c0, r0) = m(x[:1], attention_mask=torch.zeros(1, L), return_state=True)
    assert c0.abs().max() == 0 and r0.abs().max() == 0


@pytest.mark.parametrize("kind", ["mamba2", "deltanet"])
def test_gradients_reach_every_parameter(kind):
    m = MAKERS[kind]()
    x = torch.randn(2, 20, D_MODEL, requires_grad=True)
    y, (conv, rec) = m(x, return_state=True)
    (y.square().mean() + rec.square().mean()).backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().max() > 0, f"zero gradient for {name}"
    assert x.grad.abs().max() > 0


@pytest.mark.parametrize("kind", ["mamba2", "deltanet"])
def test_gradients_flow_through_state(kind):
    """Training on a continued sequence must reach the earlier piece through the carried state."""
    m = MAKERS[kind]().double()
    x = torch.randn(1, 10, D_MODEL, dtype=torch.float64, requires_grad=True)
    _, state = m(x[:, :6], return_state=True)
    y2 = m(x[:, 6:], state=state)
    g_split, = torch.autograd.grad(y2.sum(), x)
    g_full, = torch.autograd.grad(m(x)[:, 6:].sum(), x)
    torch.testing.assert_close(g_split, g_full, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("kind", ["mamba2", "deltanet"])
def test_bf16_runs_and_tracks_fp32(kind):
    m32 = MAKERS[kind]()
    x = torch.randn(2, 19, D_MODEL)
    y32 = m32(x)
    m16 = MAKERS[kind]().to(torch.bfloat16)
    y16, (conv, rec) = m16(x.to(torch.bfloat16), return_state=True)
    assert y16.dtype == torch.bfloat16 and torch.isfinite(y16.float()).all()
    assert rec.dtype == torch.float32  # the scan runs in float32
    err = (y16.float() - y32).norm() / y32.norm()
    assert err < 5e-2, err
    y16.float().sum().backward()
    assert all(p.grad is not None for p in m16.parameters())
    # fp32 input into a bf16 layer computes in bf16 and returns the input dtype
    assert m16(x).dtype == torch.float32


@pytest.mark.parametrize("kind", ["mamba2", "deltanet"])
def test_bad_inputs_raise_clear_errors(kind):
    m = MAKERS[kind]()
    x = torch.randn(2, 5, D_MODEL)
    with pytest.raises(ValueError, match="hidden_states"):
        m(torch.randn(2, 5, D_MODEL + 1))
    with pytest.raises(ValueError, match="hidden_states"):
        m(torch.randn(5, D_MODEL))
    with pytest.raises(TypeError, match="floating-point"):
        m(torch.ones(2, 5, D_MODEL, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask"):
        m(x, attention_mask=torch.ones(2, 4))
    _, (conv, rec) = m(x, return_state=True)
    with pytest.raises(ValueError, match="recurrent_state"):
        m(x, state=(conv, rec[:, :1]))
    with pytest.raises(ValueError, match="conv_state"):
        m(x[:1], state=(conv[:1, :-1], rec[:1]))
    with pytest.raises(TypeError, match="state"):
        m(x, state=rec)
    with pytest.raises(ValueError, match="backend"):
        MAKERS[kind](backend="triton")
    with pytest.raises(RuntimeError, match="kernel"):  # CPU tensors have no library kernels
        MAKERS[kind](backend="kernel")(x)


def test_constructor_errors():
    with pytest.raises(ValueError, match="n_groups"):
        Mamba2Mixer(32, num_heads=3, head_dim=8, n_groups=2)
    with pytest.raises(ValueError, match="head_dim"):
        Mamba2Mixer(30, head_dim=8)
    with pytest.raises(ValueError, match="head_dim"):
        DeltaNetMixer(30, head_dim=8)


def test_mamba_ssm_parameter_layout():
    m = Mamba2Mixer(64, head_dim=16, state_size=8, n_groups=2)  # expand 2: d_inner 128, 8 heads
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    conv_dim = 128 + 2 * 2 * 8
    assert shapes == {"in_proj.weight": (128 + conv_dim + 8, 64), "conv1d.weight": (conv_dim, 1, 4),
                      "conv1d.bias": (conv_dim,), "dt_bias": (8,), "A_log": (8,), "D": (8,),
                      "norm.weight": (128,), "out_proj.weight": (64, 128)}
    assert m.norm.group_size == 64
    dt = F.softplus(m.dt_bias)
    assert (dt >= 1e-4 - 1e-7).all() and (dt <= 0.1 + 1e-6).all()
    assert ((-m.A_log.exp() <= -1) & (-m.A_log.exp() >= -16)).all()


def test_fla_parameter_layout_and_name_mapping():
    m = DeltaNetMixer(64, num_heads=4, head_dim=16)
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes == {"q_proj.weight": (64, 64), "k_proj.weight": (64, 64), "v_proj.weight": (64, 64),
                      "b_proj.weight": (4, 64), "q_conv1d.weight": (64, 1, 4), "k_conv1d.weight": (64, 1, 4),
                      "v_conv1d.weight": (64, 1, 4), "g_proj.weight": (64, 64), "o_norm.weight": (16,),
                      "out_proj.weight": (64, 64)}
    assert m.o_proj is m.out_proj
    fla_sd = {("o_proj" + k[len("out_proj"):] if k.startswith("out_proj") else k): v
              for k, v in m.state_dict().items()}
    m2 = DeltaNetMixer(64, num_heads=4, head_dim=16)
    m2.load_state_dict(DeltaNetMixer.convert_fla_state_dict(fla_sd))
    x = torch.randn(1, 6, 64)
    torch.testing.assert_close(m2(x), m(x))
    # no gate: plain per-head RMSNorm, no g_proj
    m3 = DeltaNetMixer(64, num_heads=4, head_dim=16, use_gate=False)
    assert not hasattr(m3, "g_proj") and m3(x).shape == x.shape


def test_cpu_forward_imports_no_kernel_library():
    """On CPU tensors the auto backend must not even try the kernel libraries."""
    mamba2_mod._KERNELS.clear()
    deltanet_mod._KERNELS.clear()
    x = torch.randn(1, 5, D_MODEL)
    make_mamba2(backend="auto")(x)
    make_deltanet(backend="auto")(x)
    assert mamba2_mod._KERNELS == {} and deltanet_mod._KERNELS == {}


def test_mamba_kernel_import_uses_bare_package_and_cleans_up(tmp_path, monkeypatch):
    """A Triton-only mamba_ssm whose package __init__ fails (no compiled selective_scan_cuda) still
    yields its kernels, and leaves no half-imported mamba_ssm behind for other libraries."""
    if "mamba_ssm" in sys.modules:
        pytest.skip("a real mamba_ssm is already imported in this process")
    pkg = tmp_path / "mamba_ssm"
    (pkg / "ops" / "triton").mkdir(parents=True)
    (pkg / "__init__.py").write_text("import selective_scan_cuda_missing_for_test\n")
    (pkg / "ops" / "__init__.py").write_text("")
    (pkg / "ops" / "triton" / "__init__.py").write_text("")
    (pkg / "ops" / "triton" / "ssd_combined.py").write_text(textwrap.dedent("""
        def mamba_chunk_scan_combined(*args, **kwargs):
            return "chunk"
    """))
    (pkg / "ops" / "triton" / "selective_state_update.py").write_text(textwrap.dedent("""
        def selective_state_update(*args, **kwargs):
            return "step"
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    kernels = mamba2_mod._import_mamba_kernels()
    assert kernels is not None and kernels[0]() == "chunk" and kernels[1]() == "step"
    assert not any(n == "mamba_ssm" or n.startswith("mamba_ssm.") for n in sys.modules)
    with pytest.raises(ImportError):
        __import__("mamba_ssm")


def test_missing_libraries_give_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)  # makes `import fla...` raise ImportError
    monkeypatch.setitem(sys.modules, "mamba_ssm", None)
    deltanet_mod._KERNELS.clear()
    mamba2_mod._KERNELS.clear()
    try:
        assert deltanet_mod.fla_kernels() is None
        assert mamba2_mod.mamba_kernels() is None
    finally:
        deltanet_mod._KERNELS.clear()
        mamba2_mod._KERNELS.clear()


# ---- CUDA: library kernels against the torch path on the same weights --------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["mamba2", "deltanet"])
def test_cuda_kernels_match_torch_path(kind):
    kernels = mamba2_mod.mamba_kernels() if kind == "mamba2" else deltanet_mod.fla_kernels()
    if kernels is None:
        pytest.skip(f"{'mamba_ssm' if kind == 'mamba2' else 'fla'} is not installed")
    m = MAKERS[kind](backend="kernel").cuda()
    x = torch.randn(2, 100, D_MODEL, device="cuda")
    y_k, (_, s_k) = m(x, return_state=True)
    m.backend = "torch"
    y_t, (_, s_t) = m(x, return_state=True)
    tol = 3e-2 if kind == "deltanet" else 2e-3  # fla's chunk kernel runs in bf16
    assert (y_k - y_t).norm() / y_t.norm() < tol
    assert (s_k - s_t).norm() / s_t.norm() < tol
    m.backend = "kernel"
    with torch.no_grad():  # prefill + one-token decode kernels (selective_state_update / fused_recurrent)
        y, state = m(x[:, :97], return_state=True)
        outs = [y]
        for t in range(97, 100):
            y, state = m(x[:, t:t + 1], state=state, return_state=True)
            outs.append(y)
    assert (torch.cat(outs, 1) - y_k).norm() / y_k.norm() < tol

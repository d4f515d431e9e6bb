"""Mamba2Mixer and DeltaNetMixer: the torch paths against naive float64 per-step references, state
continuation, left padding, gradients, bf16, bad inputs, and the lazy library-kernel import."""

import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from gpu_libraries import require_gpu_library

from llm_surgery.layers import deltanet as deltanet_mod
from llm_surgery.layers import mamba2 as mamba2_mod
from llm_surgery.layers.common import conv_update
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
    return o.reshape(b, L, H * dv) @ m.o_proj.weight.T, S


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
                      "o_proj.weight": (64, 64)}
    assert m.out_proj is m.o_proj  # the mixer contract's name
    assert m.library_options()["expand_k"] * 64 == 64 and m.library_options()["num_heads"] == 4
    x = torch.randn(1, 6, 64)
    # an older checkpoint (final projection named out_proj) still loads, directly and through upgrade_state_dict
    old = {("out_proj" + k[len("o_proj"):] if k.startswith("o_proj") else k): v for k, v in m.state_dict().items()}
    m2 = DeltaNetMixer(64, num_heads=4, head_dim=16)
    m2.load_state_dict(old)
    torch.testing.assert_close(m2(x), m(x))
    assert set(DeltaNetMixer.upgrade_state_dict({"mixer." + k: v for k, v in old.items()}, "mixer.")) == \
        {"mixer." + k for k in m.state_dict()}
    # no gate: plain per-head RMSNorm, no g_proj
    m3 = DeltaNetMixer(64, num_heads=4, head_dim=16, use_gate=False)
    assert not hasattr(m3, "g_proj") and m3(x).shape == x.shape


@pytest.mark.parametrize("kind", ["mamba2", "deltanet"])
def test_library_layer_borrows_the_parameters(kind):
    """The library layer a mixer runs on CUDA is bound to the mixer's own Parameter objects (checked here with a
    meta-device twin standing in for the library module, which needs CUDA): nothing is duplicated, a replaced
    parameter is followed, and a layer of another shape is refused."""
    from llm_surgery.layers.common import bind_parameters, rebind

    owner = MAKERS[kind]()
    with torch.device("meta"):
        twin = MAKERS[kind]() if kind == "deltanet" else Mamba2Mixer(D_MODEL, num_heads=4, head_dim=8, state_size=6,
                                                                      n_groups=2)
    n_params, keys = len(list(owner.parameters())), set(owner.state_dict())
    binds = bind_parameters(twin, owner)
    assert all(a is b for a, b in zip(twin.parameters(), owner.parameters()))
    assert len(list(owner.parameters())) == n_params and set(owner.state_dict()) == keys
    owner.load_state_dict({k: v.clone() for k, v in owner.state_dict().items()}, assign=True)
    rebind(binds)
    assert all(a is b for a, b in zip(twin.parameters(), owner.parameters()))
    with torch.device("meta"):
        other = MAKERS[kind](num_heads=8) if kind == "mamba2" else DeltaNetMixer(D_MODEL, num_heads=3, head_dim=8)
    with pytest.raises(ValueError, match="differ in parameters"):
        bind_parameters(other, owner)


def test_library_layer_is_built_once_and_kept_out_of_the_state_dict():
    """common.library_layer builds the library layer on the first call only, bound to the owner's parameters and
    outside its state dict; a build that finds none (None) is remembered too."""
    from llm_surgery.layers.common import library_layer

    owner, builds = make_deltanet(), []

    def build():
        builds.append(1)
        with torch.device("meta"):
            return make_deltanet()

    keys = set(owner.state_dict())
    first = library_layer(owner, build)
    assert library_layer(owner, build) is first and len(builds) == 1
    assert all(a is b for a, b in zip(first.parameters(), owner.parameters())) and set(owner.state_dict()) == keys
    none_owner, none_builds = make_deltanet(), []
    assert library_layer(none_owner, lambda: none_builds.append(1)) is None
    assert library_layer(none_owner, lambda: none_builds.append(1)) is None and len(none_builds) == 1


def test_mamba2_library_options():
    """mamba-ssm's Mamba2 ties its inner width to an integer expand: such layers map onto it, others do not."""
    m = Mamba2Mixer(64, head_dim=16, state_size=8, n_groups=2)
    assert m.library_options() == dict(d_model=64, d_state=8, d_conv=4, expand=2, headdim=16, ngroups=2,
                                       rmsnorm=True, norm_before_gate=False, dt_limit=(0.0, float("inf")),
                                       bias=False, conv_bias=True, chunk_size=256)
    assert Mamba2Mixer(64, num_heads=3, head_dim=16).library_options() is None


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
    for name in [n for n in sys.modules if n == "mamba_ssm" or n.startswith("mamba_ssm.")]:
        monkeypatch.delitem(sys.modules, name)   # a real mamba_ssm imported earlier is hidden, restored afterwards
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
    (pkg / "modules").mkdir()
    (pkg / "modules" / "__init__.py").write_text("")
    (pkg / "modules" / "mamba2.py").write_text("class Mamba2:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = mamba2_mod._import_mamba()
    kernels, (cls, fused) = found["kernels"], found["module"]
    assert kernels[0]() == "chunk" and kernels[1]() == "step"
    assert cls.__name__ == "Mamba2" and fused is False  # no causal-conv1d functions: not the fused path
    assert not any(n == "mamba_ssm" or n.startswith("mamba_ssm.") for n in sys.modules)
    with pytest.raises(ImportError, match="selective_scan_cuda_missing_for_test"):
        __import__("mamba_ssm")


def test_missing_libraries_give_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)  # makes `import fla...` raise ImportError
    monkeypatch.setitem(sys.modules, "mamba_ssm", None)
    deltanet_mod._KERNELS.clear()
    mamba2_mod._KERNELS.clear()
    try:
        assert deltanet_mod.fla_kernels() is None
        assert mamba2_mod.mamba_kernels() is None and mamba2_mod.mamba_module() is None
    finally:
        deltanet_mod._KERNELS.clear()
        mamba2_mod._KERNELS.clear()


# ---- CUDA: the libraries' layers against the torch path on the same weights -----------------------------------
def _rel(a, b):
    """Relative error of a against b, on the CPU (the two may live on different devices)."""
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    return ((a - b).norm() / b.norm()).item()


def _cuda_mixer(kind, dtype, width=256):
    """A registry-default mixer (the shapes the surgery inserts) on CUDA, off its init, with a CPU float32 twin."""
    require_gpu_library(kind)
    from llm_surgery.layers.registry import build_mixer
    torch.manual_seed(0)
    cpu = _perturb(build_mixer(kind, width, backend="torch"), seed=1)
    with torch.no_grad():  # modest weights, as after training: bf16 rounding stays small against the signal
        for p in cpu.parameters():
            p.mul_(0.5)
    gpu = build_mixer(kind, width, backend="kernel").to("cuda", dtype)
    gpu.load_state_dict(cpu.state_dict())
    cpu.load_state_dict(gpu.state_dict())  # the CPU twin holds exactly the GPU's (rounded) weights
    return gpu, cpu.float()


def _library_calls(m):
    """Count the calls of the library layer a mixer runs (built by its first CUDA call)."""
    layer = m.__dict__["_library_layer"][0]
    calls = []
    layer.register_forward_pre_hook(lambda *a: calls.append(1))
    return layer, calls


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["mamba2", "deltanet"])
def test_cuda_library_layer_matches_cpu_path(kind):
    """bf16 on CUDA runs mamba-ssm's Mamba2 / fla's DeltaNet on the mixer's own parameters; outputs, gradients,
    cached decoding and padding agree with the CPU torch path within bf16 tolerance."""
    gpu, cpu = _cuda_mixer(kind, torch.bfloat16)
    x = torch.randn(2, 160, 256)
    xg = x.cuda().bfloat16().requires_grad_()
    y = gpu(xg)
    layer, calls = _library_calls(gpu)
    assert type(layer).__name__ == ("Mamba2" if kind == "mamba2" else "DeltaNet")
    assert dict(layer.named_parameters()).keys() == dict(gpu.named_parameters()).keys()
    assert all(a is b for a, b in zip(layer.parameters(), gpu.parameters()))  # one set of weights
    assert all(mod is not layer for mod in gpu.modules()) and len(list(gpu.parameters())) == len(list(cpu.parameters()))
    y = gpu(xg)
    assert calls == [1]
    xc = x.clone().requires_grad_()
    y_ref = cpu(xc)
    assert _rel(y, y_ref) < 3e-2
    g = torch.randn_like(y_ref)
    y.backward(g.cuda().bfloat16())
    y_ref.backward(g)
    assert _rel(xg.grad, xc.grad) < 3e-2
    for (n, p), q in zip(gpu.named_parameters(), cpu.parameters()):
        assert _rel(p.grad, q.grad) < 0.1, n

    # cached decoding: a prefill that returns the state, then one-token library steps, equals the full forward
    with torch.no_grad():
        full = gpu(xg[:, :48])
        out, state = gpu(xg[:, :44], return_state=True)
        outs = [out]
        for t in range(44, 48):
            out, state = gpu(xg[:, t:t + 1], state=state, return_state=True)
            outs.append(out)
        _, state_ref = cpu(x[:, :48], return_state=True)
    assert _rel(torch.cat(outs, 1), full) < 3e-2
    assert _rel(state[0], state_ref[0]) < 2e-2 and _rel(state[1], state_ref[1]) < 3e-2
    assert state[0].shape == state_ref[0].shape and state[1].dtype == torch.float32

    # a step leaves the state given as it was; with inplace=True it gives the same output and state, written into
    # the given tensors where the library's step updates its own in place (no copy per token)
    with torch.no_grad():
        kept = [t.clone() for t in state]
        out, new = gpu(xg[:, 48:49], state=state, return_state=True)
        assert all(torch.equal(a, b) for a, b in zip(state, kept))
        out_i, new_i = gpu(xg[:, 48:49], state=state, return_state=True, inplace=True)
    assert torch.equal(out_i, out) and all(torch.equal(a, b) for a, b in zip(new_i, new))
    if conv_update() is not None:  # causal-conv1d's update takes the conv state as it is
        assert new_i[0] is state[0]
    if kind == "mamba2":  # selective_state_update writes the scan state (fla's recurrent kernel makes a new one)
        assert new_i[1] is state[1]

    # padding: left (generation) and right (training) masks give the unpadded rows' outputs; left padding leaves
    # the state as the unpadded row's
    L, n = 40, 29
    mask = torch.zeros(2, L, dtype=torch.bool, device="cuda")
    mask[0] = True
    with torch.no_grad():
        row = gpu(xg[1:, :n])
        left = mask.clone()
        left[1, L - n:] = True
        xl = xg[:, :L].clone()
        xl[1, L - n:] = xg[1, :n]
        y_left, (c_left, s_left) = gpu(xl, attention_mask=left, return_state=True)
        _, (c_row, s_row) = gpu(xg[1:, :n], return_state=True)
        assert _rel(y_left[1, L - n:], row[0]) < 3e-2 and _rel(gpu(xl, attention_mask=left)[1, L - n:], row[0]) < 3e-2
        assert _rel(c_left[1:], c_row) < 2e-2 and _rel(s_left[1:], s_row) < 2e-2
        right = mask.clone()
        right[1, :n] = True
        before = len(calls)
        assert _rel(gpu(xg[:, :L], attention_mask=right)[1, :n], row[0]) < 3e-2
        assert len(calls) == before + 1  # right padding runs the library layer


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["mamba2", "deltanet"])
def test_cuda_float32_layer_matches_torch_path(kind):
    """A float32 layer on CUDA (fla's chunk kernel runs it in bf16) against the torch path, with decoding."""
    gpu, cpu = _cuda_mixer(kind, torch.float32, width=128)
    x = torch.randn(2, 100, 128)
    with torch.no_grad():
        y = gpu(x.cuda())
        y_t, (_, s_t) = cpu(x, return_state=True)
        y_k, state = gpu(x[:, :97].cuda(), return_state=True)
        outs = [y_k]
        for t in range(97, 100):
            y_k, state = gpu(x[:, t:t + 1].cuda(), state=state, return_state=True)
            outs.append(y_k)
    tol = 3e-2 if kind == "deltanet" else 2e-3
    assert _rel(y, y_t) < tol and _rel(torch.cat(outs, 1), y_t) < tol and _rel(state[1], s_t) < tol

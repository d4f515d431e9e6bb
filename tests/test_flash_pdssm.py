"""The Flash PD-SSM layer: Mixer contract (state continuation, padding, dtypes), memory shape, errors."""

import importlib.util
import math

import pytest
import torch

from llm_surgery.layers import FlashPDSSM, tau_schedule


def _layer(complex_=True, **kw):
    torch.manual_seed(0)
    kw.setdefault("dict_size", 6)
    layer = FlashPDSSM(48, num_heads=4, complex=complex_, **kw).double()
    with torch.no_grad():  # a non-zero initial state makes the padding test meaningful
        layer.x_init.normal_()
    return layer


@pytest.mark.parametrize("complex_", [True, False])
def test_state_continuation_and_step_equal_full_forward(complex_):
    layer = _layer(complex_)
    x = torch.randn(3, 29, 48, dtype=torch.float64)
    with torch.no_grad():
        full = layer(x)
        y1, st = layer(x[:, :11], return_state=True)
        y2, st = layer(x[:, 11:20], state=st, return_state=True)
        outs = [y1, y2]
        for t in range(20, 29):
            yt, st = layer.step(x[:, t], st)
            outs.append(yt.unsqueeze(1))
    assert torch.allclose(torch.cat(outs, 1), full, atol=1e-12)
    # a one-token forward from a state is exactly the step
    with torch.no_grad():
        _, st = layer(x[:, :5], return_state=True)
        a, _ = layer(x[:, 5:6], state=st, return_state=True)
        b, _ = layer.step(x[:, 5], st)
    assert torch.equal(a[:, 0], b)


@pytest.mark.parametrize("grad", [False, True])
def test_left_padding_leaves_state_untouched(grad):
    layer = _layer()
    x = torch.randn(2, 17, 48, dtype=torch.float64)
    mask = torch.ones(2, 17)
    mask[1, :6] = 0
    xp = x.clone()
    xp[1, :6] = 50.0  # garbage in the padding must not matter
    with torch.set_grad_enabled(grad):
        padded = layer(xp, attention_mask=mask)
        single = layer(x[1:, 6:])
    assert torch.allclose(padded[1, 6:], single[0], atol=1e-12)


def test_gradients_reach_every_parameter_and_tau_changes_only_backward():
    layer = _layer()
    x = torch.randn(2, 13, 48, dtype=torch.float64)
    out1 = layer(x)
    out1.pow(2).sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    g1 = layer.dictionary.grad.clone()
    layer.zero_grad()
    layer.tau = 0.2
    out2 = layer(x)
    out2.pow(2).sum().backward()
    assert torch.equal(out1, out2)
    assert not torch.allclose(g1, layer.dictionary.grad)


def test_bf16_runs_and_tracks_float64():
    """bf16 weights and activations, scan in float32: close to float64 on the same (bf16-rounded) weights.
    With one dictionary member no hard selection can flip on bf16 rounding, so the outputs must agree."""
    import copy
    layer = _layer(dict_size=1).to(torch.bfloat16)
    x = torch.randn(2, 40, 48).bfloat16()
    out = layer(x)
    ref = copy.deepcopy(layer).double()(x.double())
    assert out.dtype == torch.bfloat16
    assert (out.double() - ref).norm() < 0.03 * ref.norm()
    trained = _layer().to(torch.bfloat16)  # and with selection, training in bf16 gives finite gradients
    trained(x).float().pow(2).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in trained.parameters())


def test_no_per_token_dense_transition():
    """Memory O(B*L*H*N + H*K*N*N): the biggest saved activation is per-token vectors, not N x N matrices."""
    layer = FlashPDSSM(64, num_heads=2, state_size=32, dict_size=4)
    x = torch.randn(2, 50, 64)
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x).sum()
    B, L, H, N = 2, 50, 2, 32
    assert max(sizes) < B * L * H * N * N / 4
    assert max(sizes) <= max(B * L * 2 * 64 * 2, H * 4 * N * N)


def test_defaults_scale_with_width():
    layer = FlashPDSSM(1024)
    assert (layer.num_heads, layer.dict_size, layer.state_size) == (32, 32, 32)
    assert layer.transitions().dtype == torch.int16 and layer.transitions().shape == (32, 32, 32)


def test_tau_schedule_is_geometric():
    assert tau_schedule(0, 100, 1.0, 0.1) == 1.0
    assert tau_schedule(100, 100, 1.0, 0.1) == pytest.approx(0.1)
    assert tau_schedule(50, 100, 1.0, 0.01) == pytest.approx(0.1)


def test_errors():
    with pytest.raises(ValueError, match="divisible"):
        FlashPDSSM(48, num_heads=5)
    with pytest.raises(ValueError, match="dict_init"):
        FlashPDSSM(48, dict_init="bogus")
    layer = FlashPDSSM(48, num_heads=4)
    with pytest.raises(ValueError, match=r"\[batch, seq_len, 48\]"):
        layer(torch.randn(2, 5, 40))
    with pytest.raises(ValueError, match="attention_mask"):
        layer(torch.randn(2, 5, 48), attention_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="recurrent state"):
        layer(torch.randn(2, 5, 48), state=(None, torch.zeros(2, 3, 12, dtype=torch.complex64)))


def test_sizes_that_do_not_divide_and_bad_tau_are_refused_up_front():
    """Sizes that do not fit used to be bent silently (head_dim=10 at width 48 became 12; num_heads=4 with
    head_dim=8 dropped head_dim; 0 meant the default) or failed deep in torch (negatives); tau <= 0 or nan was
    taken and failed, or trained on nan, only at the first training step. Now each is a ValueError naming it, in
    the constructor and wherever tau is set later (set_tau and schedules assign the attribute)."""
    for kw, msg in ((dict(head_dim=10), r"num_heads \* head_dim must equal expand\*hidden_size=48"),
                    (dict(num_heads=4, head_dim=8), r"num_heads \* head_dim must equal"),
                    (dict(head_dim=100), r"num_heads \* head_dim must equal"),
                    (dict(state_size=0), "state_size must be a positive int"),
                    (dict(dict_size=-1), "dict_size must be a positive int"),
                    (dict(expand=0), "expand must be a positive int"),
                    (dict(conv_kernel=0), "conv_kernel must be a positive int")):
        with pytest.raises(ValueError, match=msg):
            FlashPDSSM(48, **kw)
    assert FlashPDSSM(48, num_heads=4, head_dim=12).head_dim == 12
    for bad in (0, -1.0, float("nan"), float("inf"), True, "0.5"):
        with pytest.raises(ValueError, match="tau must be a positive finite number"):
            FlashPDSSM(48, tau=bad)
    layer = FlashPDSSM(48, tau=0.5)
    for bad in (0.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match="tau must be a positive finite number"):
            layer.tau = bad
    assert layer.tau == 0.5
    layer.tau = 1
    assert layer.tau == 1.0 and isinstance(layer.tau, float)
    with pytest.raises(ValueError, match="tau_schedule"):
        tau_schedule(5, 10, 1.0, 0.0)


def test_bf16_autocast_keeps_the_scan_in_float32():
    torch.manual_seed(0)
    layer = FlashPDSSM(64, num_heads=4)
    x = torch.randn(2, 20, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
        y.float().pow(2).sum().backward()
    assert y.dtype == torch.bfloat16
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())
    ref = layer(x)
    assert (y.float() - ref).norm() < 0.05 * ref.norm()


@pytest.mark.parametrize("group_size", [None, 4])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("slice_elements", [1 << 24, 36])
def test_gated_rms_norm_backward_matches_autograd(group_size, gated, slice_elements, monkeypatch):
    """The norm's hand-written backward (it recomputes float32 intermediates instead of saving them) against
    finite differences, and its forward against the plain formula; in one piece and in row slices of 3 rows
    (10 rows: a ragged last slice)."""
    from llm_surgery.layers.common import GatedRMSNorm, _GatedRMSNormFn
    monkeypatch.setattr(_GatedRMSNormFn, "ROW_SLICE_ELEMENTS", slice_elements)
    torch.manual_seed(0)
    norm = GatedRMSNorm(12, group_size=group_size).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 5, 12, dtype=torch.float64, requires_grad=True)
    z = torch.randn(2, 5, 12, dtype=torch.float64, requires_grad=True)
    run = (lambda x, z, w: norm(x, z)) if gated else (lambda x, z, w: norm(x))
    assert torch.autograd.gradcheck(run, (x, z, norm.weight))
    g = x * torch.nn.functional.silu(z) if gated else x
    gs = group_size or 12
    gg = g.reshape(2, 5, 12 // gs, gs)
    ref = (gg * torch.rsqrt(gg.pow(2).mean(-1, keepdim=True) + norm.eps)).reshape(2, 5, 12) * norm.weight
    assert torch.allclose(run(x, z, norm.weight), ref, atol=1e-12)


def test_bf16_layer_keeps_few_activations_for_backward():
    """What a bf16 layer keeps for backward per token (weights and input excluded): the scan's tensors, not
    float32 copies of every intermediate. Measured: width 256 19.9 -> 11.3 KiB/token, width 1024 81.8 -> 47.6
    KiB/token when the norm's recomputing backward, sigmoid |D|, view_as_complex b and the copied selector
    logits came in."""
    from llm_surgery.layers.registry import build_mixer
    torch.manual_seed(0)
    layer = build_mixer("pdssm", 256).to(torch.bfloat16)
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    x = torch.randn(1, 64, 256, dtype=torch.bfloat16, requires_grad=True)
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr != x.untyped_storage().data_ptr():
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x).sum().backward()
    per_token = sum(seen.values()) / 64
    # float32 [B,L,H,N] copies cost 4*H*N = 1 KiB/token each at this width (H*N = 256); the scan itself needs
    # D and x (complex64: 2 KiB each), the selector logits and |D| (float32)
    assert per_token < 14 * 1024, per_token


def test_unit_snap_reaches_exactly_one_and_stops_the_decay_gate():
    layer = _layer(unit_snap=0.01, b_gate="decay")
    with torch.no_grad():  # decays from 1e-4 (locked at |D| = 1) to ~1 (free): both regimes present
        layer.decay_bias.copy_(torch.linspace(-9.0, 1.0, layer.decay_bias.numel()))
    _, D, b, _ = layer._ssm_inputs(torch.randn(2, 7, 48, dtype=torch.float64))
    mag = D.abs()
    locked = mag == 1.0
    assert locked.any() and (~locked).any() and mag.max() <= 1.0
    assert torch.all(b[locked] == 0)  # a kept entry takes no input
    free = _layer(b_gate="decay")  # without the snap no magnitude is exactly 1
    with torch.no_grad():
        free.decay_bias.copy_(layer.decay_bias)
    assert free._ssm_inputs(torch.randn(2, 7, 48, dtype=torch.float64))[1].abs().max() < 1.0


def test_phase_levels_round_forward_and_pass_gradients_straight_through():
    import math
    layer = _layer(phase_levels=10)
    u = torch.randn(2, 7, 48, dtype=torch.float64)
    _, D, _, _ = layer._ssm_inputs(u)
    q = torch.angle(D) / (2 * math.pi / 10)
    assert torch.allclose(q, q.round(), atol=1e-9)
    # straight through: the phase columns of x_proj get the gradient of the rounded phases (not zero)
    (D.real.sum() + D.imag.sum()).backward()
    K, N, H = layer.dict_size, layer.state_size, layer.num_heads
    g = layer.x_proj.weight.grad.view(H, -1, layer.x_proj.weight.shape[1])[:, K + N:K + 2 * N]
    assert g.abs().sum() > 0
    with pytest.raises(ValueError, match="phase_levels"):
        FlashPDSSM(48, num_heads=4, complex=False, phase_levels=4)
    with pytest.raises(ValueError, match="unit_snap"):
        FlashPDSSM(48, num_heads=4, unit_snap=-0.1)


def test_snapped_magnitudes_and_rounded_phases_track_parity_exactly_at_any_length():
    """The mechanism behind the 'tracking' preset: a head whose phase is pi (plus a small error, as learned
    phases have) per 1-bit and whose decay is 1e-3 drifts away from the parity over 3,001 steps; with unit_snap
    and phase_levels the same head holds x_init * (-1)^(number of ones) to rounding error."""
    import math
    torch.manual_seed(0)
    bits = torch.randint(0, 2, (2, 3001))
    u = torch.zeros(2, 3001, 8, dtype=torch.float64)
    u[..., 0] = bits.double()
    sign = (1.0 - 2.0 * (bits.sum(1) % 2)).double()[:, None, None]

    def last_state(**opts):
        layer = FlashPDSSM(8, num_heads=1, state_size=4, dict_size=2, conv_kernel=1, dict_init="identity",
                           b_gate="off", x_init_std=1.0, **opts).double()
        K, N = 2, 4
        assert torch.equal(layer.transitions().long(), torch.arange(N).expand(1, K, N))  # P_t = identity
        with torch.no_grad():
            w = layer.x_proj.weight  # rows: K selector logits | N decay logits | N phases
            w.zero_()
            w[K + N:, 0] = math.pi + 0.02
            layer.decay_bias.fill_(math.log(math.expm1(1e-3)))  # |D| = exp(-1e-3) before any snap
            _, last = layer._scan_and_read(u, None, None)
        return last, layer.initial_state(2)

    exact, x0 = last_state(unit_snap=0.01, phase_levels=10)
    torch.testing.assert_close(exact, x0 * sign, atol=1e-9, rtol=0)
    drift, x0 = last_state()
    assert (drift - x0 * sign).abs().max() > 0.5 * x0.abs().max()


def test_backend_option():
    """backend like the other mixers: "torch" and "auto" give the same layer on CPU (where the fused op cannot
    run), "kernel" refuses a call the fused op cannot take (CPU here; a real layer anywhere), and an unknown
    backend is refused in the constructor."""
    with pytest.raises(ValueError, match="backend must be one of"):
        FlashPDSSM(48, backend="triton")
    torch.manual_seed(0)
    auto = FlashPDSSM(48, x_init_std=0.1)
    torch.manual_seed(0)
    ref = FlashPDSSM(48, x_init_std=0.1, backend="torch")
    x = torch.randn(2, 7, 48)
    assert auto.backend == "auto" and torch.equal(auto(x), ref(x))
    ref.backend = "kernel"
    with pytest.raises(RuntimeError, match="backend='kernel' needs a complex layer and CUDA"):
        ref(x)
    assert "backend='torch'" in repr(FlashPDSSM(48, backend="torch"))


def test_one_cuda_fast_path_decision(monkeypatch):
    """`ops.fast_path.cuda_fast_path` answers for every PD-SSM op: a CUDA tensor, the op's dtypes and state-size
    limit, and what it needs (Triton, the pd_scan extension, asked only when all else holds). A stand-in tensor
    plays the CUDA one; the extension and Triton are stood in for too."""
    from types import SimpleNamespace

    from llm_surgery.layers import flash_pdssm_fused
    from llm_surgery.layers.common import _block_kernels
    from llm_surgery.ops import fast_path
    from llm_surgery.ops.pd_scan import _use_cuda_kernels, cuda

    def gpu(shape, dtype=torch.float32):
        return SimpleNamespace(is_cuda=True, dtype=dtype, shape=torch.Size(shape), dim=lambda: len(shape),
                               stride=lambda d: 1)

    built = []
    monkeypatch.setattr(cuda, "available", lambda: built.append(1) or True)
    monkeypatch.setattr(fast_path, "triton_imports", lambda: True)
    ask = fast_path.cuda_fast_path
    assert not ask(torch.zeros(2, 3), scan_kernels=True, triton=True)   # a CPU tensor never
    assert ask(gpu((2, 3))) and ask(gpu((2, 3)), triton=True) and not built
    assert not ask(gpu((2, 3), torch.float64), dtypes=cuda.SUPPORTED_DTYPES, scan_kernels=True)
    assert not ask(gpu((2, 1025)), max_state=cuda.MAX_N, scan_kernels=True) and not built
    assert ask(gpu((2, 1024)), max_state=cuda.MAX_N, scan_kernels=True) and built == [1]
    monkeypatch.setattr(fast_path, "triton_imports", lambda: False)
    assert not ask(gpu((2, 3)), triton=True) and not ask(gpu((2, 3)), scan_kernels=True, triton=True)
    assert built == [1]   # no Triton: the extension is not even built
    # what each op asks for
    monkeypatch.setattr(fast_path, "triton_imports", lambda: True)
    assert _use_cuda_kernels(gpu((4, 5, 1024), torch.complex64)) and not _use_cuda_kernels(gpu((4, 5, 1025)))
    assert not _use_cuda_kernels(gpu((4, 5, 8), torch.float64))
    assert flash_pdssm_fused.usable(gpu((2, 5, 4096), torch.bfloat16))   # no state-size limit on u's width
    assert not flash_pdssm_fused.usable(gpu((2, 5, 48), torch.complex64))
    monkeypatch.setattr(fast_path, "triton_imports", lambda: False)
    assert _use_cuda_kernels(gpu((4, 5, 8))) and not flash_pdssm_fused.usable(gpu((2, 5, 48)))
    assert _block_kernels(gpu((2, 5, 48))) is None   # the block pieces' Triton kernels need Triton only
    if importlib.util.find_spec("triton") is not None:
        monkeypatch.setattr(fast_path, "triton_imports", lambda: True)
        assert _block_kernels(gpu((2, 5, 48))) is not None and _block_kernels(gpu((2, 5, 48), torch.float64)) is None


@pytest.mark.parametrize("complex_,b_gate", [(True, None), (False, None), (True, "sigmoid"), (False, "hard")])
def test_read_gate_starts_as_the_plain_layer_then_learns_a_per_token_readout(complex_, b_gate):
    """read_gate=True: the same layer at init (its x_proj rows start at zero, r_t = 1), gradients reach those rows,
    and once they are non-zero the readout is Re(C_h (r_t x_t)) with r_t from u_t; steps still equal one pass;
    backend='kernel' is refused when built."""
    torch.manual_seed(0)
    plain = FlashPDSSM(48, num_heads=4, dict_size=4, complex=complex_, b_gate=b_gate).double()
    torch.manual_seed(0)
    gated = FlashPDSSM(48, num_heads=4, dict_size=4, complex=complex_, b_gate=b_gate, read_gate=True).double()
    H, N = gated.num_heads, gated.state_size
    n_read = (2 if complex_ else 1) * N
    rows = gated.x_proj.weight.view(H, -1, 48)
    with torch.no_grad():
        rows[:, :-n_read].copy_(plain.x_proj.weight.view(H, -1, 48))
        gated.load_state_dict({k: v for k, v in plain.state_dict().items() if k != "x_proj.weight"}, strict=False)
    x = torch.randn(2, 13, 48, dtype=torch.float64)
    y = gated(x)
    assert torch.allclose(y, plain(x), atol=1e-12)
    y.pow(2).sum().backward()
    assert gated.x_proj.weight.grad.view(H, -1, 48)[:, -n_read:].abs().sum() > 0
    with torch.no_grad():
        rows[:, -n_read:].normal_(0, 0.3)
        assert not torch.allclose(gated(x), plain(x), atol=1e-6)
        full = gated(x)
        y1, st = gated(x[:, :7], return_state=True)
        outs = [y1]
        for t in range(7, 13):
            yt, st = gated.step(x[:, t], st)
            outs.append(yt.unsqueeze(1))
    assert torch.allclose(torch.cat(outs, 1), full, atol=1e-12)
    with pytest.raises(ValueError, match="read gate"):
        FlashPDSSM(48, num_heads=4, read_gate=True, backend="kernel")
    with pytest.raises(ValueError, match="read_gate must be True or False"):
        FlashPDSSM(48, num_heads=4, read_gate="yes")


@pytest.mark.parametrize("complex_,b_gate", [(True, None), (False, None), (True, "decay")])
def test_matrix_state_is_a_pd_scan_per_value_column_read_by_a_query(complex_, b_gate):
    """matrix_state=True against a per-token float64 loop over X [N, P] per head: X_t[P_t[m]] += D_t[m] X_{t-1}[m]
    (the scatter), then X_t += b_t u_t^T, y_t = Re(X_t^T C_h^T u_t) + D_skip u_t; a prefix plus one-token steps
    equal one pass, left padding leaves the state as it was, every weight gets a gradient, and what it cannot do
    is refused when built."""
    torch.manual_seed(0)
    layer = FlashPDSSM(24, num_heads=3, state_size=5, dict_size=4, complex=complex_, b_gate=b_gate,
                       dict_init="normal", x_init_std=0.5, matrix_state=True).double()
    B, L, H, P, N = 2, 9, 3, 8, 5
    u = torch.randn(B, L, H * P, dtype=torch.float64)
    y, last = layer._scan_and_read(u, None, None)
    sel, D, key, _ = layer._ssm_inputs(u)
    dest = layer.transitions().long()[torch.arange(H)[None, :, None], sel.argmax(-1)]       # [B, H, L, N]
    Cq = torch.complex(layer.C[..., 0], layer.C[..., 1]) if complex_ else layer.C[..., 0]
    X = layer.initial_state(B).transpose(2, 3).to(key.dtype)                               # [B, H, N, P]
    ref = []
    for t in range(L):
        v = u[:, t].view(B, H, P).to(X.dtype)
        moved = torch.zeros_like(X).scatter_add_(2, dest[:, :, t, :, None].expand(B, H, N, P),
                                                 D[:, :, t, :, None] * X)
        X = moved + key[:, :, t, :, None] * v[:, :, None, :]
        query = torch.einsum("bhp,hpn->bhn", v, Cq.to(X.dtype))
        out = torch.einsum("bhnp,bhn->bhp", X, query)
        ref.append((out.real if out.is_complex() else out) + layer.D_skip * u[:, t].view(B, H, P))
    assert torch.allclose(y, torch.stack(ref, 1).reshape(B, L, H * P), atol=1e-10)
    assert torch.allclose(last, X.transpose(2, 3), atol=1e-10)
    x = torch.randn(B, L, 24, dtype=torch.float64)
    with torch.no_grad():
        full = layer(x)
        y1, st = layer(x[:, :4], return_state=True)
        outs = [y1]
        for t in range(4, L):
            yt, st = layer.step(x[:, t], st)
            outs.append(yt.unsqueeze(1))
        assert torch.allclose(torch.cat(outs, 1), full, atol=1e-10)
        padded = torch.cat([torch.randn(B, 3, 24, dtype=torch.float64), x], 1)
        mask = torch.cat([torch.zeros(B, 3), torch.ones(B, L)], 1).long()
        assert torch.allclose(layer(padded, attention_mask=mask)[:, 3:], full, atol=1e-10)
    layer(x).pow(2).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in layer.named_parameters()
               if n != "decay_bias" or b_gate == "decay"), [n for n, p in layer.named_parameters() if p.grad is None]
    with pytest.raises(ValueError, match="matrix state"):
        FlashPDSSM(48, num_heads=4, matrix_state=True, backend="kernel")
    with pytest.raises(ValueError, match="neither read_gate"):
        FlashPDSSM(48, num_heads=4, matrix_state=True, read_gate=True)
    with pytest.raises(ValueError, match="recurrent state must be"):
        layer(x, state=(None, torch.zeros(B, H, N, dtype=torch.complex128)))


def test_distinct_init_draws_different_members_per_head():
    """Members drawn with repeats leave heads short of transitions: up to N! members are all distinct, beyond that
    every permutation is there; each is a permutation, and the layer's members start on them."""
    from llm_surgery.layers.flash_pdssm import distinct_permutations
    torch.manual_seed(0)
    for K, N in ((6, 3), (8, 3), (60, 5), (2, 2), (16, 12)):
        P = distinct_permutations(K, N)
        assert P.shape == (K, N) and torch.equal(P.sort(-1).values, torch.arange(N).expand(K, N))
        assert len({tuple(p) for p in P.tolist()}) == min(K, math.factorial(N))
    layer = FlashPDSSM(48, num_heads=16, state_size=3, dict_size=8, dict_init="distinct")
    T = layer.transitions().long()
    distinct = [len({tuple(m) for m in T[h].tolist() if sorted(m) == [0, 1, 2]}) for h in range(16)]
    assert distinct == [6] * 16   # random members (with repeats) cover S3 in ~11% of heads


@pytest.mark.parametrize("N", [2, 5, 24, 64])
def test_initial_members_are_exactly_the_maps_each_init_names(N):
    """identity / permutation / distinct: every hard member is that map at any state size (a margin added to the
    chosen logit alone lost to the largest random one in 19% of columns at N = 32: merging maps from the start)."""
    torch.manual_seed(0)
    K = 120 if N == 5 else 16
    for how in ("identity", "permutation", "distinct"):
        T = FlashPDSSM(64, num_heads=4, state_size=N, dict_size=K, complex=False, dict_init=how).transitions().long()
        assert torch.equal(T.sort(-1).values, torch.arange(N).expand_as(T)), how      # permutations, none merges
        if how == "identity":
            assert torch.equal(T, torch.arange(N).expand_as(T))
        if how == "distinct":   # all different; every permutation (all of S5) at N = 5, K = 120
            assert all(len({tuple(m) for m in T[h].tolist()}) == min(K, math.factorial(N)) for h in range(4))


def test_noisy_permutations_leave_a_few_columns_elsewhere():
    """noisy_permutation (the one-layer recipe's init): the margin on the chosen logit alone, so a few columns start
    on another entry and some members merge entries; the same draws as permutation otherwise."""
    torch.manual_seed(0)
    T = FlashPDSSM(64, num_heads=4, state_size=5, dict_size=120, complex=False,
                   dict_init="noisy_permutation").transitions().long()
    merging = (T.sort(-1).values != torch.arange(5)).any(-1).double().mean()
    assert 0.05 < float(merging) < 0.5


def test_watching_inputs_sees_the_scan_input_changes_nothing_and_is_removed_after_an_error():
    layer = _layer(complex_=False)
    x = torch.randn(2, 7, layer.hidden_size, dtype=torch.float64)
    seen = []
    with torch.no_grad():
        before = layer(x)
        with layer.watching_inputs(lambda u, mask: seen.append((u.shape, mask))):
            during = layer(x)
        after = layer(x)
    assert seen == [((2, 7, layer.d_inner), None)]
    assert torch.equal(during, before) and torch.equal(after, before)
    with pytest.raises(RuntimeError, match="boom"), layer.watching_inputs(lambda u, mask: None):
        raise RuntimeError("boom")
    assert layer._watchers == []


@pytest.mark.parametrize("width,expand,heads", [(768, 1, 32), (2048, 1, 64), (4096, 1, 64), (4160, 1, 65),
                                                (4480, 1, 70), (5120, 1, 80), (8192, 1, 128), (4096, 2, 128),
                                                (4100, 1, 64)])
def test_default_heads_are_the_papers_unless_wider_than_the_fused_op_serves(width, expand, heads):
    """~sqrt(D) power-of-two heads while they are at most MAX_HEAD_SIZE wide; wider, the fewest heads that divide the
    width and fit (4100 has none at 64 heads: the paper's count stays and the constructor says it does not divide)."""
    from llm_surgery.layers.flash_pdssm import default_num_heads, pow2_sqrt
    from llm_surgery.layers.flash_pdssm_fused import MAX_HEAD_SIZE

    got = default_num_heads(width, expand * width)
    assert got == heads
    if (expand * width) % got == 0:
        assert (expand * width) // got <= MAX_HEAD_SIZE or got == pow2_sqrt(width)
        with torch.device("meta"):
            assert FlashPDSSM(width, expand=expand).num_heads == heads
    else:
        with torch.device("meta"), pytest.raises(ValueError, match="must be divisible by num_heads=64"):
            FlashPDSSM(width)

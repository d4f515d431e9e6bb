"""The fused CUDA path of complex FlashPDSSM layers (layers/flash_pdssm_fused.py, backend="kernel") against the
layer's torch path (backend="torch"):
outputs, input gradient and every parameter gradient, with and without padding, for every b-gate.

On the GPU it runs for real. On the CPU it runs under Triton's interpreter (subprocess, TRITON_INTERPRET=1) with
the split-plane CUDA scan replaced by the torch scan, which test_pd_scan_cuda.py checks against the kernels:
that covers the fused path's own code (projection layout, planes, gates, readout, straight-through sums)."""

import copy
import json
import os
import subprocess
import sys
import textwrap
import zlib

import pytest
import torch
from interpreter import require_interpreter_kernels

GATES = (None, "sigmoid", "hard", "decay", "off")
# the layer's options against length drift, with the gates they interact with (decay: 1 - |D| under the snap)
DRIFT = [(gate, {"unit_snap": 3e-3, "phase_levels": 12}) for gate in (None, "decay")]  # ~1/4 of |D| clamp
ALL_CASES = [(g, {}) for g in GATES] + DRIFT   # (b_gate, drift options) of a comparison run
LARGE = {"width": 128, "num_heads": 2, "state_size": 64}   # heads of 64 x 64: float32 products on 16-token tiles


def _compare(device: str, dtype=torch.float32, width: int = 64, L: int = 23, cases=None, **sizes):
    """Relative deviations (fused vs torch path) per b-gate (and drift options) and padding case, of the outputs,
    the last state, the input and parameter gradients, and of the output computed in two calls that carry the
    state. sizes: the layer's head / state / dictionary sizes (its defaults if not given)."""
    from llm_surgery.layers.flash_pdssm import FlashPDSSM
    worst = {}
    for gate, opts in cases or ALL_CASES:
        for masked in (False, True):
            case = f"{gate}{'+drift' if opts else ''}/{'mask' if masked else 'full'}"
            torch.manual_seed(zlib.crc32(case.encode()))   # per case: the same inputs however the cases are split
            ref = FlashPDSSM(width, b_gate=gate, x_init_std=0.1, tau=0.8, backend="torch", **opts, **sizes).to(
                device=device, dtype=dtype)
            fused = copy.deepcopy(ref)
            fused.backend = "kernel"   # the fused op, or an error: never a silent fall-back to the torch path
            x = torch.randn(2, L, width, device=device, dtype=dtype)
            mask = torch.ones(2, L, dtype=torch.long, device=device)
            mask[0, :5] = 0
            mask[1, -3:] = 0
            grad = torch.randn_like(x)
            results = []
            for layer in (ref, fused):
                xx = x.clone().requires_grad_(True)
                y, (_, x_last) = layer(xx, attention_mask=mask if masked else None, return_state=True)
                y.backward(grad)
                with torch.no_grad():  # continuing from a carried state (generation) must equal one pass
                    cut = L // 2
                    y1, state = layer(x[:, :cut], return_state=True)
                    y2, _ = layer(x[:, cut:], state=state, return_state=True)
                results.append({"y": y.detach().float(), "x_last": torch.view_as_real(x_last.detach()),
                                "grad_x": xx.grad.float(), "y_in_two_calls": torch.cat([y1, y2], 1).float(),
                                **{n: p.grad.float() for n, p in layer.named_parameters() if p.grad is not None}})
            assert results[-1].keys() == results[0].keys(), "the paths give gradients to different parameters"
            rel = {k: ((results[1][k] - v).norm() / v.norm().clamp_min(1e-12)).item() for k, v in results[0].items()}
            worst[case] = rel
    return worst


# With unit_snap a magnitude (1 + s) sigmoid(-a) within an ulp of 1 gets the clamp's gradient on one path and none
# on the other (each rounds sigmoid its own way): at width 256 about one entry in 6,000 lies within 1e-6 of 1, and one
# such entry moved decay_bias's gradient by 1.1e-4 of its norm (H200, L=700) and 2.3e-4 (the interpreter, L=160),
# x_proj's by up to 1.9e-5. In drift cases the gradients of what feeds a are held to SNAP_TOL (or the call's own
# bound where looser: bf16): a snap gradient missing its factor 1 + s moves them by 3.0e-3 and 1.7e-4 (the torch
# path, the interpreter's case).
SNAP_TOL = {"decay_bias": 1e-3, "x_proj.weight": 1e-4}


def _assert_close(worst, tol):
    def bound(case, name):
        return max(tol, SNAP_TOL.get(name, tol)) if "+drift" in case else tol
    bad = {case: {name: err for name, err in rel.items() if not err < bound(case, name)} for case, rel in worst.items()}
    bad = {case: errs for case, errs in bad.items() if errs}
    assert not bad, f"fused path deviates from the torch path: {bad}"


@pytest.fixture(params=[True, False], ids=["one-kernel", "separate-kernels"])
def one_kernel(request, monkeypatch):
    """Both forms of the fused op: one kernel per (sequence, head) (forced at every length) and the separate
    kernels (the default for more than one token)."""
    from llm_surgery.ops.pd_select import triton_middle
    monkeypatch.setitem(triton_middle.CONFIG, "min_pairs_per_sm", 0 if request.param else None)
    return request.param


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_path_matches_torch_path_cuda(one_kernel):
    from llm_surgery.layers import flash_pdssm_fused
    assert flash_pdssm_fused.usable(torch.zeros(1, device="cuda")), "CUDA present but the fused path cannot run"
    # a float32 layer runs exact float32 products on both paths (TF32 only for half-precision layers)
    _assert_close(_compare("cuda", torch.float32), 1e-5)
    _assert_close(_compare("cuda", torch.float32, width=256, L=700), 1e-5)
    _assert_close(_compare("cuda", torch.float32, cases=[(None, {}), ("decay", DRIFT[1][1])], num_heads=4,
                           state_size=20, dict_size=5), 1e-5)
    _assert_close(_compare("cuda", torch.float32, cases=[(None, {})], L=300, **LARGE), 1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_path_bf16_cuda(one_kernel, monkeypatch):
    """bf16 layer (as benchmarked): the two paths round at different places (the fused readout is float32, the
    separate kernels' b, x and gradient planes bfloat16 with D float32), so they agree to bf16 precision, not bit for
    bit."""
    from llm_surgery.ops.pd_scan import cuda
    seen = set()
    scan = cuda.pd_scan_fwd_cuda_split

    def spy(P, D_re, D_im, b_re, b_im, *args, **kwargs):
        seen.add((D_re.dtype, b_re.dtype))
        return scan(P, D_re, D_im, b_re, b_im, *args, **kwargs)
    monkeypatch.setattr(cuda, "pd_scan_fwd_cuda_split", spy)
    _assert_close(_compare("cuda", torch.bfloat16, width=128, L=200), 5e-2)
    assert seen == (set() if one_kernel else {(torch.float32, torch.bfloat16)})


# The fused op under Triton's interpreter: the split CUDA scan replaced by the torch scan (computed in float32 from
# whatever planes it gets), the fused path forced on, `_compare` printed as JSON with the planes' dtypes the scan saw
_INTERPRETED = textwrap.dedent("""
        import json, sys, torch
        sys.path.insert(0, {tests!r})
        from llm_surgery.ops.pd_scan import cuda, pd_scan, pd_scan_backward
        from llm_surgery.layers import flash_pdssm_fused

        c = lambda re, im: torch.complex(re.float(), im.float())   # bf16 planes computed in float32, as the kernels do

        seen = set()   # (D's, b's and x's plane dtypes) of each forward scan

        def fwd(P, D_re, D_im, b_re, b_im, x0=None, out=None, last=None):
            seen.add((str(D_re.dtype), str(b_re.dtype), str(out[0].dtype)))
            x = pd_scan(P, c(D_re, D_im), c(b_re, b_im), x0)
            out[0].copy_(x.real)
            out[1].copy_(x.imag)
            if last is not None:
                last[0].copy_(x.real[..., -1, :])
                last[1].copy_(x.imag[..., -1, :])
            return out

        def bwd(P, D_re, D_im, x0, x_re, x_im, g_re, g_im, out=None):
            gD, gb, gx0 = pd_scan_backward(P, c(D_re, D_im), x0, c(x_re, x_im), c(g_re, g_im))
            planes = [v.contiguous() for v in (gD.real, gD.imag, gb.real, gb.imag)]
            if out is not None:
                for o, v in zip(out, planes):
                    o.copy_(v)
            return (*(out or planes), gx0)

        cuda.pd_scan_fwd_cuda_split, cuda.pd_scan_bwd_cuda_split = fwd, bwd
        flash_pdssm_fused.usable = lambda u, triton_only=False: True
        flash_pdssm_fused.one_kernel_pays = lambda *args: {one_kernel!r}
        flash_pdssm_fused._FusedMiddle.SLICE_BYTES = 1   # one sequence per slice: the sliced loops are exercised
        from test_flash_pdssm_fused import _compare
        worst = _compare("cpu", getattr(torch, {dtype!r}), cases={cases!r}, **{sizes!r})
        print(json.dumps({{"worst": worst, "planes": sorted(seen)}}))
    """)


def _run_interpreted(jobs, sizes, dtype="float32"):
    """`_compare` under the interpreter for each job (one kernel or not, cases), all jobs at once, one subprocess
    each (the interpreter keeps one core busy); per job (worst deviations, planes the scan saw)."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    runs = [subprocess.Popen([sys.executable, "-c", _INTERPRETED.format(
                tests=os.path.dirname(__file__), one_kernel=one_kernel, cases=cases, sizes=sizes, dtype=dtype)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for one_kernel, cases in jobs]
    results = []
    try:
        for run, (_, cases) in zip(runs, jobs):
            stdout, stderr = run.communicate(timeout=900)
            assert run.returncode == 0, stderr[-3000:]
            out = json.loads(stdout.strip().splitlines()[-1])
            assert len(out["worst"]) == 2 * len(cases), "a case is missing from a subprocess's results"
            results.append((out["worst"], {tuple(p) for p in out["planes"]}))
    finally:
        for run in runs:
            run.kill()
    return results


def _per_core(one_kernel, cases):
    """Jobs that split `cases` over the CPU cores (two on CI's machine)."""
    n = min(len(cases), os.cpu_count() or 1)
    return [(one_kernel, cases[i::n]) for i in range(n)]


# Jobs (one kernel per (sequence, head) or the separate kernels, cases) and layer sizes. The quick suite (`-m "not
# slow"`) runs one case of each form side by side (~15 s of interpreter a case); the full one the other b-gates and
# drift options, odd sizes (N = 20, K = 5: not powers of two) and heads of 64 x 64 (the separate kernels' large-head
# launches).
QUICK = {True: [("decay", DRIFT[1][1])], False: [("sigmoid", {})]}
ODD = {"num_heads": 4, "state_size": 20, "dict_size": 5}
INTERPRETED = [
    pytest.param([(True, QUICK[True]), (False, QUICK[False])], {}, id="both-forms"),
    *(pytest.param(_per_core(one, [c for c in ALL_CASES if c not in QUICK[one]]), {}, marks=pytest.mark.slow,
                   id=f"{name}-rest") for one, name in ((True, "one-kernel"), (False, "separate-kernels"))),
    pytest.param(_per_core(True, [(None, {}), ("decay", DRIFT[1][1])]), ODD, marks=pytest.mark.slow, id="odd-sizes"),
    pytest.param([(False, [(None, {})])], LARGE, marks=pytest.mark.slow, id="large-heads"),
]


@pytest.mark.parametrize("jobs,sizes", INTERPRETED)
def test_fused_path_matches_torch_path_interpreted(jobs, sizes):
    """Under Triton's interpreter; one_kernel False forces the separate kernels (the path for few sequences).
    A float32 layer keeps float32 planes, so both paths agree to float32 precision."""
    require_interpreter_kernels()
    for (one_kernel, _), (worst, planes) in zip(jobs, _run_interpreted(jobs, sizes)):
        _assert_close(worst, 1e-5)
        assert planes == (set() if one_kernel else {("torch.float32", "torch.float32", "torch.float32")})


@pytest.mark.slow
def test_fused_path_bf16_planes_interpreted():
    """A bf16 layer's separate kernels under the interpreter: b, x and the gradients' planes in bfloat16 with D in
    float32 (pd_scan's mixed form) agree with the torch path to bf16 precision (the CUDA test's bound)."""
    require_interpreter_kernels()
    for worst, planes in _run_interpreted(_per_core(False, [(None, {}), ("decay", {})]), {}, "bfloat16"):
        _assert_close(worst, 5e-2)
        assert planes == {("torch.float32", "torch.bfloat16", "torch.bfloat16")}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_decode_steps_match_fused_forward_cuda():
    """A decode step (one token, no autograd) runs the one-kernel forward at L = 1; token by token from the carried
    state it must give what the torch path gives for the whole sequence at once."""
    from llm_surgery.layers.flash_pdssm import FlashPDSSM
    torch.manual_seed(1)
    layer = FlashPDSSM(128, x_init_std=0.1).cuda()
    x = torch.randn(2, 9, 128, device="cuda")
    with torch.no_grad():
        layer.backend = "torch"
        y_full = layer(x)
        layer.backend = "kernel"
        state, ys = None, []
        for t in range(x.shape[1]):
            y, state = layer.step(x[:, t], state)
            ys.append(y)
    rel = ((torch.stack(ys, 1) - y_full).norm() / y_full.norm()).item()
    assert rel < 1e-5, rel


def test_kernel_backend_refuses_heads_the_fused_op_does_not_serve():
    """Heads over MAX_HEAD_SIZE: backend='kernel' is refused when built, naming the sizes; 'auto' builds."""
    from llm_surgery.layers import flash_pdssm_fused
    from llm_surgery.layers.flash_pdssm import FlashPDSSM
    big = flash_pdssm_fused.MAX_HEAD_SIZE + 32
    with pytest.raises(ValueError, match=f"got {big} and {big}"):
        FlashPDSSM(2 * big, num_heads=2, backend="kernel")
    FlashPDSSM(2 * big, num_heads=2, backend="auto")
    FlashPDSSM(128, num_heads=2, backend="kernel")   # 64 x 64 heads: served


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_heads_over_the_fused_limit_train_on_the_torch_path_cuda():
    """A 4-head layer with N = P = 96 (whose fused readout asked 360 KB of shared memory and failed) runs forward
    and backward under backend='auto' on CUDA, equal to backend='torch'."""
    from llm_surgery.layers.flash_pdssm import FlashPDSSM
    torch.manual_seed(0)
    ref = FlashPDSSM(384, num_heads=4, dict_size=8, backend="torch").cuda()
    auto = copy.deepcopy(ref)
    auto.backend = "auto"
    x = torch.randn(2, 50, 384, device="cuda")
    grads = []
    for layer in (ref, auto):
        xx = x.clone().requires_grad_(True)
        layer(xx).square().sum().backward()
        grads.append(xx.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tau", [0.0, -1.0, float("nan"), float("inf")])
def test_fused_middle_and_pd_select_scan_refuse_the_same_temperatures(tau):
    """One check (`straight_through_tau`) for both entry points: a non-positive or non-finite tau is refused before
    any work, on any device."""
    from llm_surgery.layers.flash_pdssm import FlashPDSSM
    from llm_surgery.layers.flash_pdssm_fused import fused_middle
    from llm_surgery.ops.pd_select import pd_select_scan
    layer = FlashPDSSM(32, num_heads=2)
    H, K, N = layer.num_heads, layer.dict_size, layer.state_size
    u = torch.randn(1, 3, 32)
    with pytest.raises(ValueError, match="fused_middle: tau must be a positive finite number"):
        fused_middle(u, layer.x_proj.weight, layer.decay_bias, layer.dictionary, layer.B,
                     torch.zeros(1, H, N, dtype=torch.complex64), layer.C, layer.D_skip, tau=tau)
    with pytest.raises(ValueError, match="pd_select_scan: tau must be a positive finite number"):
        pd_select_scan(layer.dictionary, torch.randn(1, H, 3, K), torch.ones(1, H, 3, N, dtype=torch.complex64),
                       torch.ones(1, H, 3, N, dtype=torch.complex64), tau=tau)

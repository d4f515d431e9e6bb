"""The CUDA pd_scan kernels against the float64 reference loop (forward and backward). Skips without CUDA."""

import math

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _cuda():
    from llm_surgery.ops.pd_scan import cuda
    if not cuda.available():
        pytest.fail(f"CUDA present but the pd_scan kernels did not build: {cuda.load_error()}")
    return cuda


def _naive(P, D, b, x0):
    from llm_surgery.ops.pd_scan.naive import pd_scan_naive
    return pd_scan_naive(P, D, b, x0)


def _inputs(S, L, N, cplx, pmode="random", seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    step = torch.arange(L, device="cuda")
    # ring32: every entry into the first 32, which rotate; ring32then1: that in the first 64 of each 256 steps
    ring = lambda: (torch.arange(N, device="cuda") + step[:, None]) % 32
    in_ring = step % 256 < 64
    if pmode == "collide":
        P = torch.randint(0, 2, (S, L, N), device="cuda", generator=g)
    elif pmode == "perm":
        P = torch.argsort(torch.rand(S, L, N, device="cuda", generator=g), dim=-1)
    elif pmode == "ring32":   # the support never drops below 32
        P = ring().expand(S, L, N).contiguous()
    elif pmode == "ring32then1":   # a support of 32 for 64 steps, then all into entry 0 (a support of one)
        P = torch.where(in_ring[:, None], ring(), 0).expand(S, L, N).contiguous()
    elif pmode == "chain":   # every entry into the first 32, which stay; at steps 16-46 of each 256, entry j into 0
        j = (step % 256 - 15)[:, None]
        P = torch.arange(N, device="cuda") % 32
        P = torch.where((j >= 1) & (j <= 31) & (P == j), 0, P).expand(S, L, N).contiguous()
    elif pmode.startswith("collapse"):   # collapse<s>: of each 64 steps, permutations until all go into the first
        s = int(pmode[8:])               # 32 entries at step s - 1, then random maps
        perm = torch.argsort(torch.rand(S, L, N, device="cuda", generator=g), dim=-1)
        P = torch.randint(0, N, (S, L, N), device="cuda", generator=g)
        P = torch.where((step % 64 < s - 1)[None, :, None], perm, P)
        P = torch.where((step % 64 == s - 1)[None, :, None], torch.arange(N, device="cuda") % 32, P)
    elif pmode == "mixed":   # 256-step stretches of random maps and of permutations, in turn
        P = torch.randint(0, N, (S, L, N), device="cuda", generator=g)
        perm = torch.argsort(torch.rand(S, L, N, device="cuda", generator=g), dim=-1)
        stretch = (torch.arange(L, device="cuda") // 256 % 2 == 1)[None, :, None]
        P = torch.where(stretch, perm, P)
    else:
        P = torch.randint(0, N, (S, L, N), device="cuda", generator=g)
    mag = 0.3 + 0.65 * torch.rand(S, L, N, device="cuda", generator=g, dtype=torch.float64)
    if pmode == "collide":
        mag = mag / N
    elif pmode == "ring32":
        mag = mag * 32 / N
    elif pmode == "ring32then1":   # unit factors within the ring, so that the entering state keeps its size there
        keep = in_ring[:, None] & (torch.arange(N, device="cuda") < 32)
        mag = torch.where(keep, 1.0, mag * torch.where(in_ring, 32 / N, 1 / N)[:, None]).double()
    elif pmode == "chain":   # unit factors on the 32 kept entries, so that the entering state never fades
        mag = torch.where(torch.arange(N, device="cuda") < 32, 1.0, mag).double()
    elif pmode.startswith("collapse"):   # unit factors until the collapse, so that the entering state stays large
        mag = torch.where((step % 64 < int(pmode[8:]))[:, None], 1.0, mag).double()
    if cplx:
        D = torch.polar(mag, 2 * math.pi * torch.rand(S, L, N, device="cuda", generator=g, dtype=torch.float64))
        b = torch.randn(S, L, N, device="cuda", generator=g, dtype=torch.complex128)
        x0 = torch.randn(S, N, device="cuda", generator=g, dtype=torch.complex128)
        gx = torch.randn(S, L, N, device="cuda", generator=g, dtype=torch.complex128)
    else:
        D = mag * torch.where(torch.rand(S, L, N, device="cuda", generator=g) < 0.5, -1.0, 1.0).double()
        b = torch.randn(S, L, N, device="cuda", generator=g, dtype=torch.float64)
        x0 = torch.randn(S, N, device="cuda", generator=g, dtype=torch.float64)
        gx = torch.randn(S, L, N, device="cuda", generator=g, dtype=torch.float64)
    return P, D, b, x0, gx


def _ref_grads(P, D, b, x0, gx):
    """Autograd through the reference loop (float64): the contract's backward."""
    D, b, x0 = (t.detach().clone().requires_grad_(True) for t in (D, b, x0))
    x = _naive(P, D, b, x0)
    gD, gb, gx0 = torch.autograd.grad(x, (D, b, x0), gx)
    return x.detach(), gD, gb, gx0


def _rel(a, ref):
    a = a.to(ref.dtype)
    assert torch.isfinite(torch.view_as_real(a) if a.is_complex() else a).all(), "non-finite output"
    return ((a - ref).norm() / ref.norm()).item()


def _check_warp_forward(form, P, D, b, x0, chunks, tol):
    """The warp forward in one fp32 calling form (f32, c64, split_f32) at each chunk length against the float64
    loop on the inputs as the kernel sees them (rounded to fp32)."""
    K = _cuda()
    dt = torch.float32 if form == "f32" else torch.complex64
    Dk, bk, x0k = D.to(dt), b.to(dt), x0.to(dt)
    x_ref = _naive(P, Dk.to(D.dtype), bk.to(b.dtype), x0k.to(x0.dtype))
    for chunk in chunks:
        if form == "split_f32":
            xr, xi = K.pd_scan_fwd_cuda_split(P, Dk.real.contiguous(), Dk.imag.contiguous(), bk.real.contiguous(),
                                              bk.imag.contiguous(), x0k, chunk=chunk, algo="warp")
            x = torch.complex(xr, xi)
        else:
            x = K.pd_scan_fwd_cuda(P, Dk, bk, x0k, chunk=chunk, algo="warp")
        assert _rel(x, x_ref) < tol, (form, chunk, _rel(x, x_ref))


@pytest.mark.parametrize("L,N,chunk", [(1, 16, None), (127, 64, None), (129, 128, None), (300, 256, 4),
                                       (513, 32, 1), (200, 600, None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
@pytest.mark.parametrize("algo", ["warp", "block", "auto"])
def test_forward_backward_match_reference(L, N, chunk, dtype, algo):
    if algo == "warp" and N > 256:
        algo = "auto"   # the warp kernel stops at N=256; auto runs the block kernel there
    K = _cuda()
    cplx = dtype.is_complex
    P, D, b, x0, gx = _inputs(2, L, N, cplx, seed=L * N)
    x_ref, gD_ref, gb_ref, gx0_ref = _ref_grads(P, D, b, x0, gx)
    Pk = P.to(torch.int32)
    x = K.pd_scan_fwd_cuda(Pk, D.to(dtype), b.to(dtype), x0.to(dtype), chunk=chunk, algo=algo)
    assert x.dtype == dtype and x.shape == b.shape
    assert _rel(x, x_ref) < 1e-5
    gD, gb, gx0 = K.pd_scan_bwd_cuda(Pk, D.to(dtype), x0.to(dtype), x, gx.to(dtype), chunk=chunk)
    assert _rel(gD, gD_ref) < 1e-5 and _rel(gb, gb_ref) < 1e-5 and _rel(gx0, gx0_ref) < 1e-5


@pytest.mark.parametrize("pmode", ["random", "collide", "perm", "ring32"])
@pytest.mark.parametrize("form", ["f32", "c64", "split_f32"])
def test_warp_repair_matches_reference(pmode, form):
    """Chunks of >= 24 steps: the warp forward repairs collapsed chunks from its log (random, collide) and replays
    the others (perm; ring32 from where its log fills up); either way the outputs match the float64 loop to fp32
    accuracy, up to chunks of 512 steps (the log's cap: a step in 9 bits)."""
    P, D, b, x0, _ = _inputs(2, 1500, 128, form != "f32", pmode=pmode, seed=11)
    _check_warp_forward(form, P, D, b, x0, (None, 24, 64, 256, 512), 1e-6)


@pytest.mark.parametrize("s", [5, 9, 17, 32, 33])
@pytest.mark.parametrize("form", ["f32", "c64", "split_f32"])
def test_warp_repair_from_the_collapse_step(form, s):
    """The log starts at the first step from 5 to 32 at which the chunk's support is down to 32 entries, and the
    replay stops there: chunks of 64 and 128 steps whose maps permute until step s - 1 and then send every entry
    into the first 32 (unit factors until then) collapse at step s exactly, and at 33 are replayed in full. A
    replay and a log that disagree on where one ends double-count or skip the steps between."""
    P, D, b, x0, _ = _inputs(2, 1000, 128, form != "f32", pmode=f"collapse{s}", seed=23 + s)
    _check_warp_forward(form, P, D, b, x0, (64, 128), 1e-6)


@pytest.mark.parametrize("s", [12, 24])
def test_warp_logs_chunks_that_collapse_late(s, monkeypatch):
    """Every chunk that ran phase 1 and whose support is down to 32 entries by step 32 keeps a log (read from
    the kernel's clock64 probes: the repair's start). Random maps at N=256 take ~16 steps, and the 4-6% of chunks
    that took longer while the check stopped at step 16 replayed in full and set the kernel's end."""
    K = _cuda()
    P, D, b, x0, _ = _inputs(32, 1024, 128, True, pmode=f"collapse{s}", seed=5)
    monkeypatch.setitem(K._state, "profile", True)
    K.pd_scan_fwd_cuda(P, D.to(torch.complex64), b.to(torch.complex64), x0.to(torch.complex64), chunk=64, algo="warp")
    torch.cuda.synchronize()
    pr = K._state.pop("last_profile")[0].cpu()
    slow, logged = pr[:, 6] >= 0, pr[:, 8] >= 0   # ran phase 1 and looked back; repaired from a log
    assert slow.sum() >= 32, slow.sum()
    assert logged[slow].all(), f"{int((slow & ~logged).sum())} of {int(slow.sum())} chunks replayed in full"


@pytest.mark.parametrize("N", [32, 128])
@pytest.mark.parametrize("form", ["f32", "c64", "split_f32"])
def test_warp_repair_deep_merge_tree(form, N):
    """Chunks whose 32 support entries merge one a step (steps 16-46 of every 256: entry j into entry 0), with
    unit factors so that the entering state's part never fades: in each chunk that starts a 256-step period (at
    64, 128 and 256 steps alike) the repair's merge tree is a chain 31 levels deep over 63 segments, the most it
    holds; the other chunks keep a support of 32 without merges; one lane per entry at N=32. The outputs match the
    float64 loop to fp32 accuracy."""
    P, D, b, x0, _ = _inputs(2, 1024, N, form != "f32", pmode="chain", seed=19)
    _check_warp_forward(form, P, D, b, x0, (64, 128, 256), 1e-5)


@pytest.mark.parametrize("form", ["f32", "c64", "split_f32"])
def test_warp_repair_log_in_pieces(form):
    """A log longer than the shared memory that stages it (1,600-1,730 entries a chunk against 609-726 a piece):
    chunks of 128 and 256 steps keep a support of 32 entries, with unit factors, for 48 of their logged steps and
    of one after, so the repair stages its log in several pieces, each of them carrying the entering state at full
    size; the outputs match the float64 loop to fp32 accuracy."""
    P, D, b, x0, _ = _inputs(2, 1500, 128, form != "f32", pmode="ring32then1", seed=17)
    _check_warp_forward(form, P, D, b, x0, (128, 256), 1e-5)


@pytest.mark.parametrize("pmode", ["random", "collide", "mixed"])
@pytest.mark.parametrize("form", ["f32", "c64", "split_f32"])
@pytest.mark.parametrize("N", [32, 100, 128, 200])
def test_warp_lookback_links_match_reference(pmode, form, N):
    """Many chunks per sequence (16 to 128 steps): in the complex forms at N = 65-128 (N=100, 128), chunks whose
    aggregate has a small image publish links and a look-back crosses runs of them in image sums (random,
    collide), breaking the run where a chunk has none (mixed: stretches of permutations); float32 and the other
    N apply every aggregate (no links). The outputs match the float64 loop to fp32 accuracy."""
    P, D, b, x0, _ = _inputs(3, 4096, N, form != "f32", pmode=pmode, seed=N + len(pmode))
    _check_warp_forward(form, P, D, b, x0, (16, 32, 128), 1e-5)


@pytest.mark.parametrize("ramp", [None, 0.5])
@pytest.mark.parametrize("form", ["f32", "c64", "split_f32"])
def test_warp_ramped_chunks_match_reference(form, ramp, monkeypatch):
    """One wave of chunks (32 sequences of 2053 steps at the default chunk): the warp forward's chunks grow along
    each sequence (the default ramp, and a steep one whose last chunks are 1.5x the mean), and the outputs still
    match the float64 loop to fp32 accuracy."""
    from llm_surgery.ops.pd_scan import launch_policy as policy
    _cuda()
    P, D, b, x0, _ = _inputs(32, 2053, 128, form != "f32", seed=5)
    if ramp is not None:
        monkeypatch.setattr(policy, "RAMP", ramp)
    _check_warp_forward(form, P, D, b, x0, (None,), 1e-5)
    used = [key for key in policy.CHUNK_TABLES if key[0] == 2053 and key[3] == policy.RAMP]
    assert used, "the launch did not use a ramped chunk table"


def test_warp_ramped_chunks_in_a_cuda_graph():
    """A ramped launch captured in a CUDA graph before any eager call of its shape: the chunk table is built on
    the device inside the capture (no host copy there), equals the host's table, and replays match the float64
    loop, also after new inputs are copied into the captured buffers."""
    from llm_surgery.ops.pd_scan import launch_policy as policy
    K = _cuda()
    L = 2063   # a shape no other test launches, so that its table is not cached yet
    P, D, b, x0, _ = _inputs(32, L, 128, True, seed=9)
    Pk, Dk, bk, x0k = P.to(torch.int32), D.to(torch.complex64), b.to(torch.complex64), x0.to(torch.complex64)
    assert not [key for key in policy.CHUNK_TABLES if key[0] == L]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):   # the first launch builds the kernel, outside the capture
        K.pd_scan_fwd_cuda(*(t[:, :100].contiguous() for t in (Pk, Dk, bk)), x0k, algo="warp")
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        x = K.pd_scan_fwd_cuda(Pk, Dk, bk, x0k, algo="warp")
    assert not [key for key in policy.CHUNK_TABLES if key[0] == L], "the capture cached a table"
    for seed in (9, 10):
        P2, D2, b2, x02, _ = _inputs(32, L, 128, True, seed=seed)
        Pk.copy_(P2.to(torch.int32)); Dk.copy_(D2.to(torch.complex64)); bk.copy_(b2.to(torch.complex64))
        x0k.copy_(x02.to(torch.complex64))
        g.replay()
        torch.cuda.synchronize()
        ref = _naive(P2, Dk.to(D2.dtype), bk.to(b2.dtype), x0k.to(x02.dtype))
        assert _rel(x, ref) < 1e-5, seed
    C = -(-L // 64)
    starts, _ = policy.chunk_starts(L, C, 64, policy.RAMP, Pk.device)   # now eager: cached from the host
    assert torch.equal(starts.cpu(), policy.chunk_starts_on(L, C, 64, policy.RAMP, Pk.device).cpu())


@pytest.mark.parametrize("pmode", ["random", "collide", "perm", "ring32", "chain"])
@pytest.mark.parametrize("form", ["bf16", "split_bf16", "split_mixed"])
def test_warp_repair_bf16_rounds_once(pmode, form):
    """bf16 outputs of repaired chunks (>= 24 steps in one wave, as here; >= 128 over many) are y + c in fp32
    rounded once: every element within one bf16 rounding (2^-8 relative) of the float64 loop, plus fp32 noise,
    where adding c to a rounded y could be off by far more after cancellation. ring32 keeps a support of 32
    entries: its log fills up and the chunk falls back to the full replay. chain merges its 32 support entries one
    a step (a merge tree 31 deep)."""
    K = _cuda()
    cplx = form != "bf16"
    P, D, b, x0, _ = _inputs(2, 1500, 128, cplx, pmode=pmode, seed=13)
    bf = lambda t: t.to(torch.bfloat16).contiguous()
    if cplx:
        Dr, Di, br, bi = (bf(t) for t in (D.real, D.imag, b.real, b.imag))
        if form == "split_mixed":   # float32 D, bfloat16 b and x
            Dr, Di = D.real.float().contiguous(), D.imag.float().contiguous()
        x0k = x0.to(torch.complex64)
        x_ref = _naive(P, torch.complex(Dr.double(), Di.double()), torch.complex(br.double(), bi.double()),
                       x0k.to(torch.complex128))
    else:
        Dk, bk, x0k = bf(D), bf(b), x0.to(torch.float32)
        x_ref = _naive(P, Dk.double(), bk.double(), x0k.double())
    parts = (lambda t: (t.real, t.imag)) if cplx else (lambda t: (t,))
    for chunk in (None, 32, 64, 128, 256, 512):
        if cplx:
            x = K.pd_scan_fwd_cuda_split(P, Dr, Di, br, bi, x0k, chunk=chunk, algo="warp")
        else:
            x = (K.pd_scan_fwd_cuda(P, Dk, bk, x0k, chunk=chunk, algo="warp"),)
        for got, ref in zip(x, parts(x_ref)):
            bound = ref.abs() * 2.0 ** -8 * (1 + 1e-3) + 1e-6 * ref.abs().max()
            worst = ((got.double() - ref).abs() - bound).max().item()
            assert worst <= 0, (chunk, worst)


@pytest.mark.parametrize("pmode", ["random", "collide"])
@pytest.mark.parametrize("algo", ["warp", "block", "auto"])
def test_split_bf16_and_collisions(pmode, algo):
    K = _cuda()
    P, D, b, x0, gx = _inputs(3, 700, 128, True, pmode=pmode, seed=7)
    bf = lambda t: t.to(torch.bfloat16).contiguous()
    Dr, Di, br, bi, gr, gi = (bf(t) for t in (D.real, D.imag, b.real, b.imag, gx.real, gx.imag))
    c = lambda r, i: torch.complex(r.double(), i.double())
    Ds, bs, gs = c(Dr, Di), c(br, bi), c(gr, gi)   # the inputs as the kernel sees them
    x_ref, gD_ref, gb_ref, gx0_ref = _ref_grads(P, Ds, bs, x0, gs)
    xr, xi = K.pd_scan_fwd_cuda_split(P.to(torch.int16), Dr, Di, br, bi, x0.to(torch.complex64), algo=algo)
    assert xr.dtype == torch.bfloat16
    assert _rel(c(xr, xi), x_ref) < 1e-2
    gDr, gDi, gbr, gbi, gx0 = K.pd_scan_bwd_cuda_split(P, Dr, Di, x0.to(torch.complex64), xr, xi, gr, gi)
    # the reference backward uses the exact x, the kernel the bf16-rounded one: both within bf16 rounding
    assert _rel(c(gDr, gDi), gD_ref) < 2e-2 and _rel(c(gbr, gbi), gb_ref) < 1e-2 and _rel(gx0, gx0_ref) < 1e-2


@pytest.mark.parametrize("N,L", [(32, 2048), (64, 700), (128, 333), (20, 1)])
@pytest.mark.parametrize("algo", ["warp", "block", "auto"])
def test_split_mixed_matches_reference(N, L, algo):
    """The mixed form (float32 D; bfloat16 b, x, g, grad_b, grad_D), the half-precision layer's: x within bf16
    rounding of the float64 loop on the inputs as the kernel sees them, the final state (`last=`) in float32 to
    float32 precision, the backward within bf16 rounding, and the same launch in the all-float32 form as a check
    that only the rounding of the planes differs."""
    K = _cuda()
    P, D, b, x0, gx = _inputs(3, L, N, True, seed=N + L)
    bf = lambda t: t.to(torch.bfloat16).contiguous()
    Dr, Di = D.real.float().contiguous(), D.imag.float().contiguous()
    br, bi, gr, gi = (bf(t) for t in (b.real, b.imag, gx.real, gx.imag))
    c = lambda r, i: torch.complex(r.double(), i.double())
    x_ref, gD_ref, gb_ref, gx0_ref = _ref_grads(P, c(Dr, Di), c(br, bi), x0, c(gr, gi))
    x0k = x0.to(torch.complex64)
    last = (torch.empty(3, N, device="cuda"), torch.empty(3, N, device="cuda"))
    xr, xi = K.pd_scan_fwd_cuda_split(P.to(torch.int16), Dr, Di, br, bi, x0k, algo=algo, last=last)
    assert xr.dtype == xi.dtype == torch.bfloat16
    assert _rel(c(xr, xi), x_ref) < 1e-2
    assert _rel(c(*last), x_ref[:, -1]) < 1e-5   # not rounded to bf16
    gDr, gDi, gbr, gbi, gx0 = K.pd_scan_bwd_cuda_split(P, Dr, Di, x0k, xr, xi, gr, gi)
    assert gDr.dtype == gbr.dtype == torch.bfloat16 and gx0.dtype == torch.complex64
    assert _rel(c(gDr, gDi), gD_ref) < 2e-2 and _rel(c(gbr, gbi), gb_ref) < 1e-2 and _rel(gx0, gx0_ref) < 1e-2
    # the float32 form on the same launch: exact to float32, its `last` too (the last chunk's inclusive state, summed
    # in another order than its replay's last step: equal to float32 rounding, not bit for bit)
    f32 = lambda t: t.float().contiguous()
    last32 = (torch.empty(3, N, device="cuda"), torch.empty(3, N, device="cuda"))
    xr32, xi32 = K.pd_scan_fwd_cuda_split(P, Dr, Di, f32(br), f32(bi), x0k, algo=algo, last=last32)
    assert _rel(c(xr32, xi32), x_ref) < 1e-5 and _rel(c(*last32), x_ref[:, -1]) < 1e-5


def test_split_forms_refuse_other_dtype_pairs():
    K = _cuda()
    P, D, b, x0, _ = _inputs(1, 8, 16, True)
    Dr, Di = D.real.to(torch.bfloat16).contiguous(), D.imag.to(torch.bfloat16).contiguous()
    br, bi = b.real.float().contiguous(), b.imag.float().contiguous()
    with pytest.raises(TypeError, match="D float32 with the others bfloat16"):
        K.pd_scan_fwd_cuda_split(P, Dr, Di, br, bi)     # bf16 D with float32 b: no such form
    with pytest.raises(TypeError, match="D_im must have D_re's dtype torch.bfloat16"):
        K.pd_scan_fwd_cuda_split(P, Dr, Di.float(), br, bi)


def test_real_bf16_without_x0_and_leading_dims():
    K = _cuda()
    P, D, b, _, gx = _inputs(4, 257, 64, False, seed=3)
    P, D, b, gx = (t.reshape(2, 2, 257, 64) for t in (P, D, b, gx))
    Db, bb, gb16 = D.to(torch.bfloat16), b.to(torch.bfloat16), gx.to(torch.bfloat16)
    zero = torch.zeros(2, 2, 64, device="cuda", dtype=torch.float64)
    x_ref, gD_ref, gb_ref, _ = _ref_grads(P, Db.double(), bb.double(), zero, gb16.double())
    x = K.pd_scan_fwd_cuda(P, Db, bb)
    assert x.dtype == torch.bfloat16 and x.shape == b.shape
    assert _rel(x, x_ref) < 1e-2
    gD, gb, gx0 = K.pd_scan_bwd_cuda(P, Db, None, x, gb16)
    assert gx0 is None
    assert _rel(gD, gD_ref) < 2e-2 and _rel(gb, gb_ref) < 1e-2


def test_dispatcher_autograd_uses_cuda_path():
    _cuda()
    from llm_surgery.ops.pd_scan import pd_scan
    P, D, b, x0, gx = _inputs(2, 200, 32, True, seed=11)
    x_ref, gD_ref, gb_ref, gx0_ref = _ref_grads(P, D, b, x0, gx)
    Dc, bc, x0c = (t.to(torch.complex64).requires_grad_(True) for t in (D, b, x0))
    x = pd_scan(P, Dc, bc, x0c)
    x.backward(gx.to(torch.complex64))
    assert _rel(x.detach(), x_ref) < 1e-5
    assert _rel(Dc.grad, gD_ref) < 1e-5 and _rel(bc.grad, gb_ref) < 1e-5 and _rel(x0c.grad, gx0_ref) < 1e-5


def test_too_long_chunk_raises_and_cuda_stays_usable(monkeypatch):
    """A chunk whose staged rows overflow shared memory (the backward at N=256, 64 steps: ~420 KB) is refused with
    an error naming it; and where the launcher itself is refused (the Python check bypassed), CUDA's error state is
    reset, so the caller's next CUDA work runs instead of failing on the refusal; the cached launch plan follows the
    shared-memory limit it was made under."""
    K = _cuda()
    P, D, b, _, _ = _inputs(1, 256, 256, True)
    D, b = D.to(torch.complex64), b.to(torch.complex64)
    x = K.pd_scan_fwd_cuda(P, D, b)
    with pytest.raises(ValueError, match="shared memory"):
        K.pd_scan_bwd_cuda(P, D, None, x, b, chunk=64)
    from llm_surgery.ops.pd_scan import launch_policy
    monkeypatch.setattr(launch_policy, "smem_limit", lambda props: 1 << 30)
    with pytest.raises(RuntimeError, match="smem"):
        K.pd_scan_bwd_cuda(P, D, None, x, b, chunk=64)
    y = (x * 2).sum()   # a torch kernel launch and a sync: no stale error from the refused launch
    torch.cuda.synchronize()
    assert torch.isfinite(torch.view_as_real(y)).all()
    monkeypatch.undo()   # the launch plan made under the patched limit does not outlive it
    with pytest.raises(ValueError, match="shared memory"):
        K.pd_scan_bwd_cuda(P, D, None, x, b, chunk=64)


def test_bad_inputs_raise_clear_errors():
    K = _cuda()
    P, D, b, _, _ = _inputs(1, 8, 16, False)
    with pytest.raises(TypeError, match="float32, bfloat16"):
        K.pd_scan_fwd_cuda(P, D, b)          # float64 is not a kernel dtype
    with pytest.raises(ValueError, match="shape"):
        K.pd_scan_fwd_cuda(P, D.float()[:, :4], b.float())
    with pytest.raises(ValueError, match=r"\[0, N=16\)"):
        K.pd_scan_fwd_cuda(P + 16, D.float(), b.float(), validate=True)
    with pytest.raises(ValueError, match="algo must be one of"):
        K.pd_scan_fwd_cuda(P, D.float(), b.float(), algo="fast")
    P600, D600, b600, _, _ = _inputs(1, 8, 600, False)
    with pytest.raises(ValueError, match="N <= 256"):
        K.pd_scan_fwd_cuda(P600, D600.float(), b600.float(), algo="warp")
    with pytest.raises(ValueError, match="CUDA tensor"):
        K.pd_scan_fwd_cuda(P.cpu(), D.float(), b.float())


def test_pd_scan_refuses_out_of_range_p_on_cuda():
    """On the GPU as on the CPU, pd_scan and pd_scan_backward refuse P outside [0, N) before the int16 cast (the
    kernels used to clamp such values silently, and int64 2**16 + 1 wrapped to the valid index 1); the CUDA entry
    points' validate=True does the same, and without it a wide value is never narrowed into range."""
    K = _cuda()
    from llm_surgery.ops.pd_scan import pd_scan, pd_scan_backward
    P, D, b, x0, _ = _inputs(2, 40, 16, True, seed=21)
    D, b, x0 = (t.to(torch.complex64) for t in (D, b, x0))
    for bad in (16, -1, 2 ** 15, 2 ** 16 + 1):
        Pb = P.clone()
        Pb[1, 7, 3] = bad
        with pytest.raises(ValueError, match=r"\[0, N=16\)"):
            pd_scan(Pb, D, b, x0)
        with pytest.raises(ValueError, match=r"\[0, N=16\)"):
            pd_scan_backward(Pb, D, x0, b, b)
        with pytest.raises(ValueError, match=r"\[0, N=16\)"):
            K.pd_scan_fwd_cuda(Pb, D, b, x0, validate=True)
        assert not 0 <= int(K._idx(Pb, 16, False)[1, 7, 3]) < 16, bad
    ref = _naive(P, D.to(torch.complex128), b.to(torch.complex128), x0.to(torch.complex128))
    assert _rel(pd_scan(P, D, b, x0), ref) < 1e-5


def test_pd_scan_without_the_range_check_has_no_host_sync():
    """check_values=False (the layers' argmax paths) keeps pd_scan free of host syncs: it is captured in a CUDA
    graph (where a sync is refused) and replays the eager result."""
    _cuda()
    from llm_surgery.ops.pd_scan import pd_scan
    P, D, b, x0, _ = _inputs(4, 300, 32, True, seed=22)
    Pk, Dk, bk, x0k = P.to(torch.int16), D.to(torch.complex64), b.to(torch.complex64), x0.to(torch.complex64)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):   # outside the capture: the kernel build and this shape's chunk table
        eager = pd_scan(Pk, Dk, bk, x0k)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        x = pd_scan(Pk, Dk, bk, x0k, check_values=False)
    g.replay()
    torch.cuda.synchronize()
    assert _rel(x, eager.to(torch.complex128)) < 1e-6

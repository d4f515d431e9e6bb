"""pd_scan against the plain loop and the dense definition: values, gradients, errors."""

import itertools

import pytest
import torch

from llm_surgery.ops.pd_scan import pd_scan, pd_scan_dense, pd_scan_naive

DTYPES = [torch.float64, torch.complex128]


def _inputs(shape, dtype, gen, collisions=True):
    *lead, L, N = shape
    if collisions:  # random maps: many entries flow into one, some into none
        P = torch.randint(0, N, shape, generator=gen)
    else:
        P = torch.stack([torch.randperm(N, generator=gen) for _ in range(torch.Size(shape[:-1]).numel())]).view(shape)
    D = torch.randn(shape, dtype=dtype, generator=gen) * 0.8
    b = torch.randn(shape, dtype=dtype, generator=gen)
    x0 = torch.randn(*lead, N, dtype=dtype, generator=gen)
    return P, D, b, x0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L", [1, 2, 5, 63, 64, 65, 200, 513])
def test_matches_loop(dtype, L):
    gen = torch.Generator().manual_seed(L)
    P, D, b, x0 = _inputs((2, 3, L, 7), dtype, gen)
    ref = pd_scan_naive(P, D, b, x0)
    for chunk in (None, 1, 4, 64):
        assert torch.allclose(pd_scan(P, D, b, x0, chunk_size=chunk), ref, rtol=1e-10, atol=1e-10)
    assert torch.allclose(pd_scan(P, D, b), pd_scan_naive(P, D, b), rtol=1e-10, atol=1e-10)


def test_loop_is_the_column_one_hot_definition():
    gen = torch.Generator().manual_seed(0)
    P, D, b, x0 = _inputs((4, 9, 5), torch.complex128, gen)
    assert torch.allclose(pd_scan_naive(P, D, b, x0), pd_scan_dense(P, D, b, x0), atol=1e-12)


def test_collisions_are_summed_not_gathered():
    # every entry flows into entry 0: x_1[0] = b[0] + sum_m D[m] x0[m]
    P = torch.zeros(1, 4, dtype=torch.int16)
    D = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=torch.float64)
    b = torch.zeros(1, 4, dtype=torch.float64)
    x0 = torch.ones(4, dtype=torch.float64)
    x = pd_scan(P, D, b, x0)
    assert x.tolist() == [[10.0, 0.0, 0.0, 0.0]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L", [1, 3, 70, 257])
def test_gradients_match_autograd_of_loop(dtype, L):
    gen = torch.Generator().manual_seed(100 + L)
    P, D, b, x0 = _inputs((2, L, 6), dtype, gen)
    g = torch.randn(2, L, 6, dtype=dtype, generator=gen)
    leaves = [t.clone().requires_grad_() for t in (D, b, x0)]
    ref = torch.autograd.grad((pd_scan_naive(P, *leaves[:2], leaves[2]) * g.conj()).real.sum(), leaves)
    leaves = [t.clone().requires_grad_() for t in (D, b, x0)]
    got = torch.autograd.grad((pd_scan(P, *leaves[:2], leaves[2], chunk_size=16) * g.conj()).real.sum(), leaves)
    for r, o in zip(ref, got):
        assert torch.allclose(r, o, rtol=1e-9, atol=1e-10)


def test_gradcheck_small():
    gen = torch.Generator().manual_seed(3)
    P, D, b, x0 = _inputs((2, 11, 4), torch.complex128, gen)
    assert torch.autograd.gradcheck(lambda d, bb, x: pd_scan(P, d, bb, x, chunk_size=4),
                                    (D.requires_grad_(), b.requires_grad_(), x0.requires_grad_()))


@pytest.mark.parametrize("pdtype", [torch.int16, torch.int32, torch.int64])
def test_index_dtypes_and_half_inputs(pdtype):
    gen = torch.Generator().manual_seed(5)
    P, D, b, x0 = _inputs((3, 40, 8), torch.float32, gen)
    ref = pd_scan_naive(P, D.double(), b.double(), x0.double())
    out = pd_scan(P.to(pdtype), D.bfloat16(), b.bfloat16(), x0.bfloat16())
    assert out.dtype == torch.bfloat16
    assert (out.double() - ref).abs().max() < 0.1 * ref.abs().max()


def test_permutations_preserve_norm():
    gen = torch.Generator().manual_seed(9)
    P, _, _, x0 = _inputs((2, 300, 16), torch.complex128, gen, collisions=False)
    phase = torch.polar(torch.ones(2, 300, 16, dtype=torch.float64), torch.rand(2, 300, 16, generator=gen, dtype=torch.float64) * 6.3)
    x = pd_scan(P, phase, torch.zeros_like(phase), x0)
    assert torch.allclose(x[:, -1].abs().pow(2).sum(-1), x0.abs().pow(2).sum(-1), rtol=1e-10)


def test_errors_name_the_problem():
    P = torch.zeros(2, 5, 4, dtype=torch.long)
    D = torch.ones(2, 5, 4)
    with pytest.raises(TypeError, match="integer"):
        pd_scan(P.float(), D, D)
    with pytest.raises(TypeError, match="same dtype"):
        pd_scan(P, D, D.double())
    with pytest.raises(ValueError, match="share one shape"):
        pd_scan(P[:, :4], D, D)
    with pytest.raises(ValueError, match="x0 must have shape"):
        pd_scan(P, D, D, torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r"\[0, N=4\)"):
        pd_scan(P + 4, D, D)
    with pytest.raises(TypeError, match="real floating or complex"):
        pd_scan(P, P, P)


def test_bad_x0_n_and_chunk_size_are_clear_errors():
    """x0 not a tensor or on another device, an empty state (N = 0) and a chunk size that is not a positive int are
    refused up front with the problem named (they used to fail deep inside the scan, or silently pick the default)."""
    from llm_surgery.ops.pd_scan import pd_scan_backward
    P = torch.zeros(2, 5, 4, dtype=torch.long)
    D = torch.ones(2, 5, 4)
    with pytest.raises(TypeError, match="x0 must be a torch.Tensor or None, got list"):
        pd_scan(P, D, D, [[0.0] * 4] * 2)
    with pytest.raises(ValueError, match="x0 is on meta"):
        pd_scan(P, D, D, torch.zeros(2, 4, device="meta"))
    with pytest.raises(ValueError, match=r"state size N .* must be >= 1"):
        pd_scan(P[..., :0], D[..., :0], D[..., :0])
    for bad in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="chunk_size must be a positive int"):
            pd_scan(P, D, D, chunk_size=bad)
        with pytest.raises(ValueError, match="chunk_size must be a positive int"):
            pd_scan_backward(P, D, None, D, D, chunk_size=bad)


def test_p_range_is_checked_unless_the_caller_vouches_for_it():
    """pd_scan and pd_scan_backward refuse P outside [0, N) (a wide value included: 2**16 + 1 would be 1 after
    an int16 cast); check_values=False skips the check (and its host sync) and gives the same result in range."""
    from llm_surgery.ops.pd_scan import pd_scan_backward
    gen = torch.Generator().manual_seed(4)
    P, D, b, x0 = _inputs((2, 9, 4), torch.float64, gen)
    for bad in (4, -1, 2 ** 15, 2 ** 16 + 1):
        Pb = P.clone()
        Pb[1, 3, 2] = bad
        with pytest.raises(ValueError, match=rf"\[0, N=4\), got range \[{min(bad, 0)}, {max(bad, 3)}\]"):
            pd_scan(Pb, D, b, x0)
        with pytest.raises(ValueError, match=r"\[0, N=4\)"):
            pd_scan_backward(Pb, D, x0, b, b)
    assert torch.equal(pd_scan(P, D, b, x0, check_values=False), pd_scan(P, D, b, x0))
    ref = pd_scan_backward(P, D, x0, b, b)
    for r, o in zip(ref, pd_scan_backward(P, D, x0, b, b, check_values=False)):
        assert torch.equal(r, o)


def test_cuda_index_narrowing_never_wraps_without_a_gpu():
    """The CUDA entry points narrow P to int16. Values outside [0, N) must stay outside (the kernels then keep them
    inside the state, and pd_scan has refused them before): a plain cast wraps 2**16 + 3 to 3 and 2**15 to -2**15,
    and 2**16 + 3 would scan as a valid index. validate=True refuses them before the cast."""
    from llm_surgery.ops.pd_scan import cuda
    P = torch.tensor([[0, 2 ** 16 + 3, 2 ** 15, -1, -70000, 3, 2 ** 40]])
    for wide in (P, P.clamp(max=2 ** 31 - 1).to(torch.int32)):
        narrowed = cuda._idx(wide, 4, False)
        assert narrowed.dtype == torch.int16
        inside = (narrowed >= 0) & (narrowed < 4)
        assert inside.tolist() == [[True, False, False, False, False, True, False]], wide.dtype
        assert narrowed[0, 0] == 0 and narrowed[0, 5] == 3
    with pytest.raises(ValueError, match=r"pd_scan CUDA: P values must lie in \[0, N=4\)"):
        cuda._idx(P, 4, True)
    assert torch.equal(cuda._idx(P[:, [0, 5]], 4, True), torch.tensor([[0, 3]], dtype=torch.int16))


def test_cuda_forward_kernel_policy_without_a_gpu():
    """The size policy that picks the CUDA forward kernel (pure Python: checked here, timed in BENCHMARKS)."""
    from llm_surgery.ops.pd_scan import launch_policy as policy
    for N in (1, 16, 32, 48, 64, 128, 256):   # the warp kernel up to N=256, at any size and dtype
        assert policy.algo_code("auto", N, False) == 2
    assert policy.algo_code("auto", 257, False) == 1    # the block kernel above
    assert policy.algo_code("auto", 1024, False) == 1
    assert policy.algo_code("block", 32, False) == 1
    assert policy.algo_code("block", 1000, False) == 1    # the block kernel takes any N <= 1024
    assert policy.algo_code("warp", 300, True) == 2      # the backward has one kernel: the code is not used
    with pytest.raises(ValueError, match="N <= 256"):
        policy.algo_code("warp", 300, False)
    with pytest.raises(ValueError, match="algo must be one of"):
        policy.algo_code("fastest", 30, False)


def test_cuda_repair_log_capacity_without_a_gpu():
    """The warp forward's repair log: T N / 8 entries per chunk for chunks of 24..512 steps (bf16 over many
    waves: 128..512), else none."""
    from llm_surgery.ops.pd_scan import launch_policy as policy

    warp, block = policy.ALGOS["warp"], policy.ALGOS["block"]
    assert policy.repair_capacity(warp, False, False, 128, 128) == 2048
    assert policy.repair_capacity(warp, False, False, 24, 16) == 48
    assert policy.repair_capacity(warp, False, False, 16, 128) == 0     # too short: replayed in full
    assert policy.repair_capacity(warp, False, False, 512, 128) == 8192  # steps 0..511: 9 bits of a log word
    assert policy.repair_capacity(warp, False, False, 513, 128) == 0    # past the kernel's step field
    assert policy.repair_capacity(warp, False, True, 256, 128) == 4096  # bfloat16 outputs: long chunks only
    assert policy.repair_capacity(warp, False, True, 64, 128) == 0      # over many waves
    assert policy.repair_capacity(warp, False, True, 64, 128, one_wave=True) == 1024   # in one wave: from 24 steps
    assert policy.repair_capacity(warp, False, True, 16, 128, one_wave=True) == 0
    assert policy.repair_capacity(block, False, False, 128, 128) == 0   # the block kernel has no repair
    assert policy.repair_capacity(warp, True, False, 128, 128) == 0     # nor has the backward
    # the mixed form (float32 D, bfloat16 b and x) replays float32 D rows: float32's rule, from 24 steps
    assert policy.repair_capacity(warp, False, policy.MIXED, 64, 128) == 1024
    assert policy.repair_capacity(warp, False, policy.MIXED, 16, 128) == 0


def test_cuda_repair_bounds_match_the_kernel_source():
    """The launch policy's step bounds for logged chunks mirror the kernel's REPAIR_MIN_T and REPAIR_MAX_T (read
    from kernels/pd_fwd_warp.cu, no GPU): a drift would size logs for chunks the kernel replays in full, or the
    reverse."""
    import re
    from llm_surgery.ops.pd_scan import cuda, launch_policy as policy
    src = (cuda._source_dir() / "pd_fwd_warp.cu").read_text()
    const = {k: int(v) for k, v in re.findall(r"constexpr int (REPAIR_\w+) = (\d+);", src)}
    assert set(const) == {"REPAIR_EARLIEST", "REPAIR_LATEST", "REPAIR_MIN_T", "REPAIR_MAX_T"}
    assert 1 <= const["REPAIR_EARLIEST"] <= const["REPAIR_LATEST"] < 2 ** 8   # kc keeps 8 bits
    # the kernel's own checks: the collapse check at steps REPAIR_EARLIEST .. REPAIR_LATEST (and 8 before the
    # chunk's end) of chunks of REPAIR_MIN_T steps or more, the log only up to REPAIR_MAX_T
    assert "k >= REPAIR_EARLIEST - 1 && k < REPAIR_LATEST && k + 8 < Tc && Tc >= REPAIR_MIN_T" in src
    assert "a.rcap > 0 && Tc <= REPAIR_MAX_T" in src
    assert policy.REPAIR_MIN_T == const["REPAIR_MIN_T"]
    assert policy.REPAIR_MAX_T == const["REPAIR_MAX_T"]


def test_cuda_link_record_size_matches_the_kernel_source():
    """The launch policy sizes the warp forward's link records as the kernel's link_words does (read from
    kernels/pd_fwd_warp.cu, no GPU): a smaller buffer would let chunks write over each other's records."""
    import re
    from llm_surgery.ops.pd_scan import cuda, launch_policy as policy
    src = (cuda._source_dir() / "pd_fwd_warp.cu").read_text()
    m = re.search(r"constexpr int link_words\(int asize\) \{ return (\d+) \+ (\d+) \* asize / 4; \}", src)
    assert m, "link_words not found in kernels/pd_fwd_warp.cu"
    head, per = int(m.group(1)), int(m.group(2))
    for comps in (1, 2):   # real fp32 (4-byte values), complex (8-byte values)
        assert policy.link_words(comps) == head + per * (4 * comps) // 4


def test_cuda_probe_count_matches_the_kernel_source():
    """cuda.py allocates the forward's clock64 probes as the kernel's PROBES strides them (no GPU): fewer columns
    would let a chunk's probes land in the next chunk's row, or past the buffer."""
    import re
    from llm_surgery.ops.pd_scan import cuda, launch_policy as policy
    src = (cuda._source_dir() / "pd_scan_common.cuh").read_text()
    m = re.search(r"constexpr int PROBES = (\d+);", src)
    assert m, "PROBES not found in kernels/pd_scan_common.cuh"
    assert policy.PROBES == int(m.group(1))
    every = "".join((cuda._source_dir() / f).read_text() for f in cuda._SOURCES + cuda._HEADERS)
    used = {int(i) for i in re.findall(r"prof\[(\d+)\] =", every)}
    assert used and max(used) < policy.PROBES


def test_cuda_layouts_kernel_choice_and_limits_match_the_kernel_source():
    """Every other number the Python side mirrors from the kernels (read from kernels/, no GPU): the data layouts
    it passes as `layout`, the forward-kernel codes (chosen in Python only; the C++ takes the code as given and
    refuses others), the warp kernel's state-size limit, and N <= MAX_N (one thread per entry in the block
    kernels, int16 indices)."""
    import re
    from llm_surgery.ops.pd_scan import cuda, launch_policy as policy
    read = lambda f: (cuda._source_dir() / f).read_text()
    launcher = read("pd_scan_launch.cu")
    m = re.search(r"enum Layout \{ REAL = (\d+), SPLIT = (\d+), CPLX = (\d+) \};", read("pd_scan_common.cuh"))
    assert m, "enum Layout not found in kernels/pd_scan_common.cuh"
    assert (policy.REAL, policy.SPLIT, policy.CPLX) == tuple(int(v) for v in m.groups())
    const = {k: int(v) for k, v in re.findall(r"constexpr int (ALGO_\w+|WARP_MAX_N) = (\d+);", launcher)}
    assert policy.ALGOS == {"block": const["ALGO_BLOCK"], "warp": const["ALGO_WARP"]}
    assert policy.WARP_MAX_N == const["WARP_MAX_N"]
    assert "fwd_algo" not in launcher   # no second choice of the forward kernel in C++
    assert "const int algo = bwd ? ALGO_BLOCK : a.algo;" in launcher
    assert policy.algo_code("auto", policy.WARP_MAX_N, False) == const["ALGO_WARP"]
    assert policy.algo_code("auto", policy.WARP_MAX_N + 1, False) == const["ALGO_BLOCK"]
    # the plane-type forms the Python side passes as `form`: float32, bfloat16, mixed (split layout only)
    pairs = re.findall(r"\(layout\) == (REAL|SPLIT|CPLX) && \(form\) == (\d)\s*\? F<\w+, (\w+)>", launcher)
    assert {(lay, int(code), t) for lay, code, t in pairs} == {
        ("REAL", policy.FLOAT32, "float"), ("REAL", policy.BF16, "__nv_bfloat16"), ("SPLIT", policy.FLOAT32, "float"),
        ("SPLIT", policy.BF16, "__nv_bfloat16"), ("SPLIT", policy.MIXED, "Mixed")}, pairs
    assert "X(SPLIT, Mixed)" in read("pd_scan_kernels.cuh")
    assert "__launch_bounds__(1024) pd_bwd_kernel" in read("pd_bwd.cu") and cuda.MAX_N == 1024
    assert "using Idx = int16_t;" in read("pd_scan.cuh") and cuda.MAX_N < 2 ** 15


def test_cuda_chunk_tables_without_a_gpu():
    """The warp forward's chunk tables (pure Python): equal chunks of T steps with a shorter last one, or a ramp
    whose chunks grow along the sequence; either way they tile [0, L) with no empty chunk, and the default ramp's
    longest chunk at the one-wave shapes stays within the repair's REPAIR_MAX_T."""
    from llm_surgery.ops.pd_scan import launch_policy as policy
    flat = policy.chunk_starts_on(1000, 4, 256, 0.0, "cpu")
    assert flat.tolist() == [0, 256, 512, 768, 1000]
    for L, C, T in [(16384, 64, 256), (16383, 64, 256), (8192, 64, 128), (2053, 33, 64), (100, 4, 32)]:
        for r in (policy.RAMP, 0.5):
            s = policy.chunk_starts_on(L, C, T, r, "cpu")
            n = s[1:] - s[:-1]
            assert s[0] == 0 and s[-1] == L and len(s) == C + 1
            assert (n > 0).all() and (n[1:] >= n[:-1] - 1).all(), (L, C, r)   # growing (up to rounding)
            assert n[-1] > n[0]
        starts, longest = policy.chunk_starts(L, C, T, policy.RAMP, "cpu")
        assert torch.equal(starts, policy.chunk_starts_on(L, C, T, policy.RAMP, "cpu"))
        assert longest == int((starts[1:] - starts[:-1]).max())
        if T == 256:
            assert longest <= policy.REPAIR_MAX_T


def test_cuda_chunk_ramp_policy_without_a_gpu():
    """Which warp-forward launches get growing chunks (pure Python): default chunks of >= 32 steps that fit one
    wave (and so have a repair log); not a caller's chunk, two waves, short chunks, one chunk, or chunks whose
    ramped length could pass the repair log's cap."""
    from llm_surgery.ops.pd_scan import launch_policy as policy
    r, slots = policy.RAMP, 132 * 16
    ramp = lambda chunk, S, C, T: policy.chunk_ramp(chunk, C, T, S * C <= slots)
    assert ramp(None, 32, 64, 256) == r     # B=32, L=16384
    assert ramp(None, 32, 32, 64) == r      # B=32, L=2048
    assert ramp(256, 32, 64, 256) == 0.0    # the caller's chunk
    assert ramp(None, 64, 64, 256) == 0.0   # two waves
    assert ramp(None, 32, 32, 16) == 0.0    # short chunks
    assert ramp(None, 1, 1, 256) == 0.0     # one chunk
    assert ramp(None, 192, 11, 373) == r    # B=192, L=4096: 1.1 x 373 steps keep a log
    assert ramp(None, 64, 33, 497) == 0.0   # B=64, L=16384: 1.1 x 497 would not


def test_cuda_default_chunk_without_a_gpu():
    """Chunk lengths the CUDA path picks (pure Python; the shared-memory sizes come from a stand-in)."""
    from llm_surgery.ops.pd_scan import launch_policy as policy

    class Ext:   # shared memory of the block kernels: `per` bytes per entry-step
        def __init__(self, per=20):
            self.per = per

        def smem_bytes(self, kind, bf16, N, T, bwd, algo):
            return self.per * N * T

        def warp_blocks_per_sm(self, kind, bf16, N):
            return 14

    warp, block = policy.ALGOS["warp"], policy.ALGOS["block"]

    def chunk(S, L, N, algo, bwd=False, per=20, smem_limit=227 * 1024):
        return policy.default_chunk(Ext(per), 2, False, bwd, S, L, N, 132, algo, smem_limit)

    assert chunk(32, 2048, 128, warp) == 64 and chunk(8, 16384, 128, warp) == 128   # ~L/32 in [8, 128]
    assert chunk(32, 100, 128, warp) == 8 and chunk(32, 256, 128, warp) == 16   # >= 3.5 warps an SM
    assert chunk(32, 512, 128, warp) == 32 and chunk(16, 512, 128, warp) == 16  # 32 steps where that leaves them
    assert chunk(1, 8192, 128, warp) == 64 and chunk(4, 4096, 128, warp) == 64   # few warps: down to 64 steps
    assert chunk(1, 16384, 128, warp) == 128 and chunk(2, 16384, 128, warp) == 128   # ... not past 128 a sequence
    assert chunk(1, 32768, 128, warp) == 128 and chunk(1, 65536, 128, warp) == 256   # and up to 256 a sequence
    # 32 x 64 chunks of 128 steps overflow 132 x 14 resident warps; 32 x 32 of 256 steps fit one wave
    assert chunk(32, 8192, 128, warp) == 256 and chunk(16, 8192, 128, warp) == 128
    assert chunk(256, 1024, 32, warp) == 256 and chunk(512, 512, 32, warp) == 256   # many sequences: one wave
    # no chunk of <= 256 steps makes one wave: the fewest whole waves of chunks of <= 512 steps (the repair log's
    # cap), spread evenly: 32 x 57 chunks of 288 steps in one wave of 132 x 14; 192 x 38 chunks of 432 in four
    assert chunk(32, 16384, 128, warp) == 288 and chunk(192, 16384, 128, warp) == 432
    assert chunk(8192, 300, 64, warp) == 300         # a sequence a warp slot or more: one chunk each where it fits
    assert chunk(4096, 4096, 32, warp) == 128        # ... and where it does not, ~L/32
    assert policy.default_chunk(Ext(), 2, True, False, 512, 4096, 32, 132, warp) == 128   # bf16 at N <= 32: ~L/32
    assert chunk(512, 4096, 32, block) == 16         # block kernel: 16 when it fits 64 KB
    assert chunk(512, 4096, 1024, block) == 4        # halved towards 64 KB, but not below 4 ...
    assert chunk(512, 4096, 1024, block, per=60) == 2    # ... unless over 200 KB
    assert chunk(32, 16384, 128, warp, bwd=True) == 16   # the backward has one (block) kernel
    # the backward at N <= 64: up to 2048 / N steps (<= 64) for few sequences, and for real bf16 at any count,
    # while >= 4 chunks an SM remain
    assert chunk(8, 16384, 32, block, bwd=True) == 64 and chunk(4, 16384, 64, block, bwd=True) == 32
    assert chunk(32, 16384, 32, block, bwd=True) == 16 and chunk(16, 16384, 128, block, bwd=True) == 16
    assert policy.default_chunk(Ext(), 0, True, True, 512, 2048, 32, 132, block) == 64
    # ... and at N = 65-128 32 steps for up to 8 sequences and for real bf16, where it fits the device
    assert chunk(8, 16384, 128, block, bwd=True) == 32 and chunk(4, 16384, 100, block, bwd=True) == 32
    assert chunk(8, 16384, 128, block, bwd=True, smem_limit=64 * 1024) == 16   # 20 x 128 x 32 bytes do not fit
    assert chunk(8, 16384, 32, block, bwd=True, smem_limit=32 * 1024) == 32    # 20 x 32 x 32 do, x 64 do not
    assert chunk(256, 2048, 128, block, bwd=True) == 16 and chunk(8, 16384, 256, block, bwd=True) == 8   # as before
    assert policy.default_chunk(Ext(), 0, True, True, 512, 2048, 128, 132, block) == 32
    assert policy.default_chunk(Ext(), 1, True, True, 512, 2048, 128, 132, block) == 16   # split bf16: not at 512
    assert chunk(1, 128, 32, block, bwd=True) == 4        # a small launch keeps its 4-step chunks
    assert chunk(32, 128, 128, block) == 4           # and until there are >= 4 blocks per SM


def test_launch_policy_stays_inside_the_kernels_limits():
    """Whatever chunk the rules pick, over 5 forms x fwd/bwd x 7 state sizes x 5 sequence counts x 4 lengths, each
    launch is one the kernels take, composed as cuda.py's launch composes it (no GPU: the extension's sizes come from
    a stand-in): the warp forward up to WARP_MAX_N only; staged blocks of a power-of-two chunk that fit shared
    memory, over 16 steps only in the backward's look-back rule and while >= 4 blocks an SM remain; warp chunks of
    8-512 steps, one wave exactly when all chunks fit the warp slots, a chunk table that covers the sequence in
    order, a ramp only in one wave and only where every chunk keeps a repair log, and a log only for chunks it
    serves (<= REPAIR_MAX_T steps)."""
    from llm_surgery.ops.pd_scan import launch_policy as policy

    class Ext:   # staged kernels' shared memory grows with N T; the warp forward holds half as many warps past N=128
        def smem_bytes(self, layout, bf16, N, T, bwd, algo):
            return (3 if bwd else 2) * (2 if bf16 else 4) * (1 if layout == 0 else 2) * N * T + 2 * N * T + 4096

        def warp_blocks_per_sm(self, layout, bf16, N):
            return 16 if N <= 128 else 8

    ext, sms, smem = Ext(), 132, 227 * 1024
    forms = [(policy.REAL, False), (policy.REAL, True), (policy.SPLIT, False), (policy.SPLIT, True),
             (policy.CPLX, False)]
    for (layout, bf16), bwd, N, S, L in itertools.product(forms, (False, True), (16, 32, 64, 100, 128, 256, 1024),
                                                          (1, 8, 32, 192, 2048), (100, 2048, 16384, 65536)):
        shape = dict(layout=layout, bf16=bf16, bwd=bwd, N=N, S=S, L=L)
        code = policy.algo_code("auto", N, bwd)
        assert code == policy.ALGOS["warp" if N <= policy.WARP_MAX_N else "block"], shape
        T = policy.default_chunk(ext, layout, bf16, bwd, S, L, N, sms, code, smem)
        C = -(-L // T)
        if bwd or code == policy.ALGOS["block"]:
            assert T & (T - 1) == 0 and ext.smem_bytes(layout, bf16, N, T, bwd, code) <= smem, (shape, T)
            assert T <= 16 or (bwd and N <= 128 and T <= 64 and S * C >= 4 * sms), (shape, T)
            assert policy.repair_capacity(code, bwd, bf16, T, N) == 0, shape
            continue
        assert 8 <= T <= policy.REPAIR_MAX_T, (shape, T)
        one_wave = S * C <= policy.warp_slots(ext, layout, bf16, N, sms)
        ramp = policy.chunk_ramp(None, C, T, one_wave)
        starts, longest = policy.chunk_starts(L, C, T, ramp, "cpu")
        lengths = (starts[1:] - starts[:-1]).tolist()
        assert starts[0] == 0 and starts[-1] == L and min(lengths) > 0 and max(lengths) == longest, (shape, T)
        rcap = policy.repair_capacity(code, bwd, bf16, longest, N, one_wave)
        assert not ramp or (one_wave and rcap > 0), (shape, T, ramp, rcap)
        assert not rcap or longest <= policy.REPAIR_MAX_T, (shape, T, longest)


def test_cuda_build_hash_covers_every_kernel_source():
    """Every CUDA/C++ file in kernels/ is hashed into the build cache key and found by the loader, so editing
    any of them rebuilds the extension instead of loading a stale one (no GPU needed)."""
    from llm_surgery.ops.pd_scan import cuda
    on_disk = {f.name for f in cuda._source_dir().iterdir() if f.suffix in (".cu", ".cuh", ".cpp")}
    assert on_disk == set(cuda._SOURCES + cuda._HEADERS)

"""Build, check and time the pd_scan CUDA kernels in one go (one device call).

    PYTHONPATH=. python bench/pd_scan_bench.py [--quick] [--out DIR]

Sections: environment; build time; correctness against a float64 loop (fresh random inputs, poisoned outputs,
L in {1,127,128,129,4096,16384}, N in {16,64,128,256}, collision-heavy P, small chunks to stress the look-back);
D2D copy bandwidth, and a copy of each forward size (the small-size ceiling); forward/backward times and achieved
must-move bandwidth at B=32, N=128; chunk sweep; per-block clock64 anatomy of the forward; PyTorch associative-scan
baseline. Prints tables and writes them (plus a JSON) under --out (default $OUT). Results: docs/kernels.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time

import torch
from cuda_timing import median_ms

from llm_surgery.ops.pd_scan import cuda as K

LOG = []


def say(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    LOG.append(s)


# ---------------------------------------------------------------- float64 references
def ref_fwd(P, D, b, x0):
    P = P.long()
    x = torch.zeros_like(b[:, 0]) if x0 is None else x0.clone()
    out = torch.empty_like(b)
    for t in range(b.shape[1]):
        x = b[:, t] + torch.zeros_like(x).scatter_add_(-1, P[:, t], D[:, t] * x)
        out[:, t] = x
    return out


def ref_bwd(P, D, x0, x, g):
    P = P.long()
    S, L, N = x.shape
    gD, gb = torch.empty_like(D), torch.empty_like(x)
    carry = torch.zeros_like(g[:, 0])
    for t in range(L - 1, -1, -1):
        lam = g[:, t] + carry
        gb[:, t] = lam
        a = lam.gather(-1, P[:, t])
        xp = x[:, t - 1] if t > 0 else (torch.zeros_like(lam) if x0 is None else x0)
        gD[:, t] = xp.conj() * a
        carry = D[:, t].conj() * a
    return gD, gb, carry


def rel(a, b):
    a, b = a.to(torch.complex128 if a.is_complex() or b.is_complex() else torch.float64), b
    b = b.to(a.dtype)
    if not torch.isfinite(torch.view_as_real(a) if a.is_complex() else a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make(S, L, N, cplx, dev, pmode, gen):
    if pmode == "random":
        P = torch.randint(0, N, (S, L, N), device=dev, generator=gen)
    elif pmode == "perm":
        P = torch.argsort(torch.rand(S, L, N, device=dev, generator=gen), dim=-1)
    elif pmode == "collide":   # nearly everything flows into a few entries
        P = torch.randint(0, 2, (S, L, N), device=dev, generator=gen)
    else:                      # all into one entry
        P = torch.zeros(S, L, N, dtype=torch.long, device=dev)
    mag = 0.3 + 0.65 * torch.rand(S, L, N, device=dev, generator=gen, dtype=torch.float64)
    if pmode in ("collide", "zero"):
        mag = mag / N
    if cplx:
        ph = 2 * math.pi * torch.rand(S, L, N, device=dev, generator=gen, dtype=torch.float64)
        D = torch.polar(mag, ph)
        b = torch.complex(torch.randn(S, L, N, device=dev, generator=gen, dtype=torch.float64),
                          torch.randn(S, L, N, device=dev, generator=gen, dtype=torch.float64))
        x0 = torch.complex(torch.randn(S, N, device=dev, generator=gen, dtype=torch.float64),
                           torch.randn(S, N, device=dev, generator=gen, dtype=torch.float64))
    else:
        sign = torch.where(torch.rand(S, L, N, device=dev, generator=gen) < 0.5, -1.0, 1.0).double()
        D = mag * sign
        b = torch.randn(S, L, N, device=dev, generator=gen, dtype=torch.float64)
        x0 = torch.randn(S, N, device=dev, generator=gen, dtype=torch.float64)
    return P.to(torch.int16), D, b, x0


def nan_like(t):
    return torch.full_like(t, float("nan"))


def run_kind(kind, P, D, b, x0, g, chunk, algo="auto"):
    """Run fwd+bwd through one calling form on poisoned outputs; return float64/complex128 results and the
    inputs as the kernel saw them (rounded to the kind's dtype), for the reference."""
    if kind in ("f32", "bf16"):
        dt = torch.float32 if kind == "f32" else torch.bfloat16
        Dk, bk, gk = D.to(dt), b.to(dt), g.to(dt)
        x = K.pd_scan_fwd_cuda(P, Dk, bk, x0, chunk=chunk, out=nan_like(bk), algo=algo)
        gD, gb, gx0 = K.pd_scan_bwd_cuda(P, Dk, x0, x, gk, chunk=chunk, out=(nan_like(Dk), nan_like(bk)))
        seen = (Dk.double(), bk.double(), x.double(), gk.double())
        return (x.double(), gD.double(), gb.double(), gx0.double()), seen
    if kind == "c64":
        Dk, bk, gk = D.to(torch.complex64), b.to(torch.complex64), g.to(torch.complex64)
        x0k = x0.to(torch.complex64)
        x = K.pd_scan_fwd_cuda(P, Dk, bk, x0k, chunk=chunk, out=nan_like(bk), algo=algo)
        gD, gb, gx0 = K.pd_scan_bwd_cuda(P, Dk, x0k, x, gk, chunk=chunk, out=(nan_like(Dk), nan_like(bk)))
        c = torch.complex128
        return (x.to(c), gD.to(c), gb.to(c), gx0.to(c)), (Dk.to(c), bk.to(c), x.to(c), gk.to(c))
    dt = torch.float32 if kind == "split_f32" else torch.bfloat16
    Dr, Di, br, bi, gr, gi = (t.to(dt).contiguous() for t in (D.real, D.imag, b.real, b.imag, g.real, g.imag))
    xr, xi = K.pd_scan_fwd_cuda_split(P, Dr, Di, br, bi, x0.to(torch.complex64), chunk=chunk,
                                      out=(nan_like(br), nan_like(bi)), algo=algo)
    gDr, gDi, gbr, gbi, gx0 = K.pd_scan_bwd_cuda_split(P, Dr, Di, x0.to(torch.complex64), xr, xi, gr, gi,
                                                       chunk=chunk, out=tuple(nan_like(br) for _ in range(4)))
    cx = lambda r, i: torch.complex(r.double(), i.double())
    x = cx(xr, xi)
    return (x, cx(gDr, gDi), cx(gbr, gbi), gx0.to(torch.complex128)), (cx(Dr, Di), cx(br, bi), x, cx(gr, gi))


def fwd_kernel(case):
    """The forward kernel a check case (L, N, kind, P, chunk[, algo]) runs: its algo, else warp up to N=256."""
    algo = case[5] if len(case) > 5 else "auto"
    return "block" if algo == "block" or case[1] > 256 else "warp"


def check(quick, extra_algos=()):
    dev = "cuda"
    gen = torch.Generator(device=dev)
    gen.manual_seed(1234)
    tol = {"f32": 1e-4, "c64": 1e-4, "split_f32": 1e-4, "bf16": 2e-2, "split_bf16": 2e-2}
    cases = []
    Ls = [1, 127, 128, 129, 4096, 16384] if not quick else [1, 129, 4096]
    for L in Ls:
        for N in (16, 64, 128, 256):
            for kind in tol:
                if L >= 4096 and not (N == 128 or kind == "c64" or kind == "split_f32"):
                    continue
                cases.append((L, N, kind, "random", None))
    for L in (129, 4096):   # the block forward kernel, still used for N > 256 (auto takes the warp kernel here)
        for kind in ("c64", "split_f32", "bf16"):
            cases.append((L, 128, kind, "random", None, "block"))
    for N in (512, 600, 1024):   # shared-memory-atomic scatter path (too large for per-warp buffers)
        for kind in ("c64", "f32", "split_bf16"):
            cases.append((300, N, kind, "random", None))
    cases.append((4096, 512, "c64", "random", None))
    for pm in ("collide", "zero", "perm"):
        for kind in ("f32", "c64", "split_bf16"):
            cases.append((1000, 128, kind, pm, None))
    for pm in ("collide", "zero", "perm"):   # long chunks: the warp kernel's repair or its full replay
        for kind in ("f32", "c64", "split_f32", "split_bf16"):
            cases.append((4096, 128, kind, pm, None))
    for ch in (1, 4, 16, 64):   # many chunks: long look-back chains
        for kind in ("c64", "split_f32", "bf16"):
            cases.append((4096, 64, kind, "random", ch))
    for N in (1, 31, 33, 100, 200, 255):   # partial warps of the warp kernel
        cases.append((257, N, "c64", "random", None))
        cases.append((257, N, "split_bf16", "collide" if N > 1 else "random", 8))
    # every case above once more through this forward kernel (any N <= 1024), unless it already runs that kernel
    run = {(c[:5], fwd_kernel(c)) for c in cases}
    for algo in extra_algos:
        cases += [c[:5] + (algo,) for c in cases if len(c) == 5 and (c[:5], fwd_kernel(c[:5] + (algo,))) not in run]
    say(f"\n## correctness vs float64 loop ({len(cases)} cases; S=3 sequences; outputs poisoned with NaN)")
    say("| L | N | kind | P | chunk | fwd kernel | fwd rel err | gD rel err | gb rel err | gx0 rel err | ok |")
    say("|---|---|---|---|---|---|---|---|---|---|---|")
    bad = 0
    rows = []
    for case in cases:
        L, N, kind, pm, ch = case[:5]
        algo = case[5] if len(case) > 5 else ("warp" if N <= 256 else "auto")
        fk = fwd_kernel(case)
        cplx = kind in ("c64", "split_f32", "split_bf16")
        P, D, b, x0 = make(3, L, N, cplx, dev, pm, gen)
        g = make(3, L, N, cplx, dev, "random", gen)[2]
        if not cplx:
            x0 = x0.float() if kind == "f32" else x0.to(torch.bfloat16)
        try:
            (x, gD, gb, gx0), (Ds, bs, xs, gs) = run_kind(kind, P, D, b, x0, g, ch, algo)
        except RuntimeError as e:
            bad += 1
            say(f"| {L} | {N} | {kind} | {pm} | {ch or 'auto'} | {fk} | error: {str(e)[:300]} | | | | NO |")
            continue
        x0s = x0.to(torch.complex128) if cplx else x0.double()
        xr = ref_fwd(P, Ds, bs, x0s)
        gDr, gbr, gx0r = ref_bwd(P, Ds, x0s, xs, gs)   # backward reference from the kernel's own saved x
        errs = [rel(x, xr), rel(gD, gDr), rel(gb, gbr), rel(gx0, gx0r)]
        ok = all(e < tol[kind] for e in errs)
        bad += not ok
        rows.append(dict(L=L, N=N, kind=kind, P=pm, chunk=ch, fwd=fk, errs=errs, ok=ok))
        say(f"| {L} | {N} | {kind} | {pm} | {ch or 'auto'} | {fk} | " + " | ".join(f"{e:.1e}" for e in errs) +
            f" | {'yes' if ok else 'NO'} |")
    say(f"correctness: {len(cases) - bad}/{len(cases)} passed")
    return rows, bad


# ---------------------------------------------------------------- timing
def bench_ms(fn, reps=50):
    """Median ms of fn() timed with events after warm-up; fn is replayed inside a CUDA graph when possible."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            fn()
        run = g.replay
        graphed = True
    except Exception as e:  # fall back to eager timing
        say(f"  (graph capture failed: {type(e).__name__}: {e}; timing eagerly)")
        run, graphed = fn, False
    return median_ms(run, reps, warmup=3), graphed


def d2d_bandwidth():
    """Best of: copy_ (cudaMemcpy) eager, copy_ in a graph, and an elementwise copy kernel; bytes read + written."""
    n = 1 << 28  # 1 GiB of fp32
    a = torch.randn(n, device="cuda")
    b = torch.empty_like(a)
    out = {}
    for name, fn in (("copy_", lambda: b.copy_(a)), ("kernel", lambda: torch.mul(a, 1.0, out=b))):
        out[name + " graph"] = bench_ms(fn, reps=20)[0]
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(20):
            fn()
        e.record()
        e.synchronize()
        out[name + " eager"] = s.elapsed_time(e) / 20
    del a, b
    tbs = {k: 2 * n * 4 / (ms * 1e-3) / 1e12 for k, ms in out.items()}
    say("D2D copies (TB/s): " + ", ".join(f"{k} {v:.2f}" for k, v in tbs.items()))
    return max(tbs.values())


PMODE = "random"   # --pmode: P of the timed inputs


def must_bytes(kind, S, L, N, which="fwd"):
    """Bytes the forward (P, D, b in; x out) or backward (P, D, x, grad_x in; grad_D, grad_b out) must move."""
    return S * L * N * (2 + (3 if which == "fwd" else 5) * ELEM[kind])


def rotations(nbytes):
    """Input sets to rotate through so that one timing touches >= 256 MB (small sizes must not time the L2)."""
    return max(1, min(8, math.ceil(256e6 / nbytes)))


def copy_at_size(nbytes):
    """ms of a device-to-device copy moving `nbytes` (half read, half written), input sets rotated as in
    time_kind: the ceiling that any kernel moving that many bytes meets at small sizes (launch, ramp-up)."""
    n = max(1, nbytes // 8)   # fp32 elements read (and as many written)
    nsets = rotations(nbytes)
    pairs = [(torch.empty(n, device="cuda"), torch.empty(n, device="cuda")) for _ in range(nsets)]

    def all_sets():
        for a, b in pairs:
            torch.mul(a, 1.0, out=b)
    ms, _ = bench_ms(all_sets, reps=50)
    return ms / nsets


def inputs_for(kind, S, L, N, nsets):
    """nsets independent input sets (rotated so that small sizes do not time the L2 cache). P uniform at random
    (--pmode random: maps merge entries, so a chunk's composed map sends nearly all entries into a few) or a
    random permutation per step (--pmode perm: nothing merges)."""
    sets = []
    for _ in range(nsets):
        if PMODE == "perm":
            P = torch.argsort(torch.rand(S, L, N, device="cuda"), dim=-1).to(torch.int16)
        else:
            P = torch.randint(0, N, (S, L, N), device="cuda", dtype=torch.int16)
        mag = 0.3 + 0.65 * torch.rand(S, L, N, device="cuda")
        if kind in ("f32", "bf16"):
            dt = torch.float32 if kind == "f32" else torch.bfloat16
            sets.append((P, (mag * torch.sign(torch.randn_like(mag))).to(dt), torch.randn(S, L, N, device="cuda").to(dt)))
        elif kind == "c64":
            D = torch.polar(mag, 6.283 * torch.rand_like(mag))
            sets.append((P, D, torch.randn(S, L, N, device="cuda", dtype=torch.complex64)))
        else:
            dt = torch.float32 if kind == "split_f32" else torch.bfloat16
            D = torch.polar(mag, 6.283 * torch.rand_like(mag))
            sets.append((P, D.real.to(dt).contiguous(), D.imag.to(dt).contiguous(),
                         torch.randn(S, L, N, device="cuda").to(dt), torch.randn(S, L, N, device="cuda").to(dt)))
    return sets


ELEM = {"f32": 4, "bf16": 2, "c64": 8, "split_f32": 8, "split_bf16": 4}   # bytes per element of D, b, x, g


def fwd_fn(kind, s, chunk, algo="auto"):
    if kind.startswith("split"):
        return lambda: K.pd_scan_fwd_cuda_split(*s, chunk=chunk, algo=algo)
    return lambda: K.pd_scan_fwd_cuda(*s, chunk=chunk, algo=algo)


def bwd_fn(kind, s, chunk):
    if kind.startswith("split"):
        P, Dr, Di, br, bi = s
        xr, xi = K.pd_scan_fwd_cuda_split(*s, chunk=chunk)
        return lambda: K.pd_scan_bwd_cuda_split(P, Dr, Di, None, xr, xi, br, bi, chunk=chunk)
    P, D, b = s
    x = K.pd_scan_fwd_cuda(P, D, b, chunk=chunk)
    return lambda: K.pd_scan_bwd_cuda(P, D, None, x, b, chunk=chunk)


def profiled_launch(fn):
    """One launch of fn with the forward's clock64 probes on: (probes [chunks, 8] as float64, C, T)."""
    K._state["profile"] = True
    fn()
    torch.cuda.synchronize()
    K._state["profile"] = False
    pr, _, C, T = K._state.pop("last_profile")
    return pr.cpu().double(), C, T


def probe_forward(kind, S, L, N, chunk=None, algo="warp"):
    """The forward's clock64 probes on one fresh input set, after a warm-up call: (probes, C, T) as profiled_launch."""
    s = inputs_for(kind, S, L, N, 1)[0]
    fwd_fn(kind, s, chunk, algo)()
    return profiled_launch(fwd_fn(kind, s, chunk, algo))


def chunk_phases(pr):
    """Per chunk, from its probes (start, staged, aggregate out, look-back found, entering state, end, look-back
    distance, SM, repair start): cycles of its life and of each phase. `slow` marks the chunks that ran phase 1 and
    the look-back; the others started from a published state and count 0 there. `replay` ends where the repair
    (warp forward, logged chunks) starts; `repair` is 0 for chunks without one."""
    slow = pr[:, 6] >= 0
    zero = torch.zeros_like(pr[:, 0])
    logged = pr[:, 8] >= 0
    replay_end = torch.where(logged, pr[:, 8], pr[:, 5])
    return dict(slow=slow, logged=logged, load=pr[:, 1] - pr[:, 0],
                phase1=torch.where(slow, pr[:, 2] - pr[:, 1], zero),
                wait=torch.where(slow, pr[:, 3] - pr[:, 2], zero), apply=torch.where(slow, pr[:, 4] - pr[:, 3], zero),
                replay=replay_end - torch.where(slow, pr[:, 4], pr[:, 1]),
                repair=torch.where(logged, pr[:, 5] - pr[:, 8], zero), life=pr[:, 5] - pr[:, 0])


def time_kind(kind, S, L, N, chunk=None, which="fwd", algo="auto"):
    must = must_bytes(kind, S, L, N, which)
    nsets = rotations(must)
    sets = inputs_for(kind, S, L, N, nsets)
    fns = [fwd_fn(kind, s, chunk, algo) if which == "fwd" else bwd_fn(kind, s, chunk) for s in sets]

    def all_sets():
        for f in fns:
            f()
    ms, graphed = bench_ms(all_sets, reps=20 if must * nsets > 1e9 else 50)
    ms /= nsets
    del sets, fns
    return ms, must / (ms * 1e-3) / 1e12, graphed


# ---------------------------------------------------------------- PyTorch associative-scan baseline
def combine(e1, e2):
    """(P, D, b) of step 1 then step 2, as one column map: P = P2[P1], D = D1 * D2[P1], b = b2 + P2 D2 b1."""
    P1, D1, b1 = e1
    P2, D2, b2 = e2
    P = torch.gather(P2, -1, P1)
    D = D1 * torch.gather(D2, -1, P1)
    b = b2 + torch.zeros_like(b2).scatter_add(-1, P2, D2 * b1)
    return P, D, b


def hillis_steele(P, D, b):
    """Inclusive scan over dim 1 in log2(L) steps of the composition above (plain torch)."""
    L = P.shape[1]
    k = 1
    while k < L:
        nP, nD, nb = combine((P[:, :-k], D[:, :-k], b[:, :-k]), (P[:, k:], D[:, k:], b[:, k:]))
        P = torch.cat([P[:, :k], nP], 1)
        D = torch.cat([D[:, :k], nD], 1)
        b = torch.cat([b[:, :k], nb], 1)
        k *= 2
    return b


def baseline(S, L, N, mode):
    P = torch.randint(0, N, (S, L, N), device="cuda")
    D = torch.polar(0.3 + 0.65 * torch.rand(S, L, N, device="cuda"), 6.283 * torch.rand(S, L, N, device="cuda"))
    b = torch.randn(S, L, N, device="cuda", dtype=torch.complex64)
    if mode == "associative_scan":
        from torch._higher_order_ops.associative_scan import associative_scan
        fn = lambda: associative_scan(combine, (P, D, b), dim=1, combine_mode="generic")[2]
    else:
        fn = lambda: hillis_steele(P, D, b)
    out = fn()
    ref = K.pd_scan_fwd_cuda(P, D, b)
    err = rel(ref, out.to(torch.complex128))
    return median_ms(fn, 3 if L >= 8192 else 10, warmup=0), err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--skip", default="", help="comma list of sections to skip: check,copy,fwd,fwd-block,"
                    "bwd,algo,sweep,prof,b192,base")
    ap.add_argument("--check-algos", default="block",
                    help="forward kernels that run every correctness case once more (comma list; '' for none)")
    ap.add_argument("--sweep-algo", default="warp", help="forward kernel of the chunk sweep")
    ap.add_argument("--sweep-L", default="2048,16384", help="sequence lengths of the chunk sweep (comma list)")
    ap.add_argument("--pmode", default="random", choices=("random", "perm"), help="P of the timed inputs")
    args = ap.parse_args()
    global PMODE
    PMODE = args.pmode
    skip = set(args.skip.split(","))
    os.makedirs(args.out, exist_ok=True)
    res = {}
    props = torch.cuda.get_device_properties(0)
    say(f"# pd_scan CUDA bench, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    say(f"device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, CUDA {torch.version.cuda}")
    say(f"command: {' '.join(sys.argv)}")
    t0 = time.time()
    ok = K.available()
    say(f"build+load: {time.time() - t0:.1f} s, available={ok}, error={K.load_error()}")
    if not ok:
        sys.exit(1)
    if "check" not in skip:
        rows, bad = check(args.quick, [a for a in args.check_algos.split(",") if a])
        res["check"] = rows
    bw = d2d_bandwidth()
    res["d2d_TBps"] = bw
    say(f"\nD2D copy bandwidth (1 GiB, read+write): {bw:.2f} TB/s")
    S, N = 32, 128
    Ls = [128, 512, 2048, 8192, 16384]
    kinds = ["split_f32", "split_bf16", "c64", "f32", "bf16"]
    if "copy" not in skip:
        say(f"\n## a copy kernel moving the forward's must-move bytes (B={S}, N={N}): ms and fraction of the 1 GiB "
            "copy bandwidth, the ceiling for any kernel of that size")
        say("| kind | " + " | ".join(f"L={L}" for L in Ls) + " |")
        say("|---|" + "---|" * len(Ls))
        for kind in ("c64", "split_bf16"):
            cells = []
            for L in Ls:
                must = must_bytes(kind, S, L, N)
                ms = copy_at_size(must)
                frac = must / (ms * 1e-3) / 1e12 / bw
                res[f"copy/{kind}/{L}"] = dict(ms=ms, frac=frac)
                cells.append(f"{ms:.4f} ms ({100 * frac:.0f}%)")
            say(f"| {kind} | " + " | ".join(cells) + " |")
    for which, algo in (("fwd", "warp"), ("fwd", "block"), ("bwd", "auto")):
        if which in skip or f"{which}-{algo}" in skip:
            continue
        key = which if algo in ("auto", "warp") else f"{which}-{algo}"
        say(f"\n## {which} ({algo} kernel): B={S}, N={N}, must-move bandwidth (TB/s) and fraction of D2D; "
            "time in ms (CUDA graph)")
        say("| kind | " + " | ".join(f"L={L}" for L in Ls) + " |")
        say("|---|" + "---|" * len(Ls))
        for kind in kinds:
            cells = []
            for L in Ls:
                ms, tbs, gr = time_kind(kind, S, L, N, which=which, algo=algo)
                res[f"{key}/{kind}/{L}"] = dict(ms=ms, TBps=tbs, frac=tbs / bw, graphed=gr)
                cells.append(f"{ms:.4f} ms, {tbs:.2f} ({100 * tbs / bw:.0f}%)")
            say(f"| {kind} | " + " | ".join(cells) + " |")
    if "algo" not in skip:
        say("\n## forward kernels at layer-like and small shapes (default chunk): ms")
        say("| kind | sequences | L | N | warp | block | fastest |")
        say("|---|---|---|---|---|---|---|")
        for kind in ("c64", "split_bf16"):
            for S_, L_, N_ in ((512, 4096, 32), (512, 1024, 32), (256, 4096, 64), (64, 4096, 128),
                               (32, 4096, 256), (2048, 2048, 16), (16, 2048, 512), (32, 128, 32), (32, 512, 64),
                               (8, 1024, 128), (4, 256, 256)):
                t = {a: (time_kind(kind, S_, L_, N_, which="fwd", algo=a)[0] if a != "warp" or N_ <= 256
                         else float("nan")) for a in ("warp", "block")}
                res[f"algo/{kind}/{S_}/{L_}/{N_}"] = t
                best = min((v, a) for a, v in t.items() if v == v)[1]
                say(f"| {kind} | {S_} | {L_} | {N_} | " + " | ".join(f"{t[a]:.4f}" for a in t) + f" | {best} |")
    if "sweep" not in skip:
        Ts = (4, 8, 16, 32, 64, 128, 256) if args.sweep_algo == "warp" else (2, 4, 8, 16, 32, 64)
        say(f"\n## chunk sweep of the {args.sweep_algo} forward kernel (B=32, N=128): ms (fraction of D2D)")
        say("| kind | L | dir | " + " | ".join(f"T={T}" for T in Ts) + " |")
        say("|---|---|---|" + "---|" * len(Ts))
        for kind in ("split_f32", "split_bf16", "c64", "f32"):
            for L in (int(v) for v in args.sweep_L.split(",")):
                for which in ("fwd",):
                    cells = []
                    for T in Ts:
                        try:
                            ms, tbs, _ = time_kind(kind, S, L, N, chunk=T, which=which, algo=args.sweep_algo)
                            cells.append(f"{ms:.4f} ({100 * tbs / bw:.0f}%)")
                        except Exception as e:
                            cells.append(f"err {type(e).__name__}")
                    say(f"| {kind} | {L} | {which} | " + " | ".join(cells) + " |")
    if "prof" not in skip:
        say("\n## forward kernel anatomy (clock64 cycles per block, means; B=32, N=128)")
        say("| kernel | kind | L | T | blocks | fast % | load | phase 1 | wait | apply+incl | replay | repair (logged %) | "
            "lifetime | look-back dist mean/max | resident/SM |")
        say("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for algo, kind, L, T in [("warp", k, L, None) for k in ("split_f32", "c64", "split_bf16")
                                 for L in (2048, 16384)] + \
                                [("warp", "split_bf16", 128, None)] + \
                                [("warp", "c64", 16384, T) for T in (16, 32, 64)] + \
                                [("block", k, L, None) for k in ("c64", "split_bf16") for L in (2048, 16384)]:
            pr, C, TT = probe_forward(kind, S, L, N, T, algo)
            ph = chunk_phases(pr)
            slow = ph["slow"]
            f = lambda v: f"{v.mean().item():.0f}" if v.numel() else "-"
            # residency: per SM, mean number of blocks alive at each block's start
            alive = []
            for sm in pr[:, 7].unique()[:8]:
                blk = pr[pr[:, 7] == sm]
                for t0 in blk[:, 0][::7]:
                    alive.append(((blk[:, 0] <= t0) & (blk[:, 5] > t0)).sum().item())
            say(f"| {algo} | {kind} | {L} | {TT} | {pr.shape[0]} | {100 * (~slow).float().mean().item():.0f} | "
                f"{f(ph['load'])} | {f(ph['phase1'][slow])} | {f(ph['wait'][slow])} | {f(ph['apply'][slow])} | "
                f"{f(ph['replay'])} | {f(ph['repair'][ph['logged']])} ({100 * ph['logged'].float().mean().item():.0f}) | "
                f"{f(ph['life'])} | "
                f"{f(pr[slow, 6])}/{pr[:, 6].max().item():.0f} | {sum(alive) / max(1, len(alive)):.1f} |")
    if "b192" not in skip:
        say("\n## the paper's bandwidth setting: B=192, N=128, forward. Must-move fraction of D2D, and the paper's "
            "'algorithmic' bandwidth (inputs counted twice, as its three-kernel design streams them) as a fraction "
            "of D2D")
        say("| kind | L | kernel | ms | must-move TB/s | of D2D | algorithmic TB/s | of D2D |")
        say("|---|---|---|---|---|---|---|---|")
        for kind in ("split_f32", "split_bf16"):
            e = ELEM[kind]
            for L in (1024, 4096, 16384):
                for algo in ("warp", "block"):
                    ms, tbs, _ = time_kind(kind, 192, L, N, which="fwd", algo=algo)
                    alg = tbs * (2 * (2 + 2 * e) + e) / (2 + 3 * e)
                    res[f"b192/{kind}/{L}/{algo}"] = dict(ms=ms, TBps=tbs, frac=tbs / bw, alg_TBps=alg)
                    say(f"| {kind} | {L} | {algo} | {ms:.4f} | {tbs:.2f} | {100 * tbs / bw:.0f}% | {alg:.2f} | "
                        f"{100 * alg / bw:.0f}% |")
                    torch.cuda.empty_cache()
    if "base" not in skip:
        say("\n## PyTorch baselines, complex64, B=32, N=128 (fwd ms; speedup of the c64 / split kernels)")
        mode = "associative_scan"
        try:
            baseline(2, 64, 16, mode)
        except Exception as e:
            say(f"associative_scan unavailable ({type(e).__name__}: {str(e)[:200]}); using Hillis-Steele in torch")
            mode = "hillis_steele"
        say(f"baseline: {mode}")
        say("| L | baseline ms | rel err vs kernel | c64 warp kernel ms | speedup | c64 block kernel ms | speedup | "
            "split_f32 speedup (warp) | split_bf16 speedup (warp) |")
        say("|---|---|---|---|---|---|---|---|---|")
        for L in Ls:
            try:
                ms, err = baseline(S, L, N, mode)
            except Exception as e:
                say(f"| {L} | failed: {type(e).__name__}: {str(e)[:120]} |")
                continue
            kc = res.get(f"fwd/c64/{L}", {}).get("ms", float("nan"))
            k1 = res.get(f"fwd/split_f32/{L}", {}).get("ms", float("nan"))
            k2 = res.get(f"fwd/split_bf16/{L}", {}).get("ms", float("nan"))
            res[f"base/{L}"] = dict(ms=ms, err=err, mode=mode)
            kb = res.get(f"fwd-block/c64/{L}", {}).get("ms", float("nan"))
            say(f"| {L} | {ms:.3f} | {err:.1e} | {kc:.4f} | {ms / kc:.0f}x | {kb:.4f} | {ms / kb:.0f}x | "
                f"{ms / k1:.0f}x | {ms / k2:.0f}x |")
            torch.cuda.empty_cache()
    with open(os.path.join(args.out, "pd_scan_bench.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(args.out, "pd_scan_bench.md"), "w") as f:
        f.write("\n".join(LOG) + "\n")


if __name__ == "__main__":
    main()

"""CUDA kernels for `pd_scan`: a single-pass chunked scan with decoupled look-back (sources in `kernels/`).

The extension is built on first use with `torch.utils.cpp_extension.load` into
`~/.cache/llm_surgery/kernels/<hash of sources, torch and CUDA versions>` (override with the environment
variable `LLM_SURGERY_KERNEL_CACHE`), so later uses only load it. Sources come from the installed package
(`llm_surgery/_kernels/`) or, in an editable install, from the repository's `kernels/` folder. A first build takes
about 28 s of nvcc (H200 machine, 16 cores); `start_build()` runs it in a background thread, so a program that
knows it will need the kernels (the trainer, for pdssm layers) builds them while it loads its model.

Calling forms (all tensors on one CUDA device, shapes `[..., L, N]`, leading dims flattened, N <= 1024):

- `pd_scan_fwd_cuda(P, D, b, x0=None) -> x` and `pd_scan_bwd_cuda(P, D, x0, x, grad_x) -> (gD, gb, gx0)`:
  D, b float32 / bfloat16 (real) or complex64; float16 is computed through float32. x has b's dtype;
  gx0 is None when x0 is None.
- `pd_scan_fwd_cuda_split(P, D_re, D_im, b_re, b_im, x0=None) -> (x_re, x_im)` and
  `pd_scan_bwd_cuda_split(P, D_re, D_im, x0, x_re, x_im, g_re, g_im) -> (gD_re, gD_im, gb_re, gb_im, gx0)`:
  complex D, b given as separate real/imaginary planes, as the layer produces them, so no complex tensor is ever
  materialised; x0 is complex64 (or None). Planes all float32, all bfloat16, or D float32 with every other plane
  bfloat16 (the mixed form: a decay near 1 keeps float32's resolution, the state-sized planes move half the bytes);
  x, gD and gb take b's / x's dtype. `last=(re, im)` [S, N] float32 receives the state after the last step in
  float32, whatever x's dtype.

All arithmetic is float32 (complex as pairs of float32); P is read as int16 (other integer dtypes are converted).
float64/complex128 are not kernel dtypes (TypeError; check `supports(dtype)` before dispatching). `chunk=` sets
the chunk length (steps per block; default from the shared-memory budget), `out=` takes preallocated outputs,
`algo=` picks the forward kernel: "block" (one block per chunk, one thread per entry, shared-memory scatter, any
N <= 1024), "warp" (one warp per chunk, per-step gather lists, N <= 256), or "auto" (default: the kernel that
measured fastest on the H100 and H200 at that size). How a launch is configured (kernel, chunk length,
chunk table, repair log) is `launch_policy`'s; docs/kernels.md gives the measurements behind it.
P values must lie in [0, N): `pd_scan` checks them before it calls these, as `validate=True` does here (a ValueError;
one aminmax and a device sync). Unchecked, an out-of-range value is moved into the state by the kernels (no memory
outside it is touched; the outputs are then meaningless), and int32/int64 values are never wrapped into range by
the narrowing to int16.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import threading
import warnings
from pathlib import Path

import torch

from . import check_index_range
from . import launch_policy as policy
from .launch_policy import BF16, CPLX as _CPLX, FLOAT32, MIXED, REAL as _REAL, SPLIT as _SPLIT

__all__ = ["available", "supports", "load_error", "pd_scan_fwd_cuda", "pd_scan_bwd_cuda",
           "pd_scan_fwd_cuda_split", "pd_scan_bwd_cuda_split", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.complex64)
# one translation unit per kernel (ninja compiles them in parallel on first use); kernels/ holds them
_SOURCES = ("pd_scan_bind.cpp", "pd_scan_launch.cu", "pd_fwd_block.cu", "pd_fwd_warp.cu", "pd_bwd.cu")
_HEADERS = ("pd_scan.cuh", "pd_scan_common.cuh", "pd_scan_kernels.cuh")
MAX_N = 1024   # the largest state size: one thread per entry in the block kernels, int16 indices

_ext = None
_state: dict = {}
_lock = threading.RLock()  # one build, also when start_build's thread and a caller ask at once


def _source_dir() -> Path:
    here = Path(__file__).resolve()
    for cand in (here.parents[2] / "_kernels", here.parents[3] / "kernels"):
        if all((cand / f).is_file() for f in _SOURCES + _HEADERS):
            return cand
    raise FileNotFoundError("pd_scan CUDA sources not found (looked in llm_surgery/_kernels and the repo's kernels/)")


CUDA_CFLAGS = ["-O3", "-std=c++17", "-lineinfo"]   # nvcc flags of the build


def _build():
    from torch.utils.cpp_extension import load

    src = _source_dir()
    h = hashlib.sha256()
    for f in _SOURCES + _HEADERS:
        h.update((src / f).read_bytes())
    cap = torch.cuda.get_device_capability()
    h.update(f"{torch.__version__}|{torch.version.cuda}|{cap}".encode())
    digest = h.hexdigest()[:16]
    root = Path(os.environ.get("LLM_SURGERY_KERNEL_CACHE", Path.home() / ".cache" / "llm_surgery" / "kernels"))
    build_dir = root / digest
    build_dir.mkdir(parents=True, exist_ok=True)
    if "TORCH_CUDA_ARCH_LIST" not in os.environ:
        os.environ["TORCH_CUDA_ARCH_LIST"] = f"{cap[0]}.{cap[1]}"
    return load(name=f"llm_surgery_pd_scan_{digest}", sources=[str(src / f) for f in _SOURCES],
                extra_include_paths=[str(src)], extra_cflags=["-O3", "-std=c++17"],
                extra_cuda_cflags=CUDA_CFLAGS, build_directory=str(build_dir),
                verbose=bool(os.environ.get("LLM_SURGERY_KERNEL_VERBOSE")))


def _module():
    global _ext
    if _ext is None:
        with _lock:
            if _ext is None:
                _ext = _build()
    return _ext


def available() -> bool:
    """True when a CUDA device is present and the kernels build/load (cached; never raises). Waits for a build
    that `start_build` began."""
    with _lock:
        return _available()


def start_build() -> None:
    """Build or load the kernels in a background thread (daemon; a no-op once done or without CUDA). The nvcc
    processes of a first build run beside the caller's work; the first `available()` then waits only for what
    is left of it."""
    if "ok" not in _state and torch.cuda.is_available():
        threading.Thread(target=available, name="pd_scan-build", daemon=True).start()


def _available() -> bool:
    if "ok" not in _state:
        ok = False
        try:
            if torch.cuda.is_available():
                _module()
                ok = True
        except Exception as e:  # a failed build must not break CPU/CUDA fallbacks
            _state["error"] = f"{type(e).__name__}: {e}"
            warnings.warn(f"llm_surgery pd_scan CUDA kernels unavailable, using the torch path: {_state['error']}")
        _state["ok"] = ok
    return _state["ok"]


def supports(dtype: torch.dtype) -> bool:
    """Whether pd_scan_fwd_cuda / pd_scan_bwd_cuda take D, b of this dtype (float64/complex128 do not)."""
    return dtype in SUPPORTED_DTYPES


def load_error() -> str | None:
    """Why `available()` returned False (None if it did not, or was not asked)."""
    return _state.get("error")


# ---------------------------------------------------------------- argument handling
def _check_common(P, planes, x0, names, one_dtype=True):
    """(S, L, N) after checking shapes and devices, and (`one_dtype`) that the planes share a dtype (the split forms
    check theirs in `_split_form`)."""
    for name, t in zip(("P",) + names, (P,) + planes):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"pd_scan CUDA: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_cuda:
            raise ValueError(f"pd_scan CUDA: {name} must be a CUDA tensor, got device {t.device}")
    if P.dtype not in (torch.int16, torch.int32, torch.int64):
        raise TypeError(f"pd_scan CUDA: P must be int16, int32 or int64, got {P.dtype}")
    if P.dim() < 2:
        raise ValueError(f"pd_scan CUDA: P must be [..., L, N], got shape {tuple(P.shape)}")
    for name, t in zip(names, planes):
        if t.shape != P.shape:
            raise ValueError(f"pd_scan CUDA: {name} must have P's shape {tuple(P.shape)}, got {tuple(t.shape)}")
        if t.device != P.device:
            raise ValueError(f"pd_scan CUDA: {name} is on {t.device}, P on {P.device}")
    dt = planes[0].dtype
    for name, t in zip(names, planes):
        if one_dtype and t.dtype != dt:
            raise TypeError(f"pd_scan CUDA: {names[0]} and {name} must share a dtype, got {dt} and {t.dtype}")
    L, N = P.shape[-2:]
    if N > MAX_N:
        raise ValueError(f"pd_scan CUDA: state size N={N} exceeds the kernel limit {MAX_N}")
    S = math.prod(P.shape[:-2])
    if x0 is not None:
        if not isinstance(x0, torch.Tensor):
            raise TypeError(f"pd_scan CUDA: x0 must be a torch.Tensor or None, got {type(x0).__name__}")
        if x0.shape != P.shape[:-2] + (N,):
            raise ValueError(f"pd_scan CUDA: x0 must have shape {tuple(P.shape[:-2] + (N,))}, got {tuple(x0.shape)}")
        if x0.device != P.device:
            raise ValueError(f"pd_scan CUDA: x0 is on {x0.device}, P on {P.device}")
    return S, L, N


def _idx(P, N, validate):
    """P as contiguous int16, the kernels' index type. A wider P is clamped to [-1, N] first (N <= 1024), so a
    value outside [0, N) stays outside: a plain cast would wrap e.g. 65539 to 3, inside the state."""
    if validate:
        check_index_range(P, N, "pd_scan CUDA")
    if P.dtype != torch.int16:
        P = P.clamp(-1, N).to(torch.int16)
    return P.contiguous()


def _ptr(t):
    return 0 if t is None else t.data_ptr()


@functools.lru_cache(maxsize=1024)
def _plan(layout, form, bwd, S, L, N, sms, limit, chunk, algo):
    """(kernel code, chunk length, chunks, warp forward, one wave) of a launch on a GPU of `sms` multiprocessors and
    `limit` bytes of shared memory a block: the same for every call of a shape, so worked out once per shape and
    GPU (the launch is host-bound at small shapes; docs/bench/layer.md, "Host time")."""
    ext = _module()
    code = policy.algo_code(algo, N, bwd)
    T = int(chunk) if chunk else policy.default_chunk(ext, layout, form, bwd, S, L, N, sms, code, limit)
    if T < 1:
        raise ValueError(f"pd_scan CUDA: chunk must be >= 1, got {chunk}")
    warp_fwd = not bwd and code == policy.ALGOS["warp"]   # only the warp forward has look-back links and a chunk table
    if not warp_fwd:   # the staged kernels hold a chunk's rows in shared memory (the warp forward's use is fixed)
        smem = ext.smem_bytes(layout, form, N, T, bwd, code)
        if smem > limit:
            raise ValueError(f"pd_scan CUDA: chunk={T} at N={N} needs {smem} bytes of shared memory per block, "
                             f"more than this GPU's {limit}: pass a smaller chunk (or none, for the default)")
    C = -(-L // T)
    one_wave = warp_fwd and S * C <= policy.warp_slots(ext, layout, form, N, sms)
    return code, T, C, warp_fwd, one_wave


def _run(layout, form, bwd, S, L, N, ptrs, x0c, gx0, device, chunk, algo="auto"):
    """Launch one pass; returns the inclusive states [S, C, N, comps] float32 (the last chunk's is the final state)."""
    ext = _module()
    props = torch.cuda.get_device_properties(device)
    code, T, C, warp_fwd, one_wave = _plan(layout, form, bwd, S, L, N, props.multi_processor_count,
                                           policy.smem_limit(props), chunk, algo)
    comps = 1 if layout == _REAL else 2
    starts = None
    if warp_fwd:
        ramp = policy.chunk_ramp(chunk, C, T, one_wave)
        starts, T = policy.chunk_starts(L, C, T, ramp, device)   # T: the longest chunk, which sizes the repair log
    # tickets, flags, and (warp forward) link flags
    counter = torch.zeros(1 + (2 if warp_fwd else 1) * S * C, dtype=torch.int32, device=device)
    agg_pi = torch.empty(S * C * N, dtype=torch.int32, device=device)
    agg = torch.empty(3, S * C * N * comps, dtype=torch.float32, device=device)
    prof = None
    if _state.get("profile") and not bwd:   # benchmarking aid: per-block clock64 probes of the forward
        prof = torch.zeros(S * C, policy.PROBES, dtype=torch.int64, device=device)
        _state["last_profile"] = (prof, S, C, T)
    rcap = policy.repair_capacity(code, bwd, form, T, N, one_wave)
    words = comps * (2 if form != FLOAT32 else 1) + 1   # per log entry: factor, link word, (bfloat16 outputs) y
    rlog = torch.empty(S * C * rcap * words, dtype=torch.int32, device=device) if rcap else None
    link = torch.empty(S * C * policy.link_words(comps), dtype=torch.int32, device=device) if warp_fwd else None
    p = list(ptrs) + [_ptr(x0c), _ptr(gx0), counter.data_ptr(), agg_pi.data_ptr(), agg[0].data_ptr(),
                      agg[1].data_ptr(), agg[2].data_ptr(), _ptr(prof), _ptr(rlog),
                      _ptr(link), _ptr(starts)]
    with torch.cuda.device(device):
        ext.launch(layout, int(form), int(bwd), p, [S, L, N, T, C, code, rcap],
                   torch.cuda.current_stream(device).cuda_stream)
    return agg[2].view(S, C, N, comps)


def _layout_of(dtype):
    if dtype == torch.complex64:
        return _CPLX, FLOAT32
    if dtype in (torch.float32, torch.bfloat16):
        return _REAL, BF16 if dtype == torch.bfloat16 else FLOAT32
    raise TypeError(f"pd_scan CUDA: D and b must be float32, bfloat16, float16 or complex64, got {dtype}")


def _x0_fp32(x0, S, N, cplx):
    if x0 is None:
        return None
    return x0.reshape(S, N).to(torch.complex64 if cplx else torch.float32).contiguous()


def _planes(t):
    """Pointers of the re/im planes of one array (im = 0 for real and interleaved complex)."""
    return [t.data_ptr(), 0]


# ---------------------------------------------------------------- public entry points
def pd_scan_fwd_cuda(P, D, b, x0=None, *, chunk=None, validate=False, out=None, algo="auto"):
    """x_t[n] = b_t[n] + sum_{m: P_t[m]=n} D_t[m] x_{t-1}[m] on the GPU; x in b's dtype."""
    S, L, N = _check_common(P, (D, b), x0, ("D", "b"))
    if b.dtype == torch.float16:
        x = pd_scan_fwd_cuda(P, D.float(), b.float(), None if x0 is None else x0.float(), chunk=chunk,
                             validate=validate, algo=algo)
        return x.half()
    layout, form = _layout_of(b.dtype)
    Pc = _idx(P, N, validate)
    Dc, bc = D.contiguous(), b.contiguous()
    x = torch.empty_like(bc) if out is None else out
    if L == 0 or S == 0:
        return x
    x0c = _x0_fp32(x0, S, N, layout == _CPLX)
    ptrs = [Pc.data_ptr()] + _planes(Dc) + _planes(bc) + [0, 0] + _planes(x) + [0, 0]
    _run(layout, form, False, S, L, N, ptrs, x0c, None, P.device, chunk, algo)
    return x


def pd_scan_bwd_cuda(P, D, x0, x, grad_x, *, chunk=None, validate=False, out=None):
    """(grad_D, grad_b, grad_x0) of pd_scan given its output x and grad_x (gather recurrence backwards)."""
    S, L, N = _check_common(P, (D, x, grad_x), x0, ("D", "x", "grad_x"))
    if D.dtype == torch.float16:
        gD, gb, gx0 = pd_scan_bwd_cuda(P, D.float(), None if x0 is None else x0.float(), x.float(),
                                       grad_x.float(), chunk=chunk, validate=validate)
        return gD.half(), gb.half(), None if gx0 is None else gx0.to(x0.dtype)
    layout, form = _layout_of(D.dtype)
    Pc = _idx(P, N, validate)
    Dc, xc, gc = D.contiguous(), x.contiguous(), grad_x.contiguous()
    if out is None:
        gD, gb = torch.empty_like(Dc), torch.empty_like(xc)
    else:
        gD, gb = out
    x0c = _x0_fp32(x0, S, N, layout == _CPLX)
    gx0 = None if x0 is None else torch.empty_like(x0c)
    if L == 0 or S == 0:
        return gD, gb, None if x0 is None else torch.zeros_like(x0)
    ptrs = [Pc.data_ptr()] + _planes(Dc) + _planes(gc) + _planes(xc) + _planes(gb) + _planes(gD)
    _run(layout, form, True, S, L, N, ptrs, x0c, gx0, P.device, chunk)
    return gD, gb, None if x0 is None else gx0.reshape(x0.shape).to(x0.dtype)


def _split_form(d_planes, v_planes):
    """The kernels' form for split planes, from D's planes and the others' ((name, tensor) pairs): each group of one
    dtype, and the two groups' dtypes a pair the kernels take."""
    for group in (d_planes, v_planes):
        (ref_name, ref), *rest = group
        for name, t in rest:
            if t.dtype != ref.dtype:
                raise TypeError(f"pd_scan CUDA split form: {name} must have {ref_name}'s dtype {ref.dtype}, "
                                f"got {t.dtype}")
    (_, D), (v_name, v) = d_planes[0], v_planes[0]
    D_dtype, v_dtype = D.dtype, v.dtype   # the groups' dtypes
    if D_dtype == v_dtype and D_dtype in (torch.float32, torch.bfloat16):
        return BF16 if D_dtype == torch.bfloat16 else FLOAT32
    if D_dtype == torch.float32 and v_dtype == torch.bfloat16:
        return MIXED
    raise TypeError(f"pd_scan CUDA split form: planes must be all float32, all bfloat16, or D float32 with the "
                    f"others bfloat16; got D {D_dtype} and {v_name} {v_dtype}")


def pd_scan_fwd_cuda_split(P, D_re, D_im, b_re, b_im, x0=None, *, chunk=None, validate=False, out=None,
                           algo="auto", last=None):
    """Complex pd_scan with D, b as real/imaginary planes (float32, bfloat16, or D float32 with b bfloat16); returns
    (x_re, x_im) in b's dtype. `last`: (re, im) float32 [S, N] tensors that receive the final state."""
    S, L, N = _check_common(P, (D_re, D_im, b_re, b_im), x0, ("D_re", "D_im", "b_re", "b_im"), one_dtype=False)
    form = _split_form((("D_re", D_re), ("D_im", D_im)), (("b_re", b_re), ("b_im", b_im)))
    Pc = _idx(P, N, validate)
    Dr, Di, br, bi = (t.contiguous() for t in (D_re, D_im, b_re, b_im))
    xr, xi = (torch.empty_like(br), torch.empty_like(bi)) if out is None else out
    if L == 0 or S == 0:
        if last is not None:
            x0f = torch.zeros(S, N, dtype=torch.complex64, device=P.device) if x0 is None else _x0_fp32(x0, S, N, True)
            last[0].copy_(x0f.real.view(last[0].shape))
            last[1].copy_(x0f.imag.view(last[1].shape))
        return xr, xi
    x0c = _x0_fp32(x0, S, N, True)
    ptrs = [Pc.data_ptr(), Dr.data_ptr(), Di.data_ptr(), br.data_ptr(), bi.data_ptr(), 0, 0,
            xr.data_ptr(), xi.data_ptr(), 0, 0]
    incl = _run(_SPLIT, form, False, S, L, N, ptrs, x0c, None, P.device, chunk, algo)
    if last is not None:
        last[0].copy_(incl[:, -1, :, 0].view(last[0].shape))
        last[1].copy_(incl[:, -1, :, 1].view(last[1].shape))
    return xr, xi


def pd_scan_bwd_cuda_split(P, D_re, D_im, x0, x_re, x_im, g_re, g_im, *, chunk=None, validate=False, out=None):
    """Backward of the split form: (gD_re, gD_im, gb_re, gb_im, gx0); gD, gb in x's dtype (the forward's form: D
    float32 with x, g bfloat16 is the mixed one); gx0 complex64 (None without x0)."""
    names = ("D_re", "D_im", "x_re", "x_im", "g_re", "g_im")
    planes = (D_re, D_im, x_re, x_im, g_re, g_im)
    S, L, N = _check_common(P, planes, x0, names, one_dtype=False)
    form = _split_form(tuple(zip(names[:2], planes[:2])), tuple(zip(names[2:], planes[2:])))
    Pc = _idx(P, N, validate)
    Dr, Di, xr, xi, gr, gi = (t.contiguous() for t in (D_re, D_im, x_re, x_im, g_re, g_im))
    if out is None:
        gDr, gDi, gbr, gbi = (torch.empty_like(t) for t in (xr, xi, xr, xi))
    else:
        gDr, gDi, gbr, gbi = out
    x0c = _x0_fp32(x0, S, N, True)
    gx0 = None if x0 is None else torch.empty_like(x0c)
    if L == 0 or S == 0:
        return gDr, gDi, gbr, gbi, None if x0 is None else torch.zeros_like(x0)
    ptrs = [Pc.data_ptr(), Dr.data_ptr(), Di.data_ptr(), gr.data_ptr(), gi.data_ptr(), xr.data_ptr(),
            xi.data_ptr(), gbr.data_ptr(), gbi.data_ptr(), gDr.data_ptr(), gDi.data_ptr()]
    _run(_SPLIT, form, True, S, L, N, ptrs, x0c, gx0, P.device, chunk)
    return gDr, gDi, gbr, gbi, None if x0 is None else gx0.reshape(x0.shape).to(x0.dtype)

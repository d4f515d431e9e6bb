"""`pd_scan`: the Flash PD-SSM recurrence x_t = P_t D_t x_{t-1} + b_t with column one-hot P_t.

Dispatch: CUDA tensors use the bundled CUDA kernels when they build (see `cuda.py`); everything else, and CUDA
when the kernels are unavailable, uses the chunked torch path. Both share one autograd contract.
"""

from __future__ import annotations

import torch

from .. import fast_path
from .chunked import scan_backward, scan_forward
from .naive import pd_scan_dense, pd_scan_naive

__all__ = ["pd_scan", "pd_scan_backward", "pd_scan_naive", "pd_scan_dense", "check_pd_inputs", "check_index_range"]

_INT_DTYPES = (torch.int16, torch.int32, torch.int64)


def check_index_range(P: torch.Tensor, N: int, who: str = "pd_scan") -> None:
    """Raise a ValueError unless every value of P lies in [0, N). One aminmax and one host sync, on any device.
    Callers run it before P is narrowed to the kernels' int16, so no wide value can wrap into range unseen."""
    if P.numel():
        lo, hi = torch.stack(torch.aminmax(P)).tolist()
        if lo < 0 or hi >= N:
            raise ValueError(f"{who}: P values must lie in [0, N={N}), got range [{lo}, {hi}]")


def check_chunk_size(chunk_size) -> None:
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"pd_scan: chunk_size must be a positive int or None (automatic), got {chunk_size!r}")


def check_pd_inputs(P, D, b, x0=None, check_values: bool = True) -> None:
    """Raise a clear TypeError/ValueError for inputs that break the pd_scan contract. check_values: also P's
    range (`check_index_range`, a host sync); callers whose P is in range by construction pass False."""
    for name, t in (("P", P), ("D", D), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"pd_scan: {name} must be a torch.Tensor, got {type(t).__name__}")
    if P.dtype not in _INT_DTYPES:
        raise TypeError(f"pd_scan: P must be an integer tensor (int16, int32 or int64), got {P.dtype}")
    if D.dtype != b.dtype:
        raise TypeError(f"pd_scan: D and b must have the same dtype, got D {D.dtype} and b {b.dtype}")
    if not (b.is_floating_point() or b.is_complex()):
        raise TypeError(f"pd_scan: D and b must be real floating or complex, got {b.dtype}")
    if b.dim() < 2:
        raise ValueError(f"pd_scan: b must be [..., L, N], got shape {tuple(b.shape)}")
    if b.shape[-1] == 0:
        raise ValueError(f"pd_scan: the state size N (last dim of P, D, b) must be >= 1, got shape {tuple(b.shape)}")
    if P.shape != b.shape or D.shape != b.shape:
        raise ValueError(f"pd_scan: P, D and b must share one shape [..., L, N]; got P {tuple(P.shape)}, "
                         f"D {tuple(D.shape)}, b {tuple(b.shape)}")
    if not (P.device == D.device == b.device):
        raise ValueError(f"pd_scan: P, D, b must be on one device, got {P.device}, {D.device}, {b.device}")
    if x0 is not None:
        if not isinstance(x0, torch.Tensor):
            raise TypeError(f"pd_scan: x0 must be a torch.Tensor or None, got {type(x0).__name__}")
        if x0.device != b.device:
            raise ValueError(f"pd_scan: x0 is on {x0.device}, P, D and b on {b.device}")
        want = b.shape[:-2] + b.shape[-1:]
        if x0.shape != want:
            raise ValueError(f"pd_scan: x0 must have shape {tuple(want)} ([..., N]), got {tuple(x0.shape)}")
        if x0.dtype != b.dtype:
            raise TypeError(f"pd_scan: x0 must have the dtype of b ({b.dtype}), got {x0.dtype}")
    if check_values:
        check_index_range(P, b.shape[-1])


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _use_cuda_kernels(t: torch.Tensor) -> bool:
    """The bundled kernels for this b or x ([..., L, N]): their dtypes (not float64), N <= 1024, built."""
    from . import cuda
    return fast_path.cuda_fast_path(t, dtypes=cuda.SUPPORTED_DTYPES, max_state=cuda.MAX_N, scan_kernels=True)


class _PDScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, P, D, b, x0, chunk):
        L, N = b.shape[-2:]
        Pf = P.reshape(-1, L, N)
        Df, bf = D.reshape(-1, L, N), b.reshape(-1, L, N)
        x0f = None if x0 is None else x0.reshape(-1, N)
        use_cuda = _use_cuda_kernels(b)
        if use_cuda:
            from .cuda import pd_scan_fwd_cuda
            x = pd_scan_fwd_cuda(Pf, Df, bf, x0f)
        else:
            cd = _compute_dtype(b.dtype)
            x = scan_forward(Pf.long(), Df.to(cd), bf.to(cd), None if x0f is None else x0f.to(cd), chunk)
            x = x.to(b.dtype)
        ctx.save_for_backward(Pf, Df, x0f, x)
        ctx.shape, ctx.chunk = b.shape, chunk
        return x.reshape(b.shape)

    @staticmethod
    def backward(ctx, grad_x):
        Pf, Df, x0f, x = ctx.saved_tensors
        L, N = ctx.shape[-2:]
        gD, gb, gx0 = pd_scan_backward(Pf, Df, x0f, x, grad_x.reshape(-1, L, N), ctx.chunk, check_values=False)
        gD = gD.to(Df.dtype).reshape(ctx.shape)
        gb = gb.to(x.dtype).reshape(ctx.shape)
        gx0 = None if gx0 is None else gx0.to(x.dtype).reshape(ctx.shape[:-2] + ctx.shape[-1:])
        return None, gD, gb, gx0, None


def pd_scan(P: torch.Tensor, D: torch.Tensor, b: torch.Tensor, x0: torch.Tensor | None = None, *,
            chunk_size: int | None = None, check_values: bool = True) -> torch.Tensor:
    """x_t[n] = b_t[n] + sum_{m: P_t[m]=n} D_t[m] x_{t-1}[m], x_{-1} = x0 (zeros if None).

    P: int16/int32/int64 [..., L, N] with values in [0, N); D, b: [..., L, N], same dtype (real or complex);
    x0: [..., N]. Returns x [..., L, N] in b's dtype (half inputs are computed in float32).
    Differentiable in D, b and x0; the backward is the reverse-time gather recurrence.
    chunk_size: steps per chunk of the torch path (None: automatic). check_values: P values outside [0, N) are
    a ValueError on every device (one aminmax and a host sync); callers whose P is in range by construction
    (argmaxes) pass False to keep the step free of syncs.
    """
    check_pd_inputs(P, D, b, x0, check_values)
    check_chunk_size(chunk_size)
    if b.shape[-2] == 0:
        return b.clone()
    return _PDScan.apply(P, D, b, x0, chunk_size)


def pd_scan_backward(P, D, x0, x, grad_x, chunk_size: int | None = None, *, check_values: bool = True):
    """(grad_D, grad_b, grad_x0) for given forward output x and upstream grad_x, all [..., L, N].
    check_values as in `pd_scan`."""
    L, N = x.shape[-2:]
    check_chunk_size(chunk_size)
    if check_values:
        check_index_range(P, N)
    shape = x.shape
    Pf, Df, xf, g = (t.reshape(-1, L, N) for t in (P, D, x, grad_x))
    x0f = None if x0 is None else x0.reshape(-1, N)
    if _use_cuda_kernels(x):
        from .cuda import pd_scan_bwd_cuda
        gD, gb, gx0 = pd_scan_bwd_cuda(Pf, Df, x0f, xf, g.contiguous())
    else:
        cd = _compute_dtype(x.dtype)
        gD, gb, gx0 = scan_backward(Pf.long(), Df.to(cd), None if x0f is None else x0f.to(cd), xf.to(cd),
                                    g.to(cd), chunk_size)
    gx0 = None if gx0 is None else gx0.reshape(shape[:-2] + shape[-1:])
    return gD.reshape(shape), gb.reshape(shape), gx0

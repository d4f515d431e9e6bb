"""The one answer to "may a CUDA fast path run for this tensor?", for every op of this package that has one.

The paths differ only in what they need, passed as arguments: the pd_scan kernels take their dtypes up to a state
size of 1024 and need the bundled extension built; the straight-through gradient kernels and the mixers' block
kernels (gated RMSNorm, conv + SiLU) need Triton; the fused layer middle needs both. Anything else (CPU tensors,
float64, a failed build, no Triton) takes the torch path. (Mamba2 and DeltaNet ask for their libraries' kernels
through their own `backend`.)
"""

from __future__ import annotations

import functools

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)   # activations the Triton kernels take


@functools.cache
def triton_imports() -> bool:
    """Whether Triton imports (cached)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


def cuda_fast_path(t: torch.Tensor, *, dtypes=None, max_state: int | None = None, scan_kernels: bool = False,
                   triton: bool = False) -> bool:
    """True when `t` is a CUDA tensor of one of `dtypes` (None: any) whose last dim, the state size, is at most
    `max_state` (None: any), and what the path needs is there: `scan_kernels` the pd_scan CUDA extension (built on
    first ask, `pd_scan.cuda.available`), `triton` an importable Triton. Never raises."""
    if not t.is_cuda or (dtypes is not None and t.dtype not in dtypes):
        return False
    if max_state is not None and (t.dim() < 2 or t.shape[-1] > max_state):
        return False
    if triton and not triton_imports():
        return False
    if scan_kernels:
        from .pd_scan import cuda
        return cuda.available()
    return True

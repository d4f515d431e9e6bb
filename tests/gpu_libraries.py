"""The check shared by the CUDA tests of the mamba2 / deltanet library layers (mamba-ssm, fla: the `gpu` extra)."""

import importlib.metadata

import pytest

DISTRIBUTIONS = {"mamba2": ("mamba-ssm",), "deltanet": ("flash-linear-attention", "fla-core")}


def require_gpu_library(kind: str):
    """The library's kernels for `kind` (call only with CUDA present). Skips where none of the `gpu` extra's
    distributions for it is installed; fails where one is installed but its kernels do not load, so that a broken
    install shows as a failure, not as a skip."""
    from llm_surgery.layers import deltanet, mamba2
    if not any(_installed(d) for d in DISTRIBUTIONS[kind]):
        pytest.skip(f"{' / '.join(DISTRIBUTIONS[kind])} not installed (the gpu extra: pip install 'llm-surgery[gpu]')")
    kernels = mamba2.mamba_kernels() if kind == "mamba2" else deltanet.fla_kernels()
    assert kernels is not None, f"{DISTRIBUTIONS[kind][0]} is installed but its kernels do not load (see the warnings)"
    return kernels


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True

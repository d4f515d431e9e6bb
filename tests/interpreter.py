"""The skip shared by the tests that run this package's Triton kernels under Triton's interpreter (on the CPU)."""

import pytest


def require_interpreter_kernels():
    """Skip unless Triton imports at a version whose interpreter runs these kernels: 3.7 on (the test extra's bound;
    a GPU image's 3.6, for one, runs them in its CUDA tests instead)."""
    triton = pytest.importorskip("triton", reason="the interpreter needs the triton package (pip install -e '.[test]')")
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 7):
        pytest.skip("Triton's interpreter runs these kernels from 3.7 on (the test extra's bound)")

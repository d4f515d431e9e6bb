"""The skip shared by the tests that run this package's Triton kernels under Triton's interpreter (on the CPU)."""

import os
import subprocess
import sys

import pytest


def require_interpreter_kernels():
    """Skip unless Triton imports at a version whose interpreter runs these kernels: 3.7 on (the test extra's bound;
    a GPU image's 3.6, for one, runs them in its CUDA tests instead)."""
    triton = pytest.importorskip("triton", reason="the interpreter needs the triton package (pip install -e '.[test]')")
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 7):
        pytest.skip("Triton's interpreter runs these kernels from 3.7 on (the test extra's bound)")


def run_interpreted(code: str) -> str:
    """The last line `code` prints, run in a subprocess under Triton's interpreter (TRITON_INTERPRET=1); fails the
    test with the subprocess's stderr if it exits non-zero."""
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TRITON_INTERPRET="1"),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]

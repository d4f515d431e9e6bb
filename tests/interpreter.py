"""What the tests that run this package's Triton kernels under Triton's interpreter (on the CPU) share."""

import os
import subprocess
import sys

import pytest
import torch


def import_triton():
    """Triton, which the `test` extra installs on Linux: imported there (a missing one fails the test), skipped
    elsewhere (no Triton wheels)."""
    if sys.platform.startswith("linux"):
        import triton
        return triton
    return pytest.importorskip("triton", reason="Triton has wheels for Linux only")


def require_interpreter_kernels():
    """Triton at a version whose interpreter runs these kernels: 3.7 on (the test extra's bound). Skipped under an
    older one only where CUDA runs the kernels instead (a GPU image's 3.6); without a GPU, an older Triton fails."""
    triton = import_triton()
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 7):
        if torch.cuda.is_available():
            pytest.skip(f"Triton {triton.__version__}'s interpreter cannot run these kernels; the CUDA tests run them")
        pytest.fail(f"Triton {triton.__version__} is older than the test extra's 3.7 (pip install -e '.[test]')")


def run_interpreted(code: str) -> str:
    """The last line `code` prints, run in a subprocess under Triton's interpreter (TRITON_INTERPRET=1); fails the
    test with the subprocess's stderr if it exits non-zero."""
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TRITON_INTERPRET="1"),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]

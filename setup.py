"""Setuptools hook: bundle the CUDA sources in kernels/ into the wheel as llm_surgery/_kernels/ (package data).

Everything else about the package lives in pyproject.toml. Editable installs read kernels/ directly.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

KERNEL_SUFFIXES = (".cu", ".cuh", ".cpp")


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        src = Path(__file__).resolve().parent / "kernels"
        if not src.is_dir():  # building from an sdist that already carries llm_surgery/_kernels
            return
        dst = Path(self.build_lib) / "llm_surgery" / "_kernels"
        dst.mkdir(parents=True, exist_ok=True)
        for f in sorted(src.iterdir()):
            if f.suffix in KERNEL_SUFFIXES:
                shutil.copy2(f, dst / f.name)


setup(cmdclass={"build_py": BuildPyWithKernels})

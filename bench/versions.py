"""What every bench script records beside its numbers: python, the packages it ran with, and the GPU. One lookup,
so that every raw output names the same packages the same way; a package not installed is None."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import sys

PACKAGES = ("torch", "triton", "transformers", "accelerate", "flash-linear-attention", "fla-core", "mamba-ssm",
            "causal-conv1d")


def installed(dist: str) -> str | None:
    """The installed version of distribution `dist`, or None."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions(packages: tuple[str, ...] = PACKAGES) -> dict:
    """python, each package's version, the GPU's name (None without CUDA) and the CPU count. Imports torch."""
    import torch

    return {"python": platform.python_version(), **{p: installed(p) for p in packages},
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "cpus": os.cpu_count()}


def versions_in_child() -> dict:
    """versions() as another interpreter reads them: for a driver that must neither import torch nor start CUDA."""
    res = subprocess.run([sys.executable, __file__], capture_output=True, text=True)
    return json.loads(res.stdout) if res.returncode == 0 else {"error": res.stderr.strip()[-300:]}


if __name__ == "__main__":
    print(json.dumps(versions()))

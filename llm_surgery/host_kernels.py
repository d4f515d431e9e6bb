"""Run the host's own Mamba2 layers on mamba-ssm's Triton kernels on CUDA.

transformers picks a Mamba2 implementation for Granite-4.0 / Nemotron-H (and Falcon-H1, Bamba, Zamba2) once, when
their modeling module is imported: mamba-ssm if its *package* imports, else a plain torch reference. A Triton-only
mamba-ssm install (no compiled `selective_scan_cuda`, the usual offline case) fails that import, so a frozen host's
36-odd Mamba2 layers run the torch reference: measured on an H200, a random-weight granite-4.0-h-micro trained 183 tokens/s
per GPU with 69 GiB peak (docs/bench/train.md). The SSD chunk scan and the decode update need no compiled code:
`layers.mamba2.mamba_kernels()` loads them, and this module points the host modules' module-level functions at
them for CUDA tensors (CPU tensors keep the reference). The fused training path
(`mamba2_split_conv1d_scan_combined`) needs compiled causal_conv1d; left alone, it keeps returning None and the
layer takes the unfused path (torch conv, then the Triton chunk scan).
"""

from __future__ import annotations

import functools
import importlib
import inspect

# modeling modules whose Mamba2 (or other convolution-carrying) layers call these module-level functions at run time;
# a module without one of the functions is left alone for that function
HOST_MODULES = tuple(f"transformers.models.{m}.modeling_{m}" for m in (
    "granitemoehybrid", "nemotron_h", "falcon_h1", "bamba", "zamba2", "jamba", "qwen3_next", "qwen3_5", "lfm2",
    "olmo_hybrid"))
_PATCHED = "_llm_surgery_cuda_kernel"


def _on_cuda(args, kwargs) -> bool:
    first = args[0] if args else next(iter(kwargs.values()), None)
    return getattr(first, "is_cuda", False)


def _route(reference, kernel):
    """`kernel` for CUDA inputs, `reference` otherwise. The layers pass their forward's extra keyword arguments
    through; the kernel gets only those it takes (as transformers does for its own implementations)."""
    takes = set(inspect.signature(kernel).parameters)

    @functools.wraps(reference)
    def call(*args, **kwargs):
        if _on_cuda(args, kwargs):
            return kernel(*args, **{k: v for k, v in kwargs.items() if k in takes})
        return reference(*args, **kwargs)
    setattr(call, _PATCHED, True)
    return call


def _route_in_hosts(routes: dict) -> dict[str, list[str]]:
    """For every host module and each of its functions named in `routes` (name -> (function -> (reference,
    kernel)), or None to leave it), put `_route(reference, kernel)` in its place, once (idempotent). Returns
    {module's short name: the names routed, now or before}."""
    done = {}
    for name in HOST_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        for attr, pair in routes.items():
            fn = getattr(mod, attr, None)
            if fn is None:
                continue
            if not getattr(fn, _PATCHED, False):
                reference_and_kernel = pair(fn)
                if reference_and_kernel is None:
                    continue
                setattr(mod, attr, _route(*reference_and_kernel))
            done.setdefault(name.rsplit(".", 1)[-1], []).append(attr)
    return done


def keep_cpu_convolutions_in_torch() -> list[str]:
    """Where causal-conv1d (or fla) is installed, transformers' hybrid layers call its CUDA-only kernels for CPU
    tensors too (a host moved to the CPU fails with "Expected x.is_cuda() to be true", or Triton's "cannot be
    accessed from Triton (cpu tensor?)" in Qwen3-Next's gated delta rule): send CPU tensors to the torch function
    that transformers' decorator wraps. Idempotent; returns the functions routed ("module.function")."""
    wrapped = lambda fn: None if getattr(fn, "__wrapped__", None) is None else (fn.__wrapped__, fn)  # noqa: E731
    done = _route_in_hosts({name: wrapped for name in ("causal_conv1d_fn", "causal_conv1d_update",
                                                       "torch_chunk_gated_delta_rule",
                                                       "torch_recurrent_gated_delta_rule")})
    return [f"{module}.{attr}" for module, attrs in done.items() for attr in attrs]


def use_mamba_kernels_for_hosts() -> str:
    """Route the hosts' Mamba2 chunk scan and decode step to mamba-ssm's Triton kernels for CUDA tensors (and their
    convolutions on CPU tensors to torch, `keep_cpu_convolutions_in_torch`).

    Idempotent. Returns one line for the log saying what runs the host's Mamba2 layers."""
    from .layers.mamba2 import mamba_kernels

    keep_cpu_convolutions_in_torch()
    kernels = mamba_kernels()
    if kernels is None:
        return "host Mamba2 layers: torch reference (mamba-ssm's Triton kernels did not import)"
    chunk_scan, state_update = kernels
    done = _route_in_hosts({"mamba2_chunk_scan": lambda fn: (fn, chunk_scan),
                            "mamba2_selective_state_update": lambda fn: (fn, state_update)})
    done = [f"{module} ({', '.join(attrs)})" for module, attrs in done.items()]
    if not done:
        return "host Mamba2 layers: torch reference (this transformers has no mamba2_chunk_scan to route)"
    return "host Mamba2 layers on mamba-ssm Triton kernels for CUDA tensors: " + "; ".join(done)

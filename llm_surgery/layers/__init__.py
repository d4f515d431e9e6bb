"""Sequence mixers with one interface (docs/design.md): Flash PD-SSM, Mamba2 and DeltaNet."""

from .flash_pdssm import FlashPDSSM, tau_schedule

_LAZY = {"Mamba2Mixer": "mamba2", "DeltaNetMixer": "deltanet", "build_mixer": "registry",
         "default_options": "registry", "MIXER_KINDS": "registry"}

__all__ = ["FlashPDSSM", "tau_schedule", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

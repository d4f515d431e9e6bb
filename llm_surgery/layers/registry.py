"""One place that builds any mixer kind, with defaults scaled from the host width so that the three kinds
have (nearly) the same parameter count at every width; comparisons between kinds are then fair."""

from __future__ import annotations

import importlib
import inspect
from functools import lru_cache

import torch
from torch import nn

# The one list of mixer kinds: kind -> (module of this package, class). The trainer's --kind, the surgery's checks
# and the parameter tables all read it from here.
_MIXERS = {"pdssm": ("flash_pdssm", "FlashPDSSM"), "mamba2": ("mamba2", "Mamba2Mixer"),
           "deltanet": ("deltanet", "DeltaNetMixer")}
MIXER_KINDS = tuple(_MIXERS)


def check_kind(kind) -> None:
    """Raise a ValueError naming the allowed kinds unless `kind` is one of MIXER_KINDS."""
    if not isinstance(kind, str) or kind not in _MIXERS:
        raise ValueError(f"unknown mixer kind {kind!r}; allowed kinds: {', '.join(MIXER_KINDS)}")


def mixer_class(kind: str) -> type[nn.Module]:
    """The class that builds `kind`, imported on first use (FlashPDSSM may pull in compiled ops)."""
    check_kind(kind)
    module, name = _MIXERS[kind]
    return getattr(importlib.import_module(f".{module}", __package__), name)


def constructor_options(kind: str) -> set[str]:
    """The keyword options `kind`'s constructor takes, but the width, which the surgery passes itself."""
    params = inspect.signature(mixer_class(kind).__init__).parameters
    return {n for n, p in params.items() if n not in ("self", "hidden_size")
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _check_width(hidden_size) -> None:
    if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
        raise ValueError(f"hidden_size must be a positive int, got {hidden_size!r}")


def count_params(kind: str, hidden_size: int, **options) -> int:
    """Parameter count of `build_mixer(kind, hidden_size, **options)`, built on the meta device (no memory,
    no init cost), falling back to a real CPU build for layers whose init needs real values."""
    cls = mixer_class(kind)
    try:
        with torch.device("meta"):
            module = cls(hidden_size, **options)
    except (NotImplementedError, RuntimeError):
        with torch.no_grad():
            module = cls(hidden_size, **options)
    return sum(p.numel() for p in module.parameters())


@lru_cache(maxsize=None)
def target_param_count(hidden_size: int) -> int:
    """The count all kinds are matched to: FlashPDSSM's default count."""
    _check_width(hidden_size)
    return count_params("pdssm", hidden_size)


def _heads_for(kind: str, hidden_size: int, target: int, **fixed) -> int:
    """The head count whose parameter count is closest to `target` (counts are affine in the head count)."""
    c1 = count_params(kind, hidden_size, num_heads=1, **fixed)
    c2 = count_params(kind, hidden_size, num_heads=2, **fixed)
    return max(1, round(1 + (target - c1) / (c2 - c1)))


@lru_cache(maxsize=None)
def _default_options(kind: str, hidden_size: int) -> tuple:
    if kind == "pdssm":
        return ()  # FlashPDSSM's own defaults define the target
    target = target_param_count(hidden_size)
    if kind == "mamba2" and hidden_size % 32 == 0:
        # mamba-ssm's Mamba2 defaults (expand 2, head_dim 64, state 128), which its module needs to hold the layer
        # (an integer expand); the B/C groups (a divisor of the heads) set the count
        fixed = dict(head_dim=64, state_size=128, conv_kernel=4, num_heads=hidden_size // 32)
        fixed["n_groups"] = min((g for g in range(1, fixed["num_heads"] + 1) if fixed["num_heads"] % g == 0),
                                key=lambda g: abs(count_params(kind, hidden_size, n_groups=g, **fixed) - target))
        return tuple(sorted(fixed.items()))
    if kind == "mamba2":  # widths mamba-ssm's module cannot hold at expand 2: heads set the width
        fixed = dict(head_dim=64, state_size=128, n_groups=1, conv_kernel=4)
    else:  # deltanet: key/value heads of 64 (128 from width 2048 on, as in larger fla models)
        fixed = dict(head_dim=64 if hidden_size < 2048 else 128, conv_kernel=4)
    fixed["num_heads"] = _heads_for(kind, hidden_size, target, **fixed)
    return tuple(sorted(fixed.items()))


def default_options(kind: str, hidden_size: int) -> dict:
    """Constructor options for `kind` at host width `hidden_size`, parameter-matched across kinds."""
    check_kind(kind)
    _check_width(hidden_size)
    return dict(_default_options(kind, hidden_size))


def build_mixer(kind: str, hidden_size: int, **options) -> nn.Module:
    """Build a mixer of `kind` ("pdssm", "mamba2" or "deltanet"); `options` override the defaults."""
    cls = mixer_class(kind)
    _check_width(hidden_size)
    return cls(hidden_size, **{**default_options(kind, hidden_size), **options})


def param_table(widths=(768, 1024, 1536, 2048, 4096, 4480, 5120)) -> str:
    """Markdown table of default parameter counts per kind and width (millions), with the options used."""
    rows = ["| width | pdssm | mamba2 | deltanet | max diff vs target |", "| --- | --- | --- | --- | --- |"]
    for d in widths:
        target = target_param_count(d)
        cells, worst = [], 0.0
        for kind in MIXER_KINDS:
            opts = default_options(kind, d)
            n = count_params(kind, d, **opts)
            worst = max(worst, abs(n - target) / target)
            desc = ", ".join(f"{k}={v}" for k, v in opts.items()
                             if k in ("num_heads", "head_dim", "state_size", "n_groups"))
            cells.append(f"{n / 1e6:.2f}M ({desc})" if desc else f"{n / 1e6:.2f}M")
        rows.append(f"| {d} | " + " | ".join(cells) + f" | {100 * worst:.1f}% |")
    return "\n".join(rows)

"""Quick Triton autotuning: every autotuner keeps the leanest config that compiles and runs.

mamba-ssm's and fla's kernels autotune on their first call per shape key; timing all configs costs about two
minutes per kernel on a cold machine, more than a benchmark or a short GPU job can spend. Timings taken this way
are of untuned configs and are reported as such. The patch is process-wide and idempotent.

Configs are tried leanest first (stages x block sizes, a proxy for shared memory). Keeping the first *listed*
config instead, a 2 x H200 run died twice on one rank in mamba-ssm's `_chunk_scan_fwd_kernel`, whose first
config (3 stages of 128 x 256 x 64 tiles) needed 279,552 bytes of shared memory of 232,448 there, while the
other rank and a 1-GPU run had run it (presumably a variant that Triton compiled for other argument alignments
under the same autotune key); leanest first, the same run completed (docs/bench/train.md).
"""

from __future__ import annotations

import math

_PATCHED = []


def config_size(config) -> tuple:
    """Sort key, leanest first: pipeline stages times the product of the integer block sizes (a proxy for the
    shared memory a config pipelines), then warps."""
    blocks = math.prod(v for v in config.kwargs.values() if isinstance(v, int) and not isinstance(v, bool)) or 1
    return (max(1, config.num_stages or 1) * blocks, config.num_warps or 0)


def quick_autotune() -> bool:
    """Patch Triton's Autotuner (False when Triton is not importable)."""
    if _PATCHED:
        return True
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        return False
    prune, bench = Autotuner.prune_configs, Autotuner._bench

    def prune_configs(self, kwargs, *args, **kw):
        self._quick_found = False
        return sorted(prune(self, kwargs, *args, **kw), key=config_size)

    def _bench(self, *args, config, **meta):
        if getattr(self, "_quick_found", False):
            return [float("inf")] * 3
        timing = bench(self, *args, config=config, **meta)
        self._quick_found = math.isfinite(timing[0] if isinstance(timing, (list, tuple)) else timing)
        return timing

    Autotuner.prune_configs, Autotuner._bench = prune_configs, _bench
    _PATCHED.append(True)
    return True

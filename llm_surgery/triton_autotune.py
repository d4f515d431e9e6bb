"""Quick Triton autotuning: every autotuner keeps the first config that compiles and runs.

mamba-ssm's and fla's kernels autotune on their first call per shape key; timing all configs costs about two
minutes per kernel on a cold machine, more than a benchmark or a short GPU job can spend. Timings taken this way
are of untuned configs and are reported as such. The patch is process-wide and idempotent.
"""

from __future__ import annotations

import math

_PATCHED = []


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
        return prune(self, kwargs, *args, **kw)

    def _bench(self, *args, config, **meta):
        if getattr(self, "_quick_found", False):
            return [float("inf")] * 3
        timing = bench(self, *args, config=config, **meta)
        self._quick_found = math.isfinite(timing[0] if isinstance(timing, (list, tuple)) else timing)
        return timing

    Autotuner.prune_configs, Autotuner._bench = prune_configs, _bench
    _PATCHED.append(True)
    return True

"""Triton autotuning for short runs: choices kept on disk across processes, configs compiled in parallel, and an
optional quick mode. All three patch Triton's `Autotuner` process-wide and idempotently; they change which config
runs, never a kernel's code.

`persistent_autotune()` (the trainer's default on CUDA). mamba-ssm's and fla's kernels autotune on their first call
per tuning key: each config is compiled and timed. On a fresh H200 the host's Mamba2 forward alone spent 42 s so
(46 compilations, 38 s of them compiling; docs/bench/data/startup_h200_2026-11-29.md), and every later process
paid the timing again. Triton's own on-disk autotune cache (`cache_results=True` / TRITON_CACHE_AUTOTUNING, read
from Triton 3.6's source) skips every kernel with a config `pre_hook`, which most of mamba-ssm's backward kernels
have. Here every tuning round's choice is stored (`~/.cache/llm_surgery/autotune`, or LLM_SURGERY_AUTOTUNE_CACHE)
under the Triton version, the GPU's name, the kernel's source hash, the tuning key and the candidate configs, and a
later process with the same ones takes it without timing anything. `retune=True` (the trainer's `--retune`, or
LLM_SURGERY_RETUNE=1) times the configs again and replaces the stored choice. A round that does time its configs
compiles them first in parallel threads (Triton's compiler releases the GIL: 4 kernels compiled in 1.33 s one
after another took 0.38 s in 4 threads on the H200 machine; docs/bench/data/startup_h200_2026-11-29.md), then
times them one by one as Triton does: the host's Mamba2 forward tuning above took 14.4 s so instead of 42.

`quick_autotune()`: every autotuner keeps the leanest config that compiles and runs. Timing all configs costs
about two minutes per kernel on a cold machine, more than a benchmark or a short GPU job can spend. Timings taken
this way are of untuned configs and are reported as such. Configs are tried leanest first (stages x block sizes, a
proxy for shared memory). Keeping the first *listed* config instead, a 2 x H200 run died twice on one rank in
mamba-ssm's `_chunk_scan_fwd_kernel`, whose first config (3 stages of 128 x 256 x 64 tiles) needed 279,552 bytes of
shared memory of 232,448 there, while the other rank and a 1-GPU run had run it (presumably a variant that Triton
compiled for other argument alignments under the same autotune key); leanest first, the same run completed
(docs/bench/train.md). Quick choices are stored apart from full ones.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_PATCHED = []      # quick_autotune applied
_PERSISTED = {}    # persistent_autotune's settings once applied: {"dir": Path, "retune": bool}
CACHE_ENV, RETUNE_ENV = "LLM_SURGERY_AUTOTUNE_CACHE", "LLM_SURGERY_RETUNE"
MAX_COMPILE_THREADS = 8


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


def autotune_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "llm_surgery" / "autotune")


def _kernel(autotuner) -> tuple[str, str]:
    """(name, hash of its source and the functions it calls): the JIT function's own cache key, or under Triton's
    interpreter (no JIT function) a hash of the Python source."""
    fn = autotuner.fn
    while not hasattr(fn, "cache_key") and hasattr(fn, "fn"):  # through @triton.heuristics, the interpreter
        fn = fn.fn
    if hasattr(fn, "cache_key"):
        return fn.__name__, fn.cache_key
    return fn.__name__, hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()


def _device() -> str:
    """The GPU the choice was timed on (its name: two GPUs of one architecture tune apart), or the interpreter."""
    if _interpreting():
        return "interpreter"
    import torch
    from triton.runtime import driver

    return f"{driver.active.get_current_target()} {torch.cuda.get_device_name()}"


def _interpreting() -> bool:
    from triton import knobs

    return bool(knobs.runtime.interpret)


def _entry(autotuner, tuning_key, configs) -> Path:
    """The file of one tuning round: named by the kernel, hashed over all that decides its outcome."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.runtime.cache import triton_key

    name, source = _kernel(autotuner)
    parts = [triton_key(), _device(), source, str(sorted(get_cache_invalidating_env_vars().items())),
             "quick" if _PATCHED else "full", str(tuning_key)] + [str(c) for c in configs]
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]
    return _PERSISTED["dir"] / f"{name[:100]}-{digest}.json"


def _stored_choice(path: Path, configs):
    try:
        record = json.loads(path.read_text())
        index = record["choice"]
        if record["configs"] == [str(c) for c in configs]:
            return configs[index]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        pass  # missing, partly written by a killed process, or from another layout: tune again
    return None


def _store(path: Path, autotuner, tuning_key, configs, best) -> None:
    timings = getattr(autotuner, "configs_timings", {}) or {}
    record = {"kernel": _kernel(autotuner)[0], "key": str(tuning_key),
              "configs": [str(c) for c in configs], "choice": next(i for i, c in enumerate(configs) if c is best),
              "ms": [timings.get(c) for c in configs]}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, default=str))
    os.replace(tmp, path)  # atomic: a reader sees the whole record or none


def _compile_all(autotuner, configs, args, meta) -> None:
    """Compile every config without launching it (JIT warm-up) in threads, through Triton's own asynchronous
    compilation (`AsyncCompileMode`: the compiled kernels enter the kernel's cache on this thread). A config that
    fails to compile is left to the timing run, which meets the error again and records the config as failed, as
    Triton does. Without `AsyncCompileMode` (Triton < 3.6) the timing run compiles, one config after another."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return
    workers = min(len(configs), os.cpu_count() or 1, MAX_COMPILE_THREADS)
    with ThreadPoolExecutor(workers, thread_name_prefix="triton-compile") as pool, \
            AsyncCompileMode(pool, ignore_errors=True):
        for config in configs:
            try:
                autotuner.fn.run(*args, **{**meta, **config.all_kwargs(), "warmup": True})
            except Exception:  # noqa: BLE001 - see the docstring
                pass


def persistent_autotune(retune: bool | None = None) -> Path | None:
    """Patch Triton's Autotuner to keep its choices on disk and compile a round's configs in parallel. Returns
    the cache folder, or None where Triton is not importable or lacks the hook (`Autotuner.check_disk_cache`, there
    in Triton 3.6 and 3.9). retune: time every config again and store the new choice (default: LLM_SURGERY_RETUNE=1)."""
    if retune is None:
        retune = os.environ.get(RETUNE_ENV, "").lower() in ("1", "true", "yes")
    if _PERSISTED:
        _PERSISTED["retune"] = retune
        return _PERSISTED["dir"]
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        return None
    if not hasattr(Autotuner, "check_disk_cache"):
        return None
    _PERSISTED.update(dir=autotune_cache_dir(), retune=retune)
    run, prune, bench = Autotuner.run, Autotuner.prune_configs, Autotuner._bench

    def run_persisted(self, *args, **kwargs):
        self.cache_results = True  # Triton then asks check_disk_cache before it times a new tuning key
        return run(self, *args, **kwargs)

    def check_disk_cache(self, tuning_key, configs, bench_fn):
        path = _entry(self, tuning_key, configs)
        best = None if _PERSISTED["retune"] else _stored_choice(path, configs)
        if best is not None:
            self.cache[tuning_key], self.configs_timings = best, {}
            return True
        bench_fn()
        _store(path, self, tuning_key, configs, self.cache[tuning_key])
        return False

    def prune_configs(self, kwargs, *args, **kw):
        configs = prune(self, kwargs, *args, **kw)
        self._compile_first = None if _PATCHED else configs  # quick mode times only until one runs
        return configs

    def _bench(self, *args, config, **meta):
        configs, self._compile_first = getattr(self, "_compile_first", None), None
        if configs and len(configs) > 1 and not _interpreting():
            try:
                _compile_all(self, configs, args, meta)
            except Exception:  # noqa: BLE001 - an optimisation only: the timing run compiles what is missing
                pass
        return bench(self, *args, config=config, **meta)

    Autotuner.run, Autotuner.check_disk_cache = run_persisted, check_disk_cache
    Autotuner.prune_configs, Autotuner._bench = prune_configs, _bench
    return _PERSISTED["dir"]

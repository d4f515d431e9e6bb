"""Start-up profile of one training process, for `bench/startup.py --profile` (which puts this folder first on
PYTHONPATH and sets LLM_SURGERY_STARTUP_PROFILE=<json path>); inert without that variable.

Records, from interpreter start: every Triton compilation (kernel, module, milliseconds, cache hit) through
`triton.knobs.compilation.listener`; every autotuner benchmark (kernel, configs timed, seconds, of which compiling)
by wrapping `Autotuner._bench`; and a 10 Hz sample of the main thread's stack (inclusive seconds per function and
per start-up phase). The JSON is rewritten every 2 s, so a process killed after its first step leaves it behind.
"""

import os
import sys
import threading
import time

_PATH = os.environ.get("LLM_SURGERY_STARTUP_PROFILE")
_ACTIVE = bool(_PATH) and "accelerate" not in os.path.basename(sys.argv[0] if sys.argv else "")

# phase = the outermost of these functions on the main thread's stack (file stem, function)
PHASES = (("trainer", "_build_model"), ("evaluate", "evaluate"), ("graphs", "prepare"), ("trainer", "_loop"),
          ("cuda", "_build"), ("setup", "use_cuda_kernels"))


def _install():
    import atexit
    import json
    from collections import Counter, defaultdict

    t0 = time.perf_counter()
    main = threading.main_thread().ident
    compiles, tunes = [], defaultdict(lambda: {"configs": 0, "s": 0.0, "compile_s": 0.0, "calls": 0})
    inclusive, phases, leaf = Counter(), Counter(), Counter()
    state = {"samples": 0, "in_bench": None, "bench_compile": 0.0, "triton_hooked": False}

    def on_compile(src, metadata, metadata_group, times, cache_hit):
        fn = getattr(src, "fn", None)
        module = getattr(getattr(fn, "fn", fn), "__module__", "?")
        ms = times.total / 1000.0
        compiles.append({"t": round(time.perf_counter() - t0, 2), "kernel": getattr(src, "name", "?"),
                         "module": module, "ms": round(ms, 1), "hit": bool(cache_hit)})
        if state["in_bench"] is not None:
            state["bench_compile"] += ms / 1000.0

    def hook_triton():
        if state["triton_hooked"] or "triton" not in sys.modules:
            return
        try:
            import triton
            from triton.runtime.autotuner import Autotuner
        except Exception:
            return
        state["triton_hooked"] = True
        triton.knobs.compilation.listener = on_compile
        bench = Autotuner._bench

        def _bench(self, *args, config, **meta):
            name = f"{getattr(self.base_fn, '__module__', '?')}.{self.base_fn.__name__}"
            state["in_bench"], state["bench_compile"] = name, 0.0
            start = time.perf_counter()
            try:
                return bench(self, *args, config=config, **meta)
            finally:
                rec = tunes[name]
                rec["configs"] += 1
                rec["s"] += time.perf_counter() - start
                rec["compile_s"] += state["bench_compile"]
                state["in_bench"] = None

        Autotuner._bench = _bench

    def dump():
        out = {"elapsed_s": round(time.perf_counter() - t0, 2), "samples": state["samples"], "period_s": 0.1,
               "phases_s": {k: round(v * 0.1, 1) for k, v in phases.most_common()},
               "inclusive_s": {k: round(v * 0.1, 1) for k, v in inclusive.most_common(120)},
               "leaf_s": {k: round(v * 0.1, 1) for k, v in leaf.most_common(40)},
               "autotune": {k: {**v, "s": round(v["s"], 2), "compile_s": round(v["compile_s"], 2)}
                            for k, v in sorted(tunes.items(), key=lambda kv: -kv[1]["s"])},
               "compiles": compiles}
        tmp = f"{_PATH}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=1)
        os.replace(tmp, _PATH)

    def sample():
        last_dump = time.perf_counter()
        while True:
            time.sleep(0.1)
            hook_triton()
            frame = sys._current_frames().get(main)
            if frame is None:
                break
            state["samples"] += 1
            seen, phase = set(), "other"
            top = frame
            while frame is not None:
                code = frame.f_code
                stem = os.path.splitext(os.path.basename(code.co_filename))[0]
                key = f"{stem}:{code.co_name}"
                if key not in seen:
                    seen.add(key)
                    inclusive[key] += 1
                if (stem, code.co_name) in PHASES:
                    phase = key  # the outermost one wins (the walk goes outwards)
                frame = frame.f_back
            phases[phase] += 1
            code = top.f_code
            leaf[f"{os.path.splitext(os.path.basename(code.co_filename))[0]}:{code.co_name}"] += 1
            if time.perf_counter() - last_dump > 2.0:
                last_dump = time.perf_counter()
                try:
                    dump()
                except Exception as exc:  # never break the run being profiled
                    print(f"startup profile: {exc}", file=sys.stderr)

    threading.Thread(target=sample, name="startup-profile", daemon=True).start()
    atexit.register(dump)


if _ACTIVE:
    _install()

"""Layer timing, one layer per process, forward + backward back to back: the method the project's speed targets
are judged by (the subset, for the layers the targets name, of a timing tool kept outside this repository, with
the same method and output, so those figures reproduce from the repository). `layer_compare.py` is the general bench (any
width, every kind in one process, synced or --back-to-back timing).

    export OUT=<dir>                 # results are appended to $OUT/results.jsonl (default: .)
    PYTHONPATH=. python bench/bench_layers.py env
    PYTHONPATH=. python bench/bench_layers.py pdssm --B 32 --L 2048 4096 8192
    PYTHONPATH=. python bench/bench_layers.py deltanet_matched --B 32 --L 2048 4096 8192
    PYTHONPATH=. python bench/bench_layers.py mamba2 --B 32 --L 2048 4096 8192
    PYTHONPATH=. python bench/bench_layers.py table

Layers at width 1024, bf16 parameters and input, train mode: `pdssm` the project's FlashPDSSM at its registry
defaults (7.48M), `deltanet_matched` fla's DeltaNet with 14 heads, expand_k = expand_v = 1.75 (7.38M), `mamba2`
mamba-ssm's Mamba2 at its defaults (d_state 128, headdim 64; 6.60M) on its fused path (causal-conv1d needed).
One step: `loss = layer(x).float().pow(2).mean(); torch.autograd.grad(loss, [x] + params)`. Time: the first call
compiles and autotunes (reported as `1st s`), then 3 untimed steps and 10-60 steps (about 1.5 s) each between its own
CUDA events with no sync between steps; median, min and 80th percentile. The forward alone the same way. Memory:
peak = most allocated during one step above parameters + x (activations, returned gradients, workspaces); saved =
allocated after the forward. Run one process at a time: another process compiling or autotuning on the host
perturbs the timings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback

import torch
from cuda_timing import times_ms
from versions import versions

OUT = os.environ.get("OUT", ".")
RESULTS = os.path.join(OUT, "results.jsonl")
WIDTH = 1024


def log_result(rec: dict):
    rec = dict(rec, t_wall=time.strftime("%H:%M:%S"))
    with open(RESULTS, "a") as f:
        f.write(json.dumps(rec) + "\n")
    print("RESULT", json.dumps(rec), flush=True)


def time_cuda(fn, target_s: float = 1.5, nmin: int = 10, nmax: int = 60) -> dict:
    """Back-to-back timing: 3 untimed calls and one timed alone, then as many calls as fill ~target_s
    (nmin..nmax), each between its own pair of CUDA events, no sync between them."""
    estimate = times_ms(fn, reps=1, warmup=3)[0]
    n = int(min(nmax, max(nmin, target_s / max(estimate / 1e3, 1e-6))))
    ts = times_ms(fn, reps=n, warmup=0, back_to_back=True)
    return {"median_ms": statistics.median(ts), "min_ms": ts[0], "p80_ms": ts[min(n - 1, int(0.8 * n))], "n": n}


class Case:
    """One (layer, B, L): called once in warm() (compile / autotune), timed and measured in measure()."""

    def __init__(self, name: str, layer, B: int, L: int, extra: dict | None = None):
        self.layer, self.B, self.L = layer, B, L
        self.params = [p for p in layer.parameters() if p.requires_grad]
        torch.manual_seed(0)
        self.x = torch.randn(B, L, WIDTH, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        self.rec = {"layer": name, "B": B, "L": L, "D": WIDTH,
                    "params": sum(p.numel() for p in layer.parameters()), **(extra or {})}
        self.failed = False

    def out(self):
        o = self.layer(self.x)
        return o[0] if isinstance(o, (tuple, list)) else o

    def step(self):
        return torch.autograd.grad(self.out().float().pow(2).mean(), [self.x] + self.params)

    def _fail(self, exc: Exception):
        self.failed = True
        self.rec.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:600])
        traceback.print_exc()

    def warm(self):
        try:
            t0 = time.time()
            self.step()
            torch.cuda.synchronize()
            self.rec["first_call_s"] = round(time.time() - t0, 2)
        except Exception as exc:  # noqa: BLE001 - recorded in the results, the other cases still run
            self._fail(exc)

    def measure(self):
        rec = self.rec
        if not self.failed:
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                loss = self.out().float().pow(2).mean()
                torch.cuda.synchronize()
                saved = torch.cuda.memory_allocated() - base
                torch.autograd.grad(loss, [self.x] + self.params)   # the gradients count in the peak, then go
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() - base
                del loss
                rec.update(saved_MiB=round(saved / 2**20, 1), peak_MiB=round(peak / 2**20, 1))
                tb = time_cuda(self.step)
                rec.update({"fb_" + k: (round(v, 4) if isinstance(v, float) else v) for k, v in tb.items()})
                rec["fwd_median_ms"] = round(time_cuda(self.out)["median_ms"], 4)
                rec["Mtok_per_s_fb"] = round(self.B * self.L / (tb["median_ms"] / 1e3) / 1e6, 3)
                rec["ok"] = True
            except Exception as exc:  # noqa: BLE001
                self._fail(exc)
        log_result(rec)
        torch.cuda.empty_cache()


def run_cases(make, args):
    """Build every (B, L) case with make(), warm them all (compile / autotune), then measure them."""
    cases = []
    for B in args.B:
        for L in args.L:
            torch.manual_seed(0)
            cases.append(make(B, L))
    for case in cases:
        case.warm()
    for case in cases:
        case.measure()


def cmd_env(args):
    p = torch.cuda.get_device_properties(0)
    log_result({"kind": "env", **versions(), "cuda": torch.version.cuda, "sms": p.multi_processor_count,
                "mem_GiB": round(p.total_memory / 2**30, 1), "L2_MB": round(getattr(p, "L2_cache_size", 0) / 1e6, 1)})


def cmd_pdssm(args):
    from llm_surgery.layers.registry import build_mixer
    run_cases(lambda B, L: Case("llm_surgery.FlashPDSSM(default)",
                                build_mixer("pdssm", WIDTH).to(device="cuda", dtype=torch.bfloat16).train(), B, L),
              args)


def cmd_deltanet_matched(args):
    from fla.layers import DeltaNet
    run_cases(lambda B, L: Case("fla.DeltaNet(H=14,e=1.75)", DeltaNet(
        hidden_size=WIDTH, num_heads=14, expand_k=1.75, expand_v=1.75, mode="chunk").to(
        device="cuda", dtype=torch.bfloat16).train(), B, L), args)


def cmd_mamba2(args):
    from layer_compare import import_mamba2
    m2 = import_mamba2()
    from mamba_ssm.ops.triton import ssd_combined
    if ssd_combined.causal_conv1d_fwd_function is None:
        raise SystemExit("mamba2: causal-conv1d is not importable, so Mamba2 has no fused path")
    run_cases(lambda B, L: Case("mamba_ssm.Mamba2(fused)", m2.Mamba2(
        d_model=WIDTH, d_state=128, headdim=64, expand=2, use_mem_eff_path=True, device="cuda",
        dtype=torch.bfloat16).train(), B, L, {"conv": "causal_conv1d CUDA (fused split_conv1d_scan)"}), args)


def cmd_table(args):
    rows = [json.loads(line) for line in open(RESULTS)] if os.path.exists(RESULTS) else []
    for r in rows:
        if r.get("kind") == "env":
            print(json.dumps(r))
    print(f"{'layer':34s} {'B':>2s} {'L':>5s} {'params':>9s} {'fwd ms':>8s} {'f+b ms':>8s} {'min':>8s} {'p80':>8s} "
          f"{'Mtok/s':>7s} {'saved MiB':>9s} {'peak MiB':>9s} {'1st s':>6s}")
    for r in rows:
        if "layer" not in r:
            continue
        if not r.get("ok"):
            print(f"{r['layer']:34s} {r['B']:>2d} {r['L']:>5d}  FAILED: {r.get('error', '')[:120]}")
            continue
        print(f"{r['layer']:34s} {r['B']:>2d} {r['L']:>5d} {r['params']:>9d} {r['fwd_median_ms']:>8.3f} "
              f"{r['fb_median_ms']:>8.3f} {r['fb_min_ms']:>8.3f} {r['fb_p80_ms']:>8.3f} {r['Mtok_per_s_fb']:>7.2f} "
              f"{r['saved_MiB']:>9.1f} {r['peak_MiB']:>9.1f} {r['first_call_s']:>6.1f}")


COMMANDS = {"env": cmd_env, "pdssm": cmd_pdssm, "deltanet_matched": cmd_deltanet_matched, "mamba2": cmd_mamba2,
            "table": cmd_table}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cmd", choices=list(COMMANDS))
    ap.add_argument("--B", type=int, nargs="+", default=[32])
    ap.add_argument("--L", type=int, nargs="+", default=[2048, 4096, 8192])
    args = ap.parse_args(argv)
    if args.cmd != "table" and not torch.cuda.is_available():
        raise SystemExit(f"bench_layers {args.cmd}: needs a CUDA GPU")
    COMMANDS[args.cmd](args)


if __name__ == "__main__":
    main()

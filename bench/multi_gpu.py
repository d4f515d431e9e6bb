"""Data-parallel scaling of the granite3b recipe (DDP and FSDP2) on a random-weight host of the real
granite-4.0-h-micro configuration (no hub access needed), in one call.

    python bench/multi_gpu.py --runs ddp:1,ddp:2 --out $OUT                                  # 2 GPUs
    python bench/multi_gpu.py --parallel --budget 450 --steps 40 --profile-steps 10 --out $OUT \
        --runs ddp:1@8,ddp:1@32,ddp:2@8,fsdp:2@8,ddp:2@32,ddp:4@8,fsdp:4@8,ddp:4@32,fsdp:4@32    # 4 GPUs, batch 8 and 32
    python bench/multi_gpu.py --cpu --tiny --check-eval --out /tmp/mg   # the same logic on the CPU (gloo), tiny host

It (1) builds the host once with `llm_surgery.hosts.build_host` and saves it (bf16 weights + the Box word
tokenizer) to <out>/host; (2) runs `accelerate launch --num_processes N --mixed_precision bf16 recipes/granite3b.py
--model <out>/host [--fsdp] --batch-size B ...` for each MODE:N[@B] of --runs (B: per-GPU batch, default
--batch-size or the recipe's), for --steps timed steps after 5 warm-up steps, plus --profile-steps synchronised steps
that give the trainer's step-time breakdown (`--profile-steps`, llm_surgery/train/profile.py); the precision comes
from the launcher, as `accelerate config` would give it; (3) reads each run's results.json (steady-state tokens/s
and peak GPU memory of every process, the breakdown) and writes the tables: tokens/s per GPU, total, scaling
efficiency (total with N processes / (N x total of the 1-process DDP run at the same batch)), peak memory per
process, FSDP2's memory saving beside its throughput cost against DDP at the same N and batch, and the breakdown
(its backward beside the 1-process backward: the all-reduce time the backward did not hide); (4) with
--check-eval, evaluates the saved layers of each mode's largest run again in this one process (`evaluate_run`) and
compares with the metrics that run gathered over its N processes.

--parallel runs consecutive launches that fit side by side on disjoint GPUs (CUDA_VISIBLE_DEVICES, own ports):
less wall time for one call, at the price of shared host CPUs and disk while they run (the table says which ran
together). --budget stops starting launches that cannot finish in the call. Outputs: <out>/<mode>-np<N>-b<B>/ (run
directories with their logs), <out>/multi_gpu.json and <out>/multi_gpu.md (rewritten after every wave, so a cut-off
call keeps what finished).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from versions import versions_in_child

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "runs/multi_gpu")
    ap.add_argument("--recipe", default="recipes/granite3b.py")
    ap.add_argument("--host", default="granite-4.0-h-micro", help="a name of llm_surgery.hosts.HOST_CONFIGS")
    ap.add_argument("--tiny", action="store_true", help="a tiny Granite host instead (CPU check of the logic)")
    ap.add_argument("--cpu", action="store_true", help="gloo processes on the CPU (ACCELERATE_USE_CPU)")
    ap.add_argument("--runs", default="ddp:1,ddp:2",
                    help="MODE:N[@B] launches in order; MODE ddp or fsdp (N >= 2), B the per-GPU batch")
    ap.add_argument("--procs", default=None, help="DDP process counts, e.g. 1,2 (short for --runs ddp:1,ddp:2)")
    ap.add_argument("--check-eval", action="store_true",
                    help="re-evaluate each mode's largest run in one process and compare with its gathered metrics")
    ap.add_argument("--kind", default="pdssm")
    ap.add_argument("--steps", type=int, default=200, help="timed optimizer steps per run (after 5 warm-up steps)")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="then this many synchronised steps for the step-time breakdown (not timed)")
    ap.add_argument("--batch-size", type=int, default=None, help="per-process micro-batch of runs without @B "
                                                                 "(default: the recipe's)")
    ap.add_argument("--max-eval-examples", type=int, default=256, help="bounds the final evaluation")
    ap.add_argument("--timeout", type=int, default=420, help="seconds per launch")
    ap.add_argument("--parallel", action="store_true", help="consecutive launches that fit run side by side on "
                                                            "disjoint GPUs")
    ap.add_argument("--gpus", type=int, default=None, help="devices to pack --parallel launches on (default: the "
                                                           "visible GPUs; on --cpu: 1)")
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole call: no launch starts that "
                                                               "has less than --min-launch seconds left")
    ap.add_argument("--min-launch", type=float, default=60.0)
    ap.add_argument("--copy-to", default=None, help="after every wave, copy the summaries and each run's small files "
                                                    "(results, profile, metrics, logs) here (not the host or weights)")
    ap.add_argument("extra", nargs="*", help="more recipe flags, after --")
    args = ap.parse_args(argv)
    if args.procs:
        args.runs = ",".join(f"ddp:{n}" for n in args.procs.split(","))
    args.runs = [parse_run(r, args.batch_size) for r in args.runs.split(",") if r.strip()]
    return args


# graphs: the trainer's default (forward and backward replayed from CUDA graphs, the gradients averaged by one
# all-reduce per buffer instead of DDP; llm_surgery/train/graphs.py); ddp: eager steps (--no-cuda-graphs), under
# DDP with several processes; fsdp: FSDP2 (eager)
MODES = ("graphs", "ddp", "fsdp")


def parse_run(spec: str, batch: int | None = None) -> tuple[str, int, int | None]:
    """'fsdp:8@32' -> ('fsdp', 8, 32); without @B the batch is `batch` (None: the recipe's)."""
    head, _, b = spec.strip().partition("@")
    mode, _, n = head.partition(":")
    if mode not in MODES or not n.isdigit() or int(n) < 1 or (mode == "fsdp" and int(n) < 2) or (
            b and (not b.isdigit() or int(b) < 1)):
        raise SystemExit(f"--runs: {spec!r} is not MODE:N[@B] with MODE one of {MODES} (N >= 2 for fsdp, B >= 1)")
    return mode, int(n), int(b) if b else batch


def run_name(mode: str, n: int, batch: int | None) -> str:
    return f"{mode}-np{n}" + (f"-b{batch}" if batch else "")


def waves(runs: list[tuple], gpus: int, parallel: bool) -> list[list[tuple[tuple, list[int]]]]:
    """Consecutive runs grouped to run side by side on disjoint devices (one run per group without --parallel):
    [[(run, device ids), ...], ...]."""
    out, cap, used = [], 0, 0
    for run in runs:
        n = run[1]
        if not parallel or not out or used + n > cap:
            out.append([])
            cap, used = max(gpus, n), 0
        out[-1].append((run, list(range(used, used + n))))
        used += n
    return out


def build_and_save_host(args, path: Path) -> dict:
    """The random-weight host (or a tiny one) and the Box word tokenizer, saved like a user's checkpoint."""
    import torch

    from llm_surgery.box_data import build_box_tokenizer
    from llm_surgery.hosts import build_host, build_tiny_host

    t0 = time.time()
    tok = build_box_tokenizer()
    if args.tiny:
        model = build_tiny_host("granite", seed=0, hidden_size=32, vocab_size=len(tok), pattern="M*M*M*M*",
                                mamba_chunk_size=64)
    else:
        torch.manual_seed(0)
        device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
        model = build_host(args.host, device=device, dtype=torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(path)
    tok.save_pretrained(path)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the launched processes need the memory, not this one
    return {"host": "tiny granite" if args.tiny else args.host, "params": n_params, "seconds": time.time() - t0}


def start(args, n: int, host: Path, out: Path, mode: str = "ddp", batch: int | None = None,
          devices: list[int] | None = None, port: int = 29500) -> dict:
    """Start one `accelerate launch` of the recipe in its own process group; `finish` waits for it."""
    precision = "no" if args.cpu else "bf16"
    steps = args.steps + 5 + args.profile_steps  # the trainer's 5 warm-up steps (fewer below 25 steps), timed ones
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(n), "--num_machines", "1",
           "--mixed_precision", precision, "--dynamo_backend", "no", "--main_process_port", str(port),
           *(["--multi_gpu"] if n > 1 else []),
           args.recipe, "--model", str(host), "--kind", args.kind, "--n", "4", "--max-steps", str(steps),
           "--host-dtype", "float32" if args.cpu else "bfloat16",
           "--output-dir", str(out), "--overwrite",  # a rerun into the same --out replaces this script's runs
           "--max-eval-examples", str(args.max_eval_examples), "--no-progress", "--no-eval-host", "--no-plot",
           "--quick-autotune", "--profile-steps", str(args.profile_steps),
           *(["--batch-size", str(batch)] if batch else []), *(["--fsdp"] if mode == "fsdp" else []),
           *(["--no-cuda-graphs"] if mode == "ddp" else []), *args.extra]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    if args.cpu:
        env.update(ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1")
    elif devices is not None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(max(devices) + 1)]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[i] for i in devices)
    out.mkdir(parents=True, exist_ok=True)
    print("$ " + (f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} " if "CUDA_VISIBLE_DEVICES" in env else "")
          + " ".join(cmd), flush=True)
    logf = open(out / "launch.log", "w")
    # its own process group: on a timeout the ranks die with the launcher (orphaned ranks kept their GPU memory
    # and made the next launch fail to load the host)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    return {"proc": proc, "log": logf, "t0": time.time(), "res": {
        "mode": mode, "num_processes": n, "batch_size": batch, "devices": devices, "command": " ".join(cmd),
        "run_dir": str(out)}}


def finish(job: dict, deadline: float) -> dict:
    """Wait for a started launch until `deadline` (time.time()), killing its process group after; its result."""
    proc, res, out = job["proc"], job["res"], Path(job["res"]["run_dir"])
    try:
        rc = proc.wait(timeout=max(0.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = "timeout"
    job["log"].close()
    res.update(rc=rc, wall_seconds=time.time() - job["t0"])
    tail = failure_lines((out / "launch.log").read_text().splitlines())
    if rc != 0 or not (out / "results.json").is_file():
        print(f"  {out.name} FAILED ({rc}) after {res['wall_seconds']:.0f}s; last lines of {out / 'launch.log'}:\n"
              "    " + "\n    ".join(tail))
        return res
    results = json.loads((out / "results.json").read_text())
    res.update(throughput=results["throughput"], num_processes=results["num_processes"],
               batch_size=results["config"]["batch_size"], step_profile=results.get("step_profile"))
    print(f"  {out.name} done in {res['wall_seconds']:.0f}s: {results['throughput']['tokens_per_s_total']:,.0f} "
          "tokens/s total", flush=True)
    return res


def launch(args, n: int, host: Path, out: Path, mode: str = "ddp", batch: int | None = None) -> dict:
    """One launch, waited for (at most --timeout seconds)."""
    return finish(start(args, n, host, out, mode, batch), time.time() + args.timeout)


def failure_lines(log: list[str], context: int = 30) -> list[str]:
    """The first child traceback of a launch log (the launcher's own summary says only which rank died),
    else its last lines."""
    start = next((i for i, line in enumerate(log) if "Traceback (most recent call last)" in line), None)
    if start is None:
        return log[-15:]
    return log[start:start + context]


def prebuild_kernels() -> str:
    """Build (or load from the cache) the pd_scan CUDA extension once, before any launch: ranks that start
    together then load a finished build instead of compiling side by side inside the timed runs."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA: nothing to build"
    from llm_surgery.ops.pd_scan import cuda

    t0 = time.time()
    ok = cuda.available()
    return f"pd_scan CUDA kernels {'ready' if ok else 'FAILED: ' + str(cuda.load_error())} in {time.time() - t0:.0f}s"


def _base(runs: list[dict], batch, mode: str) -> float | None:
    """Total tokens/s of the 1-process run at the same batch and of the same mode (FSDP2's: eager DDP's)."""
    mode = "ddp" if mode == "fsdp" else mode
    return next((r["throughput"]["tokens_per_s_total"] for r in runs if r["num_processes"] == 1 and
                 r.get("mode", "ddp") == mode and r.get("batch_size") == batch and "throughput" in r), None)


def table(runs: list[dict], unit: str) -> str:
    """Markdown: tokens/s per process (mean), total, scaling efficiency against the 1-process run of the same mode
    at the same batch (FSDP2: eager DDP's), memory; which runs ran side by side (wave)."""
    lines = [f"| processes | mode | batch per {unit} | tokens/s per {unit} | total tokens/s | scaling efficiency | "
             f"peak memory per {unit} (GiB) | timed steps | wave | wall s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        n, mode, b = r["num_processes"], r.get("mode", "ddp").upper(), r.get("batch_size") or "recipe"
        if "throughput" not in r:
            lines.append(f"| {n} | {mode} | {b} | {r['rc']} | | | | | {r.get('wave', '')} | "
                         f"{r.get('wall_seconds', 0):.0f} |")
            continue
        t, base = r["throughput"], _base(runs, r.get("batch_size"), r.get("mode", "ddp"))
        per = t["tokens_per_s_by_process"]
        eff = f"{100 * t['tokens_per_s_total'] / (n * base):.0f}%" if base else "-"
        mem = t.get("peak_memory_gib_by_process")
        mem = ", ".join(f"{g:.1f}" for g in mem) if mem else "-"
        lines.append(f"| {n} | {mode} | {b} | {sum(per) / len(per):,.0f} | {t['tokens_per_s_total']:,.0f} | {eff} | "
                     f"{mem} | {t['timed_steps']} | {r.get('wave', '')} | {r['wall_seconds']:.0f} |")
    return "\n".join(lines)


def fsdp_tradeoffs(runs: list[dict]) -> list[str]:
    """FSDP2 against DDP at the same number of processes and batch: memory saved, throughput lost."""
    out = []
    for f in runs:
        d = next((r for r in runs if r.get("mode") == "ddp" and "throughput" in r and r["num_processes"] ==
                  f["num_processes"] and r.get("batch_size") == f.get("batch_size")), None)
        if f.get("mode") != "fsdp" or "throughput" not in f or d is None:
            continue
        mem = lambda r: max(r["throughput"].get("peak_memory_gib_by_process") or [float("nan")])
        tok = lambda r: r["throughput"]["tokens_per_s_total"]
        out.append(f"FSDP2 vs DDP, {f['num_processes']} processes, batch {f.get('batch_size') or 'recipe'}: "
                   f"{100 * (1 - mem(f) / mem(d)):.0f}% less peak memory per GPU ({mem(f):.1f} vs {mem(d):.1f} GiB), "
                   f"{100 * (1 - tok(f) / tok(d)):.0f}% fewer tokens/s ({tok(f):,.0f} vs {tok(d):,.0f})")
    return out


def breakdown_table(runs: list[dict]) -> str:
    """Markdown: the step-time breakdown of every run that has one (ms per step), its backward beside the
    1-process backward at the same batch (what the all-reduce added), and the host's issue time of the step."""
    from llm_surgery.train.profile import PHASES

    rows = [r for r in runs if r.get("step_profile")]
    if not rows:
        return ""
    cols = [*PHASES, "other"]
    lines = ["| processes | mode | batch | step ms | " + " | ".join(cols) + " | backward - 1-process backward | "
             "host issue ms | evaluation s |", "| --- " * (len(cols) + 8) + "|"]
    for r in rows:
        p = r["step_profile"]
        one = next((q["step_profile"] for q in rows if q["num_processes"] == 1 and q["mode"] == r["mode"] and
                    q.get("batch_size") == r.get("batch_size")), None)
        extra = f"{p['phases_ms']['backward'] - one['phases_ms']['backward']:+.1f}" if one else "-"
        lines.append(f"| {r['num_processes']} | {r['mode'].upper()} | {r.get('batch_size') or 'recipe'} | "
                     f"{p['step_ms']:.1f} | " + " | ".join(f"{p['phases_ms'][c]:.1f}" for c in cols) +
                     f" | {extra} | {sum(p['issue_ms'].values()):.1f} | "
                     f"{sum(e['seconds'] for e in p['evaluations']):.1f} |")
    return "\n".join(lines)


def check_evaluations(runs: list[dict]) -> list[dict]:
    """For each mode, its largest finished run: gathered test metrics vs this process evaluating the saved layers."""
    import torch

    from llm_surgery.train.evaluate import compare_results, evaluate_run

    checks = []
    for mode in dict.fromkeys(r["mode"] for r in runs):
        done = [r for r in runs if r["mode"] == mode and "throughput" in r]
        if not done:
            continue
        run = max(done, key=lambda r: r["num_processes"])
        t0 = time.time()
        gathered = json.loads((Path(run["run_dir"]) / "results.json").read_text())["test"]
        check = {"mode": mode, "num_processes": run["num_processes"],
                 **compare_results(gathered, evaluate_run(run["run_dir"])), "seconds": time.time() - t0}
        print(f"evaluation check, {mode} x{run['num_processes']}: {check}", flush=True)
        checks.append(check)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return checks


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    deadline = t0 + args.budget if args.budget else float("inf")
    host_dir = out / "host"
    host = build_and_save_host(args, host_dir)
    print(f"host {host['host']}: {host['params']:,} params, built and saved to {host_dir} in {host['seconds']:.0f}s",
          flush=True)
    if not args.cpu:
        print(prebuild_kernels(), flush=True)
    unit = "process" if args.cpu else "GPU"
    gpus = args.gpus or (1 if args.cpu else _cuda_count())
    summary = {"args": {**vars(args), "runs": [f"{m}:{n}@{b}" for m, n, b in args.runs]}, "host": host, "runs": [],
               "versions": versions_in_child()}

    def write() -> str:
        md = (f"{args.recipe} on a random-weight {host['host']} host ({host['params'] / 1e6:,.1f} M params), "
              f"{args.kind} x4, {args.steps + 5 + args.profile_steps} steps a launch (the trainer's warm-up, the "
              f"timed steps, {args.profile_steps} profiled), {'CPU/gloo, fp32' if args.cpu else 'bf16'}; steady state "
              "(warm-up, profiled steps, evaluation and start-up left out); launches of the same wave ran side by "
              "side on disjoint devices\n\n" + table(summary["runs"], unit))
        trade = fsdp_tradeoffs(summary["runs"])
        if trade:
            md += "\n\n" + "\n".join(f"- {line}" for line in trade)
        bd = breakdown_table(summary["runs"])
        if bd:
            md += (f"\n\nstep-time breakdown, ms per step over the last {args.profile_steps} steps (each phase "
                   "synchronised; backward includes the wait for DDP's gradient all-reduce; for GRAPHS, forward "
                   "is the replay of forward and backward, backward the gradients' all-reduce)\n\n" + bd)
        for c in summary.get("eval_checks", []):
            md += (f"\n\nevaluation check, {c['mode']} x{c['num_processes']}: gathered over the processes vs one "
                   f"process on the saved layers: {c['num_examples'][0]} / {c['num_examples'][1]} examples, counts "
                   f"per number of operations {'equal' if c['counts_equal'] else 'DIFFERENT'}, largest accuracy "
                   f"difference {c['max_abs_accuracy_diff']}")
        summary["wall_seconds"] = time.time() - t0
        (out / "multi_gpu.json").write_text(json.dumps(summary, indent=2))
        (out / "multi_gpu.md").write_text(md + "\n")
        if args.copy_to:
            copy_small(out, Path(args.copy_to))
        return md

    for w, wave in enumerate(waves(args.runs, gpus, args.parallel), 1):
        left = deadline - time.time()
        if left < args.min_launch:
            for (mode, n, b), _ in wave:
                summary["runs"].append({"mode": mode, "num_processes": n, "batch_size": b, "wave": w,
                                        "rc": f"skipped ({left:.0f}s of --budget left)", "wall_seconds": 0.0})
            write()
            continue
        jobs = [start(args, n, host_dir, out / run_name(mode, n, b), mode, b, None if args.cpu else devices,
                      port=29500 + 10 * i) for i, ((mode, n, b), devices) in enumerate(wave)]
        end = min(deadline, time.time() + args.timeout)
        for job in jobs:
            summary["runs"].append({**finish(job, end), "wave": w})
        write()
    if args.check_eval:
        summary["eval_checks"] = check_evaluations(summary["runs"])
    md = write()
    print("\n" + md + f"\n\nmulti_gpu done in {summary['wall_seconds']:.0f}s; outputs in {out}", flush=True)
    bad_eval = any(not c["counts_equal"] for c in summary.get("eval_checks", []))
    if any("throughput" not in r for r in summary["runs"]) or bad_eval:
        sys.exit(1)
    return summary


SMALL_FILES = ("multi_gpu.md", "multi_gpu.json", "*/results.json", "*/step_profile.json", "*/metrics.jsonl",
               "*/config.json", "*/launch.log")


def copy_small(out: Path, dest: Path) -> None:
    """The summaries and each run's small files, without the host and the trained weights."""
    for pattern in SMALL_FILES:
        for f in out.glob(pattern):
            if f.parent.name != "host":
                target = dest / f.relative_to(out)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(f, target)


def _cuda_count() -> int:
    import torch

    return max(1, torch.cuda.device_count())


if __name__ == "__main__":
    main()

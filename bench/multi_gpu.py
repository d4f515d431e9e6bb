"""Data-parallel scaling of the granite3b recipe (DDP and FSDP2) on a random-weight host of the real
granite-4.0-h-micro configuration (no hub access needed), in one call.

    python bench/multi_gpu.py --runs ddp:1,ddp:2 --out $OUT                                  # 2 x H200
    python bench/multi_gpu.py --runs ddp:8,fsdp:8,ddp:1,ddp:2,fsdp:2 --check-eval --out $OUT  # 8 x H200
    python bench/multi_gpu.py --cpu --tiny --check-eval --out /tmp/mg   # the same logic on the CPU (gloo), tiny host

It (1) builds the host with `llm_surgery.hosts.build_host` and saves it (bf16 weights + the Box word tokenizer) to
<out>/host; (2) runs `accelerate launch --num_processes N recipes/granite3b.py --model <out>/host [--fsdp] ...`
for each MODE:N of --runs, for a fixed number of steps (bf16, 4 inserted layers of --kind); (3) reads each run's
results.json["throughput"] (steady-state tokens/s of every process, peak GPU memory of every process; the
trainer also writes them to metrics.jsonl) and prints one table: tokens/s per GPU, total, scaling efficiency
(total with N processes / (N x total of the 1-process DDP run)), peak memory per process; (4) with --check-eval,
evaluates the saved layers of each mode's largest run again in this one process (`evaluate_run`) and compares with
the metrics that run gathered over its N processes. Outputs: <out>/<mode>-np<N>/ (run directories with their
logs), <out>/multi_gpu.json and <out>/multi_gpu.md (rewritten after every launch, so a cut-off call keeps what
finished).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "runs/multi_gpu")
    ap.add_argument("--recipe", default="recipes/granite3b.py")
    ap.add_argument("--host", default="granite-4.0-h-micro", help="a name of llm_surgery.hosts.HOST_CONFIGS")
    ap.add_argument("--tiny", action="store_true", help="a tiny Granite host instead (CPU check of the logic)")
    ap.add_argument("--cpu", action="store_true", help="gloo processes on the CPU (ACCELERATE_USE_CPU)")
    ap.add_argument("--runs", default="ddp:1,ddp:2", help="MODE:N launches in order; MODE ddp or fsdp (N >= 2)")
    ap.add_argument("--procs", default=None, help="DDP process counts, e.g. 1,2 (short for --runs ddp:1,ddp:2)")
    ap.add_argument("--check-eval", action="store_true",
                    help="re-evaluate each mode's largest run in one process and compare with its gathered metrics")
    ap.add_argument("--kind", default="pdssm")
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps per run (first 5 untimed)")
    ap.add_argument("--batch-size", type=int, default=None, help="per-process micro-batch (default: the recipe's)")
    ap.add_argument("--max-eval-examples", type=int, default=256, help="bounds the final evaluation")
    ap.add_argument("--timeout", type=int, default=420, help="seconds per launch")
    ap.add_argument("extra", nargs="*", help="more recipe flags, after --")
    args = ap.parse_args(argv)
    if args.procs:
        args.runs = ",".join(f"ddp:{n}" for n in args.procs.split(","))
    args.runs = [parse_run(r) for r in args.runs.split(",") if r.strip()]
    return args


def parse_run(spec: str) -> tuple[str, int]:
    """'fsdp:8' -> ('fsdp', 8)."""
    mode, _, n = spec.strip().partition(":")
    if mode not in ("ddp", "fsdp") or not n.isdigit() or int(n) < 1 or (mode == "fsdp" and int(n) < 2):
        raise SystemExit(f"--runs: {spec!r} is not ddp:N or fsdp:N (N >= 2 for fsdp)")
    return mode, int(n)


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


def launch(args, n: int, host: Path, out: Path, mode: str = "ddp") -> dict:
    """One `accelerate launch` of the recipe; returns its wall time, exit status and throughput."""
    precision = "no" if args.cpu else "bf16"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(n), "--num_machines", "1",
           "--mixed_precision", precision, "--dynamo_backend", "no", *(["--multi_gpu"] if n > 1 else []),
           args.recipe, "--model", str(host), "--kind", args.kind, "--n", "4", "--max-steps", str(args.steps),
           "--mixed-precision", precision, "--host-dtype", "float32" if args.cpu else "bfloat16",
           "--output-dir", str(out), "--overwrite",  # a rerun into the same --out replaces this script's runs
           "--max-eval-examples", str(args.max_eval_examples), "--no-progress",
           "--log-every", str(max(1, args.steps // 10)), "--quick-autotune",
           *(["--batch-size", str(args.batch_size)] if args.batch_size else []), *(["--fsdp"] if mode == "fsdp"
                                                                                     else []), *args.extra]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    if args.cpu:
        env.update(ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1")
    out.mkdir(parents=True, exist_ok=True)
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.time()
    with open(out / "launch.log", "w") as logf:
        # its own process group: on a timeout the ranks die with the launcher (orphaned ranks kept their GPU
        # memory and made the next launch fail to load the host)
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
    wall = time.time() - t0
    tail = failure_lines((out / "launch.log").read_text().splitlines())
    res = {"mode": mode, "num_processes": n, "rc": rc, "wall_seconds": wall, "command": " ".join(cmd),
           "run_dir": str(out)}
    if rc != 0 or not (out / "results.json").is_file():
        print(f"  FAILED ({rc}) after {wall:.0f}s; last lines of {out / 'launch.log'}:\n    " + "\n    ".join(tail))
        return res
    results = json.loads((out / "results.json").read_text())
    res["throughput"] = results["throughput"]
    res["num_processes"] = results["num_processes"]
    print(f"  done in {wall:.0f}s: {results['throughput']['tokens_per_s_total']:,.0f} tokens/s total", flush=True)
    return res


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


def table(runs: list[dict], unit: str) -> str:
    """Markdown: tokens/s per process (mean), total, scaling efficiency against the 1-process DDP run, memory."""
    base = next((r["throughput"]["tokens_per_s_total"] for r in runs if r["num_processes"] == 1 and "throughput"
                 in r), None)
    lines = [f"| processes | mode | tokens/s per {unit} | total tokens/s | scaling efficiency | peak memory per "
             f"{unit} (GiB) | timed steps | wall s |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        n, mode = r["num_processes"], r.get("mode", "ddp").upper()
        if "throughput" not in r:
            lines.append(f"| {n} | {mode} | failed ({r['rc']}) | | | | | {r['wall_seconds']:.0f} |")
            continue
        t = r["throughput"]
        per = t["tokens_per_s_by_process"]
        eff = f"{100 * t['tokens_per_s_total'] / (n * base):.0f}%" if base else "-"
        mem = t.get("peak_memory_gib_by_process")
        mem = ", ".join(f"{g:.1f}" for g in mem) if mem else "-"
        lines.append(f"| {n} | {mode} | {sum(per) / len(per):,.0f} | {t['tokens_per_s_total']:,.0f} | {eff} | {mem} | "
                     f"{t['timed_steps']} | {r['wall_seconds']:.0f} |")
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
    host_dir = out / "host"
    host = build_and_save_host(args, host_dir)
    print(f"host {host['host']}: {host['params']:,} params, built and saved to {host_dir} in {host['seconds']:.0f}s",
          flush=True)
    if not args.cpu:
        print(prebuild_kernels(), flush=True)
    unit = "process" if args.cpu else "GPU"
    summary = {"args": {**vars(args), "runs": [f"{m}:{n}" for m, n in args.runs]}, "host": host, "runs": []}

    def write() -> str:
        md = (f"{args.recipe} on a random-weight {host['host']} host ({host['params'] / 1e6:,.1f} M params), "
              f"{args.kind} x4, {args.steps} steps, {'CPU/gloo, fp32' if args.cpu else 'bf16'}; steady state "
              f"(first steps, evaluation and start-up left out)\n\n" + table(summary["runs"], unit))
        for c in summary.get("eval_checks", []):
            md += (f"\n\nevaluation check, {c['mode']} x{c['num_processes']}: gathered over the processes vs one "
                   f"process on the saved layers: {c['num_examples'][0]} / {c['num_examples'][1]} examples, counts "
                   f"per number of operations {'equal' if c['counts_equal'] else 'DIFFERENT'}, largest accuracy "
                   f"difference {c['max_abs_accuracy_diff']}")
        summary["wall_seconds"] = time.time() - t0
        (out / "multi_gpu.json").write_text(json.dumps(summary, indent=2))
        (out / "multi_gpu.md").write_text(md + "\n")
        return md

    for mode, n in args.runs:
        summary["runs"].append(launch(args, n, host_dir, out / f"{mode}-np{n}", mode))
        write()
    if args.check_eval:
        summary["eval_checks"] = check_evaluations(summary["runs"])
    md = write()
    print("\n" + md + f"\n\nmulti_gpu done in {summary['wall_seconds']:.0f}s; outputs in {out}", flush=True)
    bad_eval = any(not c["counts_equal"] for c in summary.get("eval_checks", []))
    if any("throughput" not in r for r in summary["runs"]) or bad_eval:
        sys.exit(1)
    return summary


if __name__ == "__main__":
    main()

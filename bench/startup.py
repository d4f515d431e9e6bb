"""Time to the first optimizer step of a training command, per inserted kind, on fresh and on warm caches.

Each run launches the recipe as a user would and timestamps its output; when `metrics.jsonl` holds the first step's
record (`--log-every 1`) the run's time is taken and the run is stopped (its process group, started here).
A run is `fresh` (empty Triton, pd_scan-extension and autotune caches: a new machine) or `warm` (the caches the
previous run of the same kind left: a second run on the same machine). `--profile` adds, per run, what the start-up
spent its time on (`bench/startup_hooks/sitecustomize.py`: Triton compilations, autotuner benchmarks, a sampled
main-thread profile).

    PYTHONPATH=$PWD python bench/startup.py --runs pdssm:fresh mamba2:fresh pdssm:warm mamba2:warm --out startup.md
    PYTHONPATH=$PWD python bench/startup.py --runs pdssm:fresh --profile --out profile.md

Trainer flags after `--` go to every run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from versions import versions_in_child

REPO = Path(__file__).resolve().parent.parent
COMMAND = ["accelerate", "launch", "--num_processes", "1", "recipes/granite3b.py",
           "--random-init-config", "granite-4.0-h-micro"]  # the recipe's start-up as measured in BENCHMARKS
CACHE_VARS = ("TRITON_CACHE_DIR", "LLM_SURGERY_KERNEL_CACHE", "LLM_SURGERY_AUTOTUNE_CACHE")
MARKS = {"graphs": re.compile(r"CUDA graphs: .*captured.* in ([0-9.]+) s"),
         "autotune": re.compile(r"Triton autotuning: (.*)")}


def first_step_record(metrics: Path) -> dict | None:
    if not metrics.is_file():
        return None
    for line in metrics.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written
        if "loss" in rec:
            return rec
    return None


def run_once(kind: str, caches: Path, out_dir: Path, args, profile: Path | None) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **{v: str(caches / v.lower()) for v in CACHE_VARS})
    if profile is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(REPO / "bench" / "startup_hooks"), env.get("PYTHONPATH", "")])
        env["LLM_SURGERY_STARTUP_PROFILE"] = str(profile)
    cmd = args.command.split()
    if cmd[0] == "accelerate" and shutil.which("accelerate") is None:
        cmd[:1] = [sys.executable, "-m", "accelerate.commands.launch"]
    cmd += ["--kind", kind, "--max-steps", str(args.max_steps), "--log-every", "1",
                     "--output-dir", str(out_dir), "--overwrite"] + args.extra
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    lines, marks = [], {}

    def read():
        buf = b""
        while chunk := proc.stdout.read1(4096):
            buf += chunk
            *done, buf = re.split(rb"[\r\n]", buf)
            for raw in done:
                text = raw.decode(errors="replace").rstrip()
                if text and not text.startswith("train "):  # tqdm's bar: one line per refresh
                    lines.append(f"{time.perf_counter() - t0:7.1f} {text}")
                    for name, pat in MARKS.items():
                        if (m := pat.search(text)):
                            marks[name] = m.group(1)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    first, record = None, None
    while proc.poll() is None and time.perf_counter() - t0 < args.timeout:
        record = first_step_record(out_dir / "metrics.jsonl")
        if record is not None:
            first = time.perf_counter() - t0
            break
        time.sleep(0.2)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(5)
    return {"kind": kind, "first_step_s": f"not reached in {args.timeout:.0f}" if first is None else round(first, 1),
            "graphs_s": marks.get("graphs"), "autotune": marks.get("autotune"),
            "rc": proc.returncode if first is None else None, "log": lines}


def summarize_profile(path: Path) -> list[str]:
    if not path.is_file():
        return ["(no profile written)"]
    p = json.loads(path.read_text())
    out = [f"sampled {p['elapsed_s']} s; phases (s): {json.dumps(p['phases_s'])}"]
    compiles = [c for c in p["compiles"] if not c["hit"]]
    by_module: dict = {}
    for c in compiles:
        m = by_module.setdefault(c["module"].split(".")[0], [0, 0.0])
        m[0] += 1
        m[1] += c["ms"] / 1000
    out.append(f"Triton compilations (not cache hits): {len(compiles)}, {sum(c['ms'] for c in compiles) / 1000:.1f} s; "
               f"by package: " + ", ".join(f"{k} {n} in {s:.1f} s" for k, (n, s) in by_module.items())
               + f"; cache hits: {sum(c['hit'] for c in p['compiles'])}")
    per_kernel: dict = {}
    for c in compiles:
        k = per_kernel.setdefault(f"{c['module']}.{c['kernel']}", [0, 0.0])
        k[0] += 1
        k[1] += c["ms"] / 1000
    out.append("compiles per kernel (count, s): " + "; ".join(
        f"{k} {n} {s:.1f}" for k, (n, s) in sorted(per_kernel.items(), key=lambda kv: -kv[1][1])))
    out.append(f"autotuners: {sum(v['configs'] for v in p['autotune'].values())} configs timed in "
               f"{sum(v['s'] for v in p['autotune'].values()):.1f} s; per kernel (configs timed, s, of which "
               "compiling s): " + "; ".join(
        f"{k} {v['configs']} {v['s']} {v['compile_s']}" for k, v in p["autotune"].items()))
    inclusive = [(k, v) for k, v in p["inclusive_s"].items() if not k.startswith("<frozen")]
    out.append("inclusive s (top 60): " + "; ".join(f"{k} {v}" for k, v in inclusive[:60]))
    out.append("leaf s (top 20): " + "; ".join(f"{k} {v}" for k, v in list(p["leaf_s"].items())[:20]))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="+", default=["pdssm:fresh", "mamba2:fresh", "pdssm:warm", "mamba2:warm"],
                    help="kind:fresh or kind:warm, in order (warm: the caches of that kind's previous run)")
    ap.add_argument("--max-steps", type=int, default=60)
    ap.add_argument("--timeout", type=float, default=400.0, help="seconds a run may take to its first step")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--log-lines", type=int, default=40, help="last lines of each run's output in the report (0: all)")
    ap.add_argument("--command", default=" ".join(COMMAND), help="the command before --kind (default: the recipe)")
    ap.add_argument("--work-dir", type=Path, default=None, help="caches, run outputs and profiles (default: a "
                    "new temporary folder)")
    ap.add_argument("--out", type=Path, default=None, help="markdown report, rewritten after every run")
    ap.add_argument("extra", nargs="*", help="more trainer flags (after --)")
    args = ap.parse_args(argv)
    root = args.work_dir or Path(tempfile.mkdtemp(prefix="startup_"))
    root.mkdir(parents=True, exist_ok=True)
    header = ["# Start-up: time to the first optimizer step", "",
              "    " + " ".join([args.command, "--kind", "K", "--max-steps", str(args.max_steps)] + args.extra),
              "", json.dumps({**versions_in_child(), "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}),
              ""]
    rows, report, caches = [], [], {}
    for i, spec in enumerate(args.runs):
        kind, _, run = spec.partition(":")
        if run not in ("fresh", "warm"):
            ap.error(f"--runs takes kind:fresh or kind:warm, got {spec!r}")
        if run == "fresh" or kind not in caches:
            caches[kind] = root / f"{kind}_caches_{i}"
            caches[kind].mkdir()
        prof = root / f"{kind}_{i}_profile.json" if args.profile else None
        res = run_once(kind, caches[kind], root / f"{kind}_run_{i}", args, prof)
        res["run"] = run
        rows.append(res)
        graphs = "no CUDA graphs" if res["graphs_s"] is None else f"graphs {res['graphs_s']} s"
        print(f"{kind} {run}: first step at {res['first_step_s']} s ({graphs})", flush=True)
        report += [f"## {kind}, {run} caches: first optimizer step at {res['first_step_s']} s", "", "```"]
        report += res["log"][-args.log_lines:] if args.log_lines else res["log"]
        report += ["```", ""]
        (root / f"{kind}_{i}.log").write_text("\n".join(res["log"]) + "\n")
        if prof is not None:
            report += ["profile:", "", "```"] + summarize_profile(prof) + ["```", ""]
        table = ["| kind | caches | first optimizer step (s) | graphs prepared in (s) |", "|---|---|---|---|"]
        table += [f"| {r['kind']} | {r['run']} | {r['first_step_s']} | "
                  f"{'-' if r['graphs_s'] is None else r['graphs_s']} |" for r in rows]
        if args.out:
            args.out.write_text("\n".join(header + table + [""] + report) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()

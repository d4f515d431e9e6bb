"""python -m llm_surgery.bench.state_tracking --kind pdssm --task parity [--all] [--steps N] [--seeds 0,1,2]
[--device cuda] [--out results.jsonl]: train and evaluate state-tracking models, one JSON line per run, and a
summary table (mean accuracy over the eval lengths, mean +- standard error over seeds).

The defaults are the paper's protocol (100,000 steps x 5 seeds per kind and task): hours per run on a CPU. A first
run on a CPU, about 2 minutes (too short to learn the task): --steps 300 --seeds 1 --batch-size 32
--eval-lengths 40,64 --eval-every 0 --retries 0."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from llm_surgery.cli import HelpFormatter, json_object
from llm_surgery.layers.registry import MIXER_KINDS as KINDS

from .resume import run_dir_name
from .tasks import TABLE1_TASKS, TASKS
from .train import (DEFAULT_PRESET, KIND_DEFAULTS, ONE_LAYER_RECIPES, PDSSM_PRESETS, ROBUST_PDSSM, cli_defaults,
                    quick_triton_autotune, train, train_one_thread)


def parse_args(argv=None):
    return parser().parse_args(argv)


def parser():
    from llm_surgery.cli import Parser

    p = Parser(prog="python -m llm_surgery.bench.state_tracking", description=__doc__,
               formatter_class=type("Formatter", (HelpFormatter, argparse.RawDescriptionHelpFormatter), {}))
    p.add_argument("--kind", default="pdssm", help="pdssm, mamba2 or deltanet (comma list allowed)")
    p.add_argument("--task", default="parity", help=f"one of {', '.join(TASKS)} (comma list allowed)")
    p.add_argument("--all", action="store_true", help=f"the paper's Table 1 tasks: {', '.join(TABLE1_TASKS)}")
    p.add_argument("--steps", type=int, default=100_000, help="training steps per run (the paper's)")
    p.add_argument("--seeds", default="0,1,2,3,4", help="a count N (seeds 0..N-1) or a comma list ('7,' = seed 7)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--out", default=None, help="append one JSON line per run to this file")
    p.add_argument("--layers", type=int, default=2, help="layers of the model")
    p.add_argument("--d-model", type=int, default=None,
                   help="width (default 128; a one-layer pdssm on a group task: its recipe's, ONE_LAYER_RECIPES)")
    p.add_argument("--batch-size", type=int, default=256, help="sequences per training step")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (warm-up, then cosine to 0)")
    p.add_argument("--adam-eps", type=float, default=None, help="Adam's epsilon (default: the preset's, else 1e-8)")
    p.add_argument("--curriculum", type=float, default=None,
                   help="fraction of the run over which the longest training length ramps 2 -> 40 "
                        "(default: " + ", ".join(f"{k} {v['curriculum_frac']}" for k, v in KIND_DEFAULTS.items()
                                                 if "curriculum_frac" in v) + ", else 0)")
    p.add_argument("--curriculum-mode", choices=["linear", "adaptive"], default=None,
                   help="linear: the ramp of --curriculum; adaptive: raise the longest length by --curriculum-step "
                        "every 25 steps only while the loss at that length is below --curriculum-threshold "
                        "(default: linear)")
    p.add_argument("--curriculum-threshold", type=float, default=None, help="adaptive: loss in nats (default 0.3)")
    p.add_argument("--curriculum-step", type=int, default=None, help="adaptive: length added per check (default 2)")
    p.add_argument("--tau-end", type=float, default=None, help="anneal the pdssm STE temperature 1 -> tau_end")
    p.add_argument("--preset", choices=["auto", *sorted(PDSSM_PRESETS)], default=DEFAULT_PRESET,
                   help="pdssm layer options: 'layer' = FlashPDSSM's defaults (as in the surgery), "
                        f"'robust' = {ROBUST_PDSSM}; 'auto' = robust for --layers 1, else automaton "
                        "(docs/bench/state_tracking.md); --mixer overrides any")
    p.add_argument("--robust", action="store_const", const="robust", dest="preset",
                   help="= --preset robust (default: off)")
    p.add_argument("--restarts", type=int, default=None,
                   help="train R candidates for --restart-frac of the run, continue the best by training loss "
                        "(default: per kind, see --curriculum, else 1)")
    p.add_argument("--restart-frac", type=float, default=None,
                   help="fraction of the run the --restarts candidates train for (default: per kind)")
    p.add_argument("--retries", type=int, default=None,
                   help="train a run that ends unfit (training loss above --retry-loss after its whole budget) "
                        "again from a new seed, up to this many times (default: pdssm 1, others 0)")
    p.add_argument("--retry-loss", type=float, default=None, help="training loss in nats (default 1e-3)")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="CUDA: run every training step eagerly (default: one CUDA graph per sequence length)")
    p.add_argument("--full-autotune", action="store_true",
                   help="CUDA: let Triton autotune every config (default: keep the first that runs)")
    p.add_argument("--mixer", default="{}", help="JSON of extra mixer options, e.g. '{\"complex\": false}'")
    p.add_argument("--eval-every", type=int, default=1000,
                   help="validate every K steps on the eval lengths (a set apart from the test set), keep the best "
                        "weights and report them too (acc_selected), as the paper's baselines validate on lengths "
                        "40..256 during training; stop once every length is perfect (0: no validation)")
    p.add_argument("--time-limit", type=float, default=0.0, help="seconds of training per run (0: no limit)")
    p.add_argument("--eval-lengths", default="40:257:24", help="start:stop:step or a comma list")
    p.add_argument("--eval-batch", type=int, default=256, help="sequences per evaluation length")
    p.add_argument("--jobs", type=int, default=1, help="runs in parallel (subprocesses, one torch thread each)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="make the runs resumable: one folder per run here, a checkpoint at every validation; the "
                        "same command again continues paused or killed runs exactly and reports finished ones")
    p.add_argument("--pause-after", type=float, default=None,
                   help="with --checkpoint-dir: pause every run this many seconds after the start (checkpointed; "
                        "exit status 3 while runs remain paused)")
    return p


def _seeds(text: str) -> list[int]:
    """'0,3,4' -> those seeds; a bare count '5' -> seeds 0..4 (one seed 7: '7,')."""
    try:
        return [int(s) for s in text.split(",") if s] if "," in text else list(range(int(text)))
    except ValueError:
        raise ValueError(f"--seeds must be a count or a comma list of integers, got {text!r}") from None


def _lengths(text: str) -> tuple[int, ...]:
    if ":" in text:
        return tuple(range(*(int(x) for x in text.split(":"))))
    return tuple(int(x) for x in text.split(",") if x)


def _mean_se(values: list[float]) -> str:
    m = sum(values) / len(values)
    se = math.sqrt(sum((a - m) ** 2 for a in values) / (len(values) - 1) / len(values)) if len(values) > 1 else 0.0
    return f"{m:.1f} ± {se:.1f}"


def length_span(rows: list[dict]) -> str:
    """The evaluation lengths the rows' accuracy averages over: '40..256', or '40, 64' for one or two."""
    lengths = sorted({int(k) for r in rows for k in r.get("acc", {})})
    if not lengths:
        return "over the eval lengths"
    return f"{lengths[0]}..{lengths[-1]}" if len(lengths) > 2 else ", ".join(map(str, lengths))


def summarize(rows: list[dict]) -> str:
    """Markdown table: one row per (kind, task), mean +- standard error over seeds of the mean accuracy, of the
    final weights and (where every run validated) of the validation-selected ones."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["kind"], r["task"]), []).append(r)
    lines = [f"| kind | task | seeds | acc {length_span(rows)} (%) | validation-selected (%) | per seed |",
             "| --- | --- | --- | --- | --- | --- |"]
    for (kind, task), runs in sorted(groups.items()):
        accs = [100 * r["acc_mean"] for r in runs]
        selected = (_mean_se([100 * r["acc_selected_mean"] for r in runs])
                    if all("acc_selected_mean" in r for r in runs) else "—")
        lines.append(f"| {kind} | {task} | {len(accs)} | {_mean_se(accs)} | {selected} | "
                     f"{', '.join(f'{a:.1f}' for a in accs)} |")
    return "\n".join(lines)


def build_configs(args) -> list:
    """One TrainConfig per kind, task and seed; a ValueError names a flag the runs cannot take (before any run)."""
    from llm_surgery.cli import check_device

    check_device(args.device)
    tasks = list(TABLE1_TASKS) if args.all else args.task.split(",")
    for t in tasks:
        if t not in TASKS:
            raise ValueError(f"unknown task {t!r}; choose from {', '.join(TASKS)}")
    kinds = args.kind.split(",")
    for k in kinds:
        if k not in KINDS:
            raise ValueError(f"unknown kind {k!r}; choose from {', '.join(KINDS)}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise ValueError(f"--lr must be a finite number > 0, got {args.lr}")
    extra = json_object(args.mixer, "--mixer")
    try:
        lengths = _lengths(args.eval_lengths)
    except ValueError:
        raise ValueError(f"--eval-lengths must be start:stop:step or a comma list, got {args.eval_lengths!r}") from None
    if not lengths or min(lengths) < 1:
        raise ValueError(f"--eval-lengths {args.eval_lengths!r} gives no positive length")
    if args.pause_after is not None and not args.checkpoint_dir:
        raise ValueError("--pause-after needs --checkpoint-dir (where the paused runs are kept)")
    configs = []
    for kind in kinds:
        for task in tasks:
            # a one-layer pdssm on a group task starts from that task's recipe (sizes, dictionary); flags win
            recipe = ONE_LAYER_RECIPES.get(task, {}) if kind == "pdssm" and args.layers == 1 else {}
            for seed in _seeds(args.seeds):
                configs.append(cli_defaults(
                    kind, preset=args.preset, mixer={**recipe.get("mixer", {}), **extra}, task=task,
                    n_layers=args.layers, d_model=args.d_model or recipe.get("d_model", 128),
                    steps=args.steps, batch_size=args.batch_size, lr=args.lr, adam_eps=args.adam_eps,
                    curriculum_frac=args.curriculum,
                    curriculum_mode=args.curriculum_mode, curriculum_threshold=args.curriculum_threshold,
                    curriculum_step=args.curriculum_step,
                    tau_end=args.tau_end, seed=seed, device=args.device, eval_every=args.eval_every,
                    time_limit_s=args.time_limit, restarts=args.restarts, restart_frac=args.restart_frac,
                    retries=args.retries, retry_loss=args.retry_loss,
                    eval_lengths=lengths, eval_batch=args.eval_batch,
                    cuda_graphs=False if args.no_cuda_graphs else None))
    if not configs:
        raise ValueError(f"--seeds {args.seeds!r} gives no seed")
    return configs


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        configs = build_configs(args)
    except (ValueError, TypeError) as e:
        parser().error(str(e))
    print(f"{len(configs)} run(s) of {args.steps:,} steps on {args.device} (--steps, --seeds, --device; --help "
          "lists the defaults)", flush=True)
    rows, paused = [], []
    quick = args.device.startswith("cuda") and not args.full_autotune
    run_dirs = ([os.path.join(args.checkpoint_dir, run_dir_name(c)) for c in configs] if args.checkpoint_dir
                else None)
    deadline = None if args.pause_after is None else time.time() + args.pause_after
    for r in _run_all(configs, args.jobs, quick_autotune=quick, run_dirs=run_dirs, deadline=deadline):
        if r.get("paused"):
            paused.append(r)
            print(f"{r['kind']} {r['task']} seed {r['seed']}: paused at step {r['steps_run']} in {r['run_dir']}",
                  flush=True)
            continue
        rows.append(r)
        sel = (f", validation-selected {100 * r['acc_selected_mean']:.1f}% (step {r['val_best_step']})"
               if "acc_selected_mean" in r else "")
        print(f"{r['kind']} {r['task']} seed {r['seed']}: acc {length_span([r])} {100 * r['acc_mean']:.1f}%, at "
              f"{max(map(int, r['acc']))}: {100 * r['acc_max_len']:.1f}%{sel} ({r['steps_run']} steps, "
              f"{r['seconds']}s)", flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(r) + "\n")
    print(summarize(rows))
    if paused:
        print(f"{len(paused)} runs paused: the same command continues them")
        return 3
    return 0 if len(rows) == len(configs) else 1  # a run that failed said so above


def _run_all(configs, jobs: int, quick_autotune: bool = False, run_dirs=None, deadline: float | None = None):
    """Yield results as runs finish (or pause: resume.py); with jobs > 1 in a process pool (spawned: safe with
    CUDA). `run_dirs`: one checkpoint folder per config (resumable runs)."""
    if quick_autotune:
        quick_triton_autotune()
    run_dirs = run_dirs or [None] * len(configs)
    if jobs <= 1:
        for cfg, run_dir in zip(configs, run_dirs):
            yield train(cfg, log=lambda s: print(s, file=sys.stderr, flush=True), run_dir=run_dir,
                        deadline=deadline)
        return
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed
    init = quick_triton_autotune if quick_autotune else None
    with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn"), initializer=init) as pool:
        futures = [pool.submit(train_one_thread, cfg, run_dir, deadline) for cfg, run_dir in zip(configs, run_dirs)]
        for fut in as_completed(futures):
            try:
                yield fut.result()
            except Exception as exc:  # one failed run must not lose the others
                print(f"run failed: {exc!r}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())

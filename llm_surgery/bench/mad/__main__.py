"""python -m llm_surgery.bench.mad [--tasks all] [--kinds attention,pdssm,mamba2,deltanet] [--seeds 3]
[--steps N] [--lr 5e-4] [--cpu] [--jobs N] [--out rows.jsonl]: the six MAD tasks (Poli et al. 2024) at MAD's
baseline settings, a two-layer model per kind, MAD's training protocol (--steps caps it), accuracy of the final
weights on the test set. Several --lr values: the rate of best mean validation accuracy per (kind, task) is
reported (the validation set is held out from training and test). docs/bench/mad.md."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

from .model import KINDS
from .tasks import TASK_ORDER
from .train import RunConfig, train, train_one_thread

PAPER_LR = 5e-4  # MADConfig's default rate: ties in the choice go to the rate nearest it


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit status 2), as every CLI of this project."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _names(text: str, allowed) -> list[str]:
    names = list(allowed) if text == "all" else [s for s in text.split(",") if s]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, bad)) or 'empty list'}; choose from "
                                         f"{', '.join(allowed)} or all")
    return names


def _seeds(text: str) -> list[int]:
    """'3' -> seeds 0, 1, 2; '0,5' -> seeds 0 and 5 ('7,' = seed 7)."""
    try:
        seeds = [int(s) for s in text.split(",") if s] if "," in text else list(range(int(text)))
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 0:
        raise argparse.ArgumentTypeError(f"a count >= 1 or a comma list of seeds >= 0, got {text!r}")
    return seeds


def _rates(text: str) -> list[float]:
    try:
        rates = [float(s) for s in text.split(",") if s]
    except ValueError:
        rates = []
    if not rates or not all(r > 0 and math.isfinite(r) for r in rates):
        raise argparse.ArgumentTypeError(f"positive learning rates, comma separated, got {text!r}")
    return sorted(set(rates))


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def parse_args(argv=None):
    p = _Parser(prog="python -m llm_surgery.bench.mad", description=__doc__)
    p.add_argument("--tasks", default="all", type=lambda s: _names(s, TASK_ORDER),
                   help=f"comma list of {', '.join(TASK_ORDER)}, or all")
    p.add_argument("--kinds", default="all", type=lambda s: _names(s, KINDS),
                   help=f"comma list of {', '.join(KINDS)} (attention: softmax, the reference), or all")
    p.add_argument("--seeds", default="3", type=_seeds, help="a count N (seeds 0..N-1) or a comma list")
    p.add_argument("--steps", default=None, type=_positive,
                   help="at most this many optimizer steps a run (default: MAD's 200 epochs, 20,000 steps; "
                        "memorize 400)")
    p.add_argument("--lr", default=str(PAPER_LR), type=_rates,
                   help="learning rate, or a comma list to choose from on the validation set (MAD's grid: "
                        "1e-4,5e-4,1e-3)")
    p.add_argument("--weight-decay", default=0.0, type=float, help="AdamW's weight decay (MAD's grid: 0, 0.1)")
    p.add_argument("--batch-size", default=128, type=_positive)
    p.add_argument("--eval-examples", default=None, type=_positive,
                   help="sequences in each of the validation and test sets (default: MAD's 1,280; a run "
                        "evaluates on at most as many as it trained on)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even where CUDA is available")
    p.add_argument("--jobs", default=1, type=_positive, help="runs in parallel (processes, one torch thread each)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="CUDA: run every training step eagerly")
    p.add_argument("--full-autotune", action="store_true",
                   help="CUDA: let Triton autotune every config (default: keep the first that runs)")
    p.add_argument("--out", default=None, help="append one JSON line per run to this file")
    p.add_argument("--summarize", default=None, metavar="FILE[,FILE]",
                   help="print the table of these --out files (the later file's run of a kind, task, rate and "
                        "seed replaces an earlier one) and exit")
    args = p.parse_args(argv)
    if not args.weight_decay >= 0 or not math.isfinite(args.weight_decay):
        p.error(f"--weight-decay: must be >= 0, got {args.weight_decay}")
    missing = [f for f in (args.summarize or "").split(",") if f and not os.path.isfile(f)]
    if missing:
        p.error(f"--summarize: no such file: {', '.join(missing)}")
    return args


def configs(args) -> list[RunConfig]:
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    extra = {} if args.eval_examples is None else {"eval_examples": args.eval_examples}
    out = [RunConfig(task=t, kind=k, seed=s, lr=lr, weight_decay=args.weight_decay, max_steps=args.steps,
                     batch_size=args.batch_size, device=device, validate=len(args.lr) > 1,
                     cuda_graphs=not args.no_cuda_graphs, **extra)
           for t in args.tasks for k in args.kinds for lr in args.lr for s in args.seeds]
    return out  # task by task, in --tasks' order: parallel workers finish the tasks one after another


def _mean_se(values: list[float]) -> tuple[float, float]:
    m = sum(values) / len(values)
    se = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1) / len(values)) if len(values) > 1 else 0.0
    return m, se


def select(rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """(kind, task) -> the runs of its chosen learning rate: the rate of best mean validation accuracy (MAD's
    metric) over seeds, ties to the rate nearest MAD's default. Test accuracy is never read."""
    by: dict[tuple[str, str], dict[float, list[dict]]] = {}
    for r in rows:
        by.setdefault((r["kind"], r["task"]), {}).setdefault(r["lr"], []).append(r)
    chosen = {}
    for key, per_lr in by.items():
        best = max(per_lr, key=lambda lr: (_mean_se([r.get("validation_acc", 0.0) for r in per_lr[lr]])[0],
                                           -abs(math.log(lr / PAPER_LR))))
        chosen[key] = sorted(per_lr[best], key=lambda r: r["seed"])
    return chosen


def table(rows: list[dict], key: str = "test_acc") -> str:
    """Markdown: one row per kind, one column per task (mean ± s.e. over seeds, %, with the chosen rate where
    several were run; † where not every rate of the grid finished, so no choice was made), and the average over
    the tasks that every kind of the table has."""
    chosen = select(rows)
    grid = {r["lr"] for r in rows}
    rates = {(r["kind"], r["task"], r["lr"]) for r in rows}
    tasks = [t for t in TASK_ORDER if any(k[1] == t for k in chosen)]
    kinds = [k for k in KINDS if any(c[0] == k for c in chosen)]
    common = [t for t in tasks if all((k, t) in chosen for k in kinds)]
    lines = ["| kind | " + " | ".join(tasks) + f" | avg of {len(common)} |", "| --- " * (len(tasks) + 2) + "|"]
    for kind in kinds:
        cells, means = [], {}
        for t in tasks:
            runs = chosen.get((kind, t))
            if not runs:
                cells.append("—")
                continue
            means[t], se = _mean_se([100 * r[key] for r in runs])
            full = all((kind, t, lr) in rates for lr in grid)
            cells.append(f"{means[t]:.1f} ± {se:.1f}" + (f" (lr {runs[0]['lr']:g})" if len(grid) > 1 else "")
                         + ("" if full else f" † {len(runs)} runs"))
        avg = sum(means[t] for t in common) / len(common) if common else float("nan")
        lines.append(f"| {kind} | " + " | ".join(cells) + f" | {avg:.1f} |")
    return "\n".join(lines)


def _several_rates(rows) -> bool:
    return len({r["lr"] for r in rows}) > 1


def _run_all(cfgs: list[RunConfig], jobs: int, quick_autotune: bool):
    """Yield rows as runs finish; with jobs > 1 in a pool of spawned processes (safe with CUDA)."""
    if quick_autotune:
        from ...triton_autotune import quick_autotune as patch
        patch()
    if jobs <= 1:
        for cfg in cfgs:
            yield train(cfg, log=lambda s: print(s, file=sys.stderr, flush=True))
        return
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed
    init = None
    if quick_autotune:
        from ...triton_autotune import quick_autotune as init
    with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn"), initializer=init) as pool:
        futures = {pool.submit(train_one_thread, cfg): cfg for cfg in cfgs}
        for fut in as_completed(futures):
            try:
                yield fut.result()
            except Exception as exc:  # one failed run must not lose the others
                cfg = futures[fut]
                print(f"run failed: {cfg.kind} {cfg.task} seed {cfg.seed} lr {cfg.lr:g}: {exc!r}"[:800],
                      file=sys.stderr, flush=True)


def read_rows(paths: str) -> list[dict]:
    rows = {}
    for path in paths.split(","):
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                rows[(r["kind"], r["task"], r["lr"], r["seed"])] = r
    return list(rows.values())


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.summarize:
        rows = read_rows(args.summarize)
        print(table(rows))
        return 0
    cfgs = configs(args)
    quick = cfgs[0].device == "cuda" and not args.full_autotune
    print(f"{len(cfgs)} runs on {cfgs[0].device}: tasks {', '.join(args.tasks)}; kinds {', '.join(args.kinds)}; "
          f"seeds {args.seeds}; lr {', '.join(f'{lr:g}' for lr in args.lr)}", flush=True)
    rows = []
    for r in _run_all(cfgs, args.jobs, quick):
        rows.append(r)
        print(f"{r['task']} (MAD {r['mad_task']}) {r['kind']} seed {r['seed']} lr {r['lr']:g}: "
              f"test accuracy {100 * r['test_acc']:.1f}% (per token {100 * r['test_acc_token']:.1f}%)"
              + (f", validation {100 * r['validation_acc']:.1f}%" if "validation_acc" in r else "")
              + f" [{r['steps']} steps, {r['seconds']:.1f}s]", flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(r) + "\n")
    if not rows:
        print("no run finished", file=sys.stderr)
        return 1
    print("\nTest accuracy (%, MAD's metric), mean ± s.e. over seeds"
          + (", at the rate chosen on the validation set:" if _several_rates(rows) else ":"))
    print(table(rows))
    return 0 if len(rows) == len(cfgs) else 1


if __name__ == "__main__":
    raise SystemExit(main())

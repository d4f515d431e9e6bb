"""In one GPU call: the paper's Table 1 (pdssm, mamba2, deltanet on four tasks, appendix B.1
setup) and one-layer group word problems (S3, A5; element and generator tokens), all runs in parallel with a
per-run time limit computed from one wall-clock budget, so the call cannot overrun.

    PYTHONPATH=$PWD python bench/state_tracking_gpu.py --budget 540                    # one H200, ~9 minutes
    PYTHONPATH=$PWD python bench/state_tracking_gpu.py --quick --device cpu --jobs 4   # CPU smoke test, ~70 s
    python bench/state_tracking_gpu.py --summarize a.jsonl,b.jsonl --plot len.png       # tables (+ plot) from JSONL
    PYTHONPATH=$PWD python bench/state_tracking_gpu.py --protocol table1 --mps --jobs 24 \
        --checkpoint-dir ck --pause-after 530        # every kind under one protocol (repeat until exit 0)

Every run is time-limited (the schedules run on time: warm-up, cosine decay, curriculum and tau all finish);
by default the runs go in --waves 2 waves of parallel processes (52 runs: 26 at a time); results go to --out
as one JSON line per run as they finish, and the tables are printed at the end.
The pdssm options are the CLI's defaults (llm_surgery/bench/state_tracking/train.py: cli_defaults; the
one-layer sizes in ONE_LAYER_RECIPES); Table 1 also runs the other preset for comparison (--t1-presets).
--t1-variants names pdssm option sets of VARIANTS to compare on Table 1 (the Table 1 option sweep); --mps runs the
processes under NVIDIA MPS; --val-every K validates every K steps on lengths 40..256, as the paper's baselines
do, and the tables then report the validation-selected weights beside the final ones (--plot-val draws the
validation curves). --protocol runs llm_surgery/bench/state_tracking/protocol.py instead of the sweep: a
learning-rate search, then the reported seeds at the chosen rates, every kind with the same settings and fixed
steps, spread over calls by --checkpoint-dir and --pause-after. See docs/bench/state_tracking.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

import torch

from llm_surgery.bench.state_tracking import protocol
from llm_surgery.bench.state_tracking.__main__ import _mean_se, _run_all
from llm_surgery.bench.state_tracking.resume import run_dir_name
from llm_surgery.bench.state_tracking.tasks import TABLE1_TASKS
from llm_surgery.bench.state_tracking.train import (ONE_LAYER_RECIPES, PDSSM_PRESETS, PRESET_TRAINING, TrainConfig,
                                                    cli_defaults, needs_retry, preset_for, quick_triton_autotune,
                                                    train)

GROUP_TASKS = protocol.GROUP_TASKS
PROTOCOL_PARTS = {"table1": TABLE1_TASKS, "groups": GROUP_TASKS}  # --protocol's parts
QUICK_STEPS = 32  # --quick --protocol: steps of a reported run
# Named pdssm variants for Table 1 (--t1-variants), compared side by side: each is exactly its options over the
# layer defaults (preset "layer"), as every one of them ran, whatever the CLI default is now.
VARIANTS = {
    "decay": dict(mixer=dict(b_gate="decay", x_init_std=1.0, decay_range=(1e-4, 1e-3))),
    "snap": dict(mixer=dict(unit_snap=0.01)),
    "decay+snap": dict(mixer=dict(b_gate="decay", x_init_std=1.0, unit_snap=0.01)),
    "decay+snap+perm": dict(mixer=dict(b_gate="decay", x_init_std=1.0, unit_snap=0.01, dict_init="permutation")),
    "snap5": dict(mixer=dict(unit_snap=0.05)),
    "decay+snap5": dict(mixer=dict(b_gate="decay", x_init_std=1.0, unit_snap=0.05)),
    "snap+q60": dict(mixer=dict(unit_snap=0.01, phase_levels=60)),
    "snap+q12": dict(mixer=dict(unit_snap=0.01, phase_levels=12)),
    "decay+snap+q60": dict(mixer=dict(b_gate="decay", x_init_std=1.0, unit_snap=0.01, phase_levels=60)),
    "snap+q10": dict(mixer=dict(unit_snap=0.01, phase_levels=10)),
    "snap+q10+conv1": dict(mixer=dict(unit_snap=0.01, phase_levels=10, conv_kernel=1)),
    "snap+q60+conv1": dict(mixer=dict(PDSSM_PRESETS["tracking"])),  # the tracking preset, by name in the sweep
    "robust+snap+q10": dict(mixer=dict(PDSSM_PRESETS["robust"], unit_snap=0.01, phase_levels=10)),
    # weight decay on the linear maps (the baselines' code decays with 1e-2)
    "tracking+wd1e-2": dict(weight_decay=0.01, mixer=dict(PDSSM_PRESETS["tracking"])),
    "tracking+wd1e-1": dict(weight_decay=0.1, mixer=dict(PDSSM_PRESETS["tracking"])),
    "tracking+snap5": dict(mixer=dict(PDSSM_PRESETS["tracking"], unit_snap=0.05)),
    "tracking+snap10": dict(mixer=dict(PDSSM_PRESETS["tracking"], unit_snap=0.1)),
    # b_t scaled by 1 - |D_t|: entries snapped to |D| = 1 take no input, so no state grows with length
    "tracking+decay": dict(mixer=dict(PDSSM_PRESETS["tracking"], b_gate="decay", x_init_std=1.0)),
    # validation judges an average of the weights (horizon ~1000 steps) instead of the live ones, whose
    # length generalisation swings by tens of points between checks
    "tracking+ema999": dict(ema_decay=0.999, mixer=dict(PDSSM_PRESETS["tracking"])),
    # a larger Adam epsilon, so that steps shrink once the loss (and the gradients) are ~0 instead of
    # moving the weights at the full learning rate on gradient noise
    "tracking+eps1e-6": dict(adam_eps=1e-6, mixer=dict(PDSSM_PRESETS["tracking"])),
    "tracking+eps1e-5": dict(adam_eps=1e-5, mixer=dict(PDSSM_PRESETS["tracking"])),
    "tracking+eps1e-4": dict(adam_eps=1e-4, mixer=dict(PDSSM_PRESETS["tracking"])),
    # = the "automaton" preset (the CLI default for >= 2 layers), by name in the sweep
    "tracking+decay+eps1e-6": dict(PRESET_TRAINING["automaton"], mixer=dict(PDSSM_PRESETS["automaton"])),
}


def plan(args) -> list[TrainConfig]:
    """All runs: Table 1 (2 layers, width 128) and the group word problems (one layer); pdssm seeds first within each."""
    # no retries inside a run: a retry would overrun the call's time budget (--retry-unfit plans them instead)
    base = dict(device=args.device, steps=args.steps, eval_batch=args.eval_batch, eval_every=args.val_every,
                retries=0)
    cfgs = []
    t1 = [("pdssm", None, args.t1_pdssm_seeds)]
    t1 += [("pdssm", p, args.t1_preset_seeds) for p in args.t1_presets.split(",") if p]
    t1 += [("mamba2", None, args.t1_other_seeds), ("deltanet", None, args.t1_other_seeds)]
    for kind, preset, seeds in t1:
        for task in TABLE1_TASKS:
            for seed in range(args.t1_seed_start, args.t1_seed_start + seeds):
                cfgs.append(cli_defaults(task=task, kind=kind, preset=preset, seed=seed, n_layers=2,
                                         d_model=args.d_model, batch_size=args.batch_size, **base))
    for name in (v for v in args.t1_variants.split(",") if v):
        if name not in VARIANTS:
            raise SystemExit(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
        for task in TABLE1_TASKS:
            for seed in range(args.t1_variant_seed_start, args.t1_variant_seed_start + args.t1_variant_seeds):
                cfgs.append(cli_defaults(task=task, kind="pdssm", preset="layer", seed=seed, n_layers=2,
                                         d_model=args.d_model, batch_size=args.batch_size, name=name,
                                         **VARIANTS[name], **base))
    for task in GROUP_TASKS:
        for kind, seeds in (("pdssm", args.g_pdssm_seeds), ("mamba2", args.g_other_seeds),
                            ("deltanet", args.g_other_seeds)):
            for seed in range(seeds):
                if kind == "pdssm":
                    cfgs.append(cli_defaults(task=task, kind=kind, seed=seed, batch_size=args.batch_size,
                                             **ONE_LAYER_RECIPES[task], **base))
                else:  # the comparison kinds: one layer at the Table 1 width and head setup
                    cfgs.append(cli_defaults(task=task, kind=kind, seed=seed, n_layers=1, d_model=args.d_model,
                                             batch_size=args.batch_size, **base))
    cfgs += retries_of(args.retry_unfit, args.retry_loss, args.device) if args.retry_unfit else []
    if args.quick:  # CPU smoke test: tiny models, a few seconds each
        cfgs = [c for c in tiny_models(cfgs) if c.seed == 0 or c.task in ("parity", "s3_gen")]
    return cfgs


def tiny_models(cfgs: list[TrainConfig]) -> list[TrainConfig]:
    """--quick: the same runs with tiny models and batches (a CPU test of the whole script)."""
    return [replace(c, d_model=min(c.d_model, 32), batch_size=8, eval_lengths=(40, 256), eval_batch=16,
                    mixer={**c.mixer, **({"num_heads": 4, "state_size": c.mixer.get("state_size", 8)}
                                         if c.kind == "pdssm" else {})},
                    **({"restarts": min(c.restarts, 2)} if c.restarts > 1 else {})) for c in cfgs]


def protocol_plan(args, chosen: dict | None = None) -> list[TrainConfig]:
    """--protocol: the learning-rate search runs, or (with `chosen`, protocol.select_lr's result) the reported
    runs of the (kind, task) pairs whose search is complete. --quick: tiny models, QUICK_STEPS steps."""
    tasks = [t for part in args.protocol.split(",") for t in PROTOCOL_PARTS[part]]
    only = [t for t in args.protocol_tasks.split(",") if t]
    if set(only) - set(tasks) or args.protocol_seeds < 1:
        raise SystemExit(f"--protocol-tasks must name tasks of {args.protocol} ({', '.join(tasks)}) and "
                         f"--protocol-seeds be >= 1, got {args.protocol_tasks!r}, {args.protocol_seeds}")
    kinds = [k for k in args.protocol_kinds.split(",") if k]
    if not kinds or set(kinds) - set(protocol.KINDS):
        raise SystemExit(f"--protocol-kinds must name kinds of {', '.join(protocol.KINDS)}, got {args.protocol_kinds!r}")
    tasks = [t for t in tasks if not only or t in only]
    common = dict(device=args.device, eval_batch=args.eval_batch)
    if chosen is None:
        cfgs = protocol.search_configs(kinds, tasks, **common)
    else:
        cfgs = protocol.final_configs(kinds, tasks, args.protocol_seeds, chosen, **common)
    if args.quick:  # the steps scaled down as in the protocol (the search trains SEARCH_FRAC of them)
        cfgs = [replace(c, steps=QUICK_STEPS if c.name == "protocol" else round(protocol.SEARCH_FRAC * QUICK_STEPS),
                        eval_every=QUICK_STEPS // 8) for c in tiny_models(cfgs)]
    return cfgs


def spread(cfgs: list[TrainConfig], gpus: int) -> list[TrainConfig]:
    """--gpus N: run i on cuda:(i mod N), so that the runs in flight share N GPUs evenly (a run may move to
    another GPU between calls: resume.MAY_CHANGE)."""
    return cfgs if gpus <= 1 else [replace(c, device=f"cuda:{i % gpus}") for i, c in enumerate(cfgs)]


def read_rows(paths: str) -> list[dict]:
    """The result lines of these JSONL files (comma list)."""
    rows = []
    for path in paths.split(","):
        with open(path) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if not r.get("paused")]


def retries_of(paths: str, retry_loss: float, device: str) -> list[TrainConfig]:
    """The next try of every unfit run in these results (train.needs_retry): what `train` with retries runs
    after the first try, as runs of their own so that a sweep can share the GPU between them and new runs."""
    out = []
    for r in last_attempts(read_rows(paths)):
        if needs_retry(r, retry_loss):
            c = dict(r["config"], device=device, retries=r["config"].get("attempt", 0) + 1)
            c["eval_lengths"] = tuple(c["eval_lengths"])
            if "decay_range" in c["mixer"]:
                c["mixer"] = dict(c["mixer"], decay_range=tuple(c["mixer"]["decay_range"]))
            out.append(replace(TrainConfig(**c), attempt=c["retries"]))
    return out


def last_attempts(rows: list[dict]) -> list[dict]:
    """Each run's last try only (a retried run's earlier result is replaced by its retry's)."""
    last: dict[tuple, dict] = {}
    for r in rows:
        key = (model_name(r), r["task"], r["config"]["n_layers"], r["seed"])
        if key not in last or r["config"].get("attempt", 0) >= last[key]["config"].get("attempt", 0):
            last[key] = r
    return list(last.values())


def with_time_limits(cfgs: list[TrainConfig], budget: float, jobs: int, reserve: float) -> list[TrainConfig]:
    """Per-run training time so that ceil(runs / jobs) waves fit in `budget - reserve` seconds; a run with
    restarts trains for time_limit * (1 + (R - 1) * restart_frac), so its own limit is shorter."""
    waves = math.ceil(len(cfgs) / jobs)
    slot = (budget - reserve) / waves
    out = []
    for c in cfgs:
        stretch = 1 + (c.restarts - 1) * c.restart_frac
        out.append(replace(c, time_limit_s=max(1.0, slot / stretch)))
    return out


def start_mps() -> bool:
    """Start NVIDIA's MPS daemon (if this machine has it) before any CUDA work: without it the GPU time-slices
    between the runs' processes, one at a time; with it their small kernels run side by side (H200,
    2026-11-22: 16 graphed runs made 730 steps/s together instead of 355; docs/bench/state_tracking.md). The spawned
    workers inherit the pipe directory. False (and the environment left as it was) where MPS is missing or a
    CUDA client cannot start under it."""
    control = shutil.which("nvidia-cuda-mps-control")
    if not control:
        return False
    env_before = {k: os.environ.get(k) for k in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")}
    for key in env_before:
        os.environ.setdefault(key, tempfile.mkdtemp(prefix=key.lower() + "_"))
    subprocess.run([control, "-d"], capture_output=True, stdin=subprocess.DEVNULL)  # it may be running already
    probe = subprocess.run([sys.executable, "-c", "import torch; torch.zeros(1).cuda()"], capture_output=True,
                           timeout=120)
    if probe.returncode == 0:
        return True
    subprocess.run([control], input=b"quit\n", capture_output=True)
    for key, value in env_before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    return False


def warm_up(device: str, d_model: int, cfgs: list[TrainConfig] = ()) -> float:
    """Build the pd_scan CUDA extension and compile the Triton kernels (at the runs' sizes) once, in this
    process, so that the parallel workers load them from the on-disk caches instead of all compiling at once.
    `cfgs`: warm up each distinct model of these runs (the protocol's sizes) rather than the Table 1 width."""
    t0 = time.time()
    models = {(c.kind, c.n_layers, c.d_model, json.dumps(c.mixer, sort_keys=True)): c for c in cfgs}
    tiny = dict(steps=8, batch_size=4, eval_lengths=(40, 47, 256), eval_batch=4, eval_every=0, device=device)
    runs = ([replace(c, **tiny) for c in models.values()] if models else
            [TrainConfig(task="parity", kind=kind, n_layers=1, d_model=d_model, **tiny)
             for kind in ("pdssm", "mamba2", "deltanet")])
    for c in runs:
        try:
            train(c)
        except Exception as exc:  # noqa: BLE001 - the runs of that kind will report the error themselves
            print(f"warm-up {c.kind} failed: {exc!r}"[:500], flush=True)
    return time.time() - t0


def model_name(row: dict) -> str:
    """'pdssm' for the CLI's default options at the row's depth, 'pdssm (robust preset)' etc. otherwise."""
    if row["kind"] != "pdssm":
        return row["kind"]
    if row["config"].get("name"):
        return f"pdssm ({row['config']['name']})"
    mixer = {k: tuple(v) if isinstance(v, list) else v for k, v in row["config"]["mixer"].items()}
    for name, opts in sorted(PDSSM_PRESETS.items(), key=lambda kv: -len(kv[1])):
        training = PRESET_TRAINING.get(name, {})
        if opts.items() <= mixer.items() and all(row["config"].get(k) == v for k, v in training.items()):
            return "pdssm" if name == preset_for(row["config"]["n_layers"]) else f"pdssm ({name} preset)"
    return "pdssm (other)"


def table1(rows: list[dict], key: str = "acc_mean") -> str:
    """Paper Table 1 layout: accuracy (%) averaged over lengths 40..256, mean ± s.e. over seeds; `key`
    "acc_selected_mean" for the validation-selected weights (rows that have them)."""
    rows = [r for r in rows if r["task"] in TABLE1_TASKS and r["config"]["n_layers"] == 2 and key in r]
    lines = ["| model | " + " | ".join(TABLE1_TASKS) + " | Avg. | seeds | steps |",
             "| --- " * (len(TABLE1_TASKS) + 4) + "|"]
    names = sorted({model_name(r) for r in rows}, key=lambda n: (n.split()[0] != "pdssm", n))
    for kind in names:
        mine = [r for r in rows if model_name(r) == kind]
        cells, means = [], []
        for task in TABLE1_TASKS:
            accs = [100 * r[key] for r in mine if r["task"] == task]
            cells.append(_mean_se(accs) if accs else "—")
            if accs:
                means.append(sum(accs) / len(accs))
        avg = f"{sum(means) / len(means):.1f}" if len(means) == len(TABLE1_TASKS) else "—"
        seeds = max(sum(r["task"] == t for r in mine) for t in TABLE1_TASKS)
        steps = f"{min(r['steps_run'] for r in mine)}-{max(r['steps_run'] for r in mine)}"
        lines.append(f"| {kind} | " + " | ".join(cells) + f" | {avg} | {seeds} | {steps} |")
    return "\n".join(lines)


def table9(rows: list[dict]) -> str:
    """The one-layer group problems' layout: seeds with >= 99% at the longest eval length, accuracy there per seed."""
    rows = [r for r in rows if r["task"] in GROUP_TASKS]
    lines = ["| task | kind | seeds >= 99% at 256 | acc at 256 per seed (%) | train loss | steps |",
             "| --- | --- | --- | --- | --- | --- |"]
    for task in GROUP_TASKS:
        for kind in ("pdssm", "mamba2", "deltanet"):
            mine = sorted((r for r in rows if r["task"] == task and r["kind"] == kind), key=lambda r: r["seed"])
            if not mine:
                continue
            ok = sum(r["acc_max_len"] >= 0.99 for r in mine)
            accs = ", ".join(f"{100 * r['acc_max_len']:.1f}" for r in mine)
            losses = ", ".join(f"{r['train_loss']:.3g}" for r in mine)
            steps = f"{min(r['steps_run'] for r in mine)}-{max(r['steps_run'] for r in mine)}"
            lines.append(f"| {task} | {kind} | {ok} of {len(mine)} | {accs} | {losses} | {steps} |")
    return "\n".join(lines)


def _task_panels(path: str, xlabel: str, ylabel: str, draw) -> None:
    """One panel per Table 1 task (`draw(ax, task)` plots it), the first panel's labels as a shared legend
    below (each label once), saved as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(TABLE1_TASKS), figsize=(4 * len(TABLE1_TASKS), 3.4), sharey=True)
    for ax, task in zip(axes, TABLE1_TASKS):
        draw(ax, task)
        ax.set_title(task)
        ax.set_xlabel(xlabel)
    axes[0].set_ylabel(ylabel)
    legend = dict(zip(*reversed(axes[0].get_legend_handles_labels())))  # label -> a handle, first-seen order
    fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=min(5, len(legend)), fontsize=8)
    fig.tight_layout(rect=(0, 0.06 * (1 + (len(legend) - 1) // 5), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_lengths(rows: list[dict], path: str) -> None:
    """Accuracy against evaluation length per Table 1 task, one line per model (mean over seeds): drift shows
    as a slope, a learned automaton as a flat line."""
    rows = [r for r in rows if r["task"] in TABLE1_TASKS and r["config"]["n_layers"] == 2]

    def draw(ax, task):
        by_model: dict[str, list[dict]] = {}
        for r in rows:
            if r["task"] == task:
                by_model.setdefault(model_name(r), []).append(r["acc"])
        for name, accs in sorted(by_model.items()):
            lengths = sorted(int(k) for k in accs[0])
            mean = [100 * sum(a[str(L)] for a in accs) / len(accs) for L in lengths]
            ax.plot(lengths, mean, marker=".", label=f"{name} ({len(accs)})")

    _task_panels(path, "evaluation length (trained on <= 40)", "accuracy (%)", draw)


def plot_validation(rows: list[dict], path: str) -> None:
    """Validation accuracy (mean over lengths 40..256) against training step, one thin line per run, per Table 1
    task and model: length generalisation rises and falls during training while the training loss stays ~0."""
    rows = [r for r in rows if r["task"] in TABLE1_TASKS and r.get("val_curve")]
    colors = {n: f"C{i}" for i, n in enumerate(sorted({model_name(r) for r in rows}))}

    def draw(ax, task):
        for r in rows:
            if r["task"] == task:
                steps, accs = zip(*r["val_curve"])
                ax.plot(steps, [100 * a for a in accs], color=colors[model_name(r)], lw=0.8, alpha=0.7,
                        label=model_name(r))

    _task_panels(path, "training step", "validation accuracy, lengths 40..256 (%)", draw)


def summarize(rows: list[dict]) -> str:
    """The protocol's tables (protocol.tables) for its runs, the sweep tables for the others."""
    def is_ours(r):
        return r["config"].get("name", "") == "protocol" or r["config"].get("name", "").startswith("search-")
    ours, rows = [r for r in rows if is_ours(r)], [r for r in rows if not is_ours(r)]
    text = protocol.tables(ours) if ours else ""
    if rows or not ours:
        text += ("\n\n" if text else "") + sweep_tables(rows)
    return text


def sweep_tables(rows: list[dict]) -> str:
    retried = sum(r["config"].get("attempt", 0) > 0 for r in rows)
    rows = last_attempts(rows)
    text = (f"({retried} results are retries of unfit runs: they replace the earlier tries)\n" if retried else "")
    text += "Table 1 sweep (2 layers, width 128), final weights:\n" + table1(rows)
    if any("acc_selected_mean" in r for r in rows):
        text += ("\n\nTable 1, weights selected by validation on lengths 40..256 during training (--val-every; "
                 "the test sequences are apart from the validation ones):\n" + table1(rows, "acc_selected_mean"))
    return text + "\n\nGroup word problems (one layer; pdssm with the CLI defaults):\n" + table9(rows)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=None, help="wall seconds for the whole call (540; --quick: 60)")
    ap.add_argument("--reserve", type=float, default=0.0,
                    help="seconds kept for start-up, warm-up and evaluation (default: 10%% of the budget + 25)")
    ap.add_argument("--jobs", type=int, default=0, help="parallel runs (default: all runs in --waves waves)")
    ap.add_argument("--waves", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "state_tracking_gpu.jsonl"))
    ap.add_argument("--steps", type=int, default=100_000, help="step cap (the time limit normally stops first)")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--eval-batch", type=int, default=256,
                    help="sequences per eval length (40 processes with 512 ran an H200 out of "
                         "memory, 24 with 256 did not)")
    ap.add_argument("--t1-pdssm-seeds", type=int, default=2)
    ap.add_argument("--t1-other-seeds", type=int, default=1)
    ap.add_argument("--t1-seed-start", type=int, default=0, help="first seed of the Table 1 runs (not variants)")
    ap.add_argument("--t1-presets", default=",".join(p for p in sorted(PDSSM_PRESETS) if p != preset_for(2)),
                    help="other pdssm presets to compare in Table 1 (comma list; '' for none)")
    ap.add_argument("--t1-preset-seeds", type=int, default=2)
    ap.add_argument("--t1-variants", default="", help=f"named pdssm variants for Table 1: {', '.join(VARIANTS)}")
    ap.add_argument("--t1-variant-seeds", type=int, default=1)
    ap.add_argument("--t1-variant-seed-start", type=int, default=0, help="first seed of the variants' runs")
    ap.add_argument("--retry-unfit", default=None,
                    help="also run the next try of every unfit run in these results (JSONL, comma list): "
                         "train.needs_retry, as --retries does within one run")
    ap.add_argument("--retry-loss", type=float, default=TrainConfig.retry_loss,
                    help="training loss above which a finished run is unfit (nats)")
    ap.add_argument("--g-pdssm-seeds", type=int, default=5)
    ap.add_argument("--g-other-seeds", type=int, default=1)
    ap.add_argument("--val-every", type=int, default=500,
                    help="validate every K steps on lengths 40..256 and keep the best weights (0: off); the "
                         "tables report them beside the final weights")
    ap.add_argument("--run-time", type=float, default=None,
                    help="training seconds per run, fixed (default: computed from --budget); a run longer than one "
                         "call: with --checkpoint-dir and --pause-after, the same command continues it")
    ap.add_argument("--checkpoint-dir", default=None,
                    help="resumable runs: a folder per run here (llm_surgery/bench/state_tracking/resume.py)")
    ap.add_argument("--pause-after", type=float, default=None,
                    help="with --checkpoint-dir: pause the runs this many seconds after the start (exit status 3 "
                         "while runs remain paused)")
    ap.add_argument("--gpus", type=int, default=1,
                    help="spread the runs over this many GPUs (cuda:0..N-1, round robin; with --device cuda)")
    ap.add_argument("--mps", action="store_true", help="CUDA: run the processes under NVIDIA MPS (start_mps)")
    ap.add_argument("--protocol", default=None, choices=["table1", "groups", "table1,groups"], metavar="SETTINGS",
                    help="table1, groups or table1,groups: run the common protocol (llm_surgery/bench/state_tracking/protocol.py) on these settings "
                         "instead of the sweep: a learning-rate search, then the reported seeds at the chosen "
                         "rates; fixed steps (resume across calls with --checkpoint-dir and --pause-after)")
    ap.add_argument("--protocol-seeds", type=int, default=5, help="reported seeds per kind and task (0..n-1)")
    ap.add_argument("--protocol-tasks", default="", help="only these tasks of the --protocol settings (comma list)")
    ap.add_argument("--protocol-kinds", default=",".join(protocol.KINDS),
                    help="only these kinds (comma list): after one kind's recipe changed, run that kind again")
    ap.add_argument("--quick", action="store_true", help="tiny models (CPU test of the whole script)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and time limits only")
    ap.add_argument("--summarize", default=None, help="print the tables of these JSONL files (comma list) and exit")
    ap.add_argument("--plot", default=None, help="with --summarize: accuracy against length per task, to this PNG")
    ap.add_argument("--plot-val", default=None,
                    help="with --summarize: validation accuracy against training step per run, to this PNG")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.pause_after is not None and not args.checkpoint_dir:
        raise SystemExit("--pause-after needs --checkpoint-dir (where the paused runs are kept)")
    if args.checkpoint_dir and not args.val_every:
        raise SystemExit("--checkpoint-dir needs --val-every > 0 (runs checkpoint at each validation)")
    if args.summarize:
        rows = read_rows(args.summarize)
        print(summarize(rows))
        if args.plot:
            plot_lengths(rows, args.plot)
        if args.plot_val:
            plot_validation(rows, args.plot_val)
        return 0
    if args.protocol and (args.run_time or args.retry_unfit):
        raise SystemExit("--protocol fixes steps, not time, and has no retries: drop --run-time and --retry-unfit")
    start = time.time()
    args.budget = args.budget or (60.0 if args.quick else 540.0)
    reserve = args.reserve or (20.0 if args.quick else 0.1 * args.budget + 25)
    if args.gpus > 1 and args.device != "cuda":
        raise SystemExit(f"--gpus {args.gpus} needs --device cuda (the runs go to cuda:0 .. cuda:{args.gpus - 1})")
    cfgs = spread(protocol_plan(args) if args.protocol else plan(args), args.gpus)
    args.jobs = args.jobs or math.ceil(len(cfgs) / args.waves)
    print(f"{len(cfgs)} runs, {args.jobs} jobs, {math.ceil(len(cfgs) / args.jobs)} waves, budget {args.budget:.0f}s",
          flush=True)
    if args.dry_run:
        for c in cfgs if args.protocol else with_time_limits(cfgs, args.budget, args.jobs, reserve):
            print(c.kind, c.task, c.seed, c.n_layers, c.d_model, c.mixer, f"restarts {c.restarts}",
                  f"steps {c.steps} lr {c.lr:g}" if args.protocol else f"limit {c.time_limit_s:.0f}s")
        return 0
    from llm_surgery.cli import check_device

    try:  # before any work: otherwise every run fails on its own
        check_device(args.device)
    except ValueError as e:
        print(f"{os.path.basename(sys.argv[0])}: error: {e}", file=sys.stderr)
        return 2
    quick = args.device.startswith("cuda")
    if quick and args.mps:
        print(f"MPS: {start_mps()}", flush=True)
    if quick and args.gpus > 1 and (found := torch.cuda.device_count()) < args.gpus:  # (after MPS's start)
        raise SystemExit(f"--gpus {args.gpus}: this machine has {found} CUDA devices")
    if quick:
        print(f"quick Triton autotune: {quick_triton_autotune()}", flush=True)
        print(f"warm-up (kernel builds, compiles): "
              f"{warm_up(args.device, args.d_model, cfgs if args.protocol else ()):.0f}s", flush=True)
    if not args.protocol:  # (the protocol's runs take a fixed number of steps, the same for every kind)
        if args.run_time:  # fixed, so that every call of a resumed sweep builds the same configs
            cfgs = [replace(c, time_limit_s=args.run_time / (1 + (c.restarts - 1) * c.restart_frac)) for c in cfgs]
        else:
            cfgs = with_time_limits(cfgs, args.budget - (time.time() - start), args.jobs, reserve)
        print(f"per-run training time limit (no restarts): {max(c.time_limit_s for c in cfgs):.0f}s", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    deadline = None if args.pause_after is None else start + args.pause_after
    rows, paused = run_configs(cfgs, args, start, deadline)
    expected = len(cfgs)
    if args.protocol and not paused:  # the search is complete: the reported runs at the chosen rates
        final = spread(protocol_plan(args, protocol.select_lr(rows)), args.gpus)
        print(f"learning-rate search done; {len(final)} reported runs", flush=True)
        more, paused = run_configs(final, args, start, deadline)
        rows, expected = rows + more, expected + len(final)
    print(f"\n{len(rows)} of {expected} runs in {time.time() - start:.0f}s ({paused} paused); results in "
          f"{args.out}\n")
    print(summarize(rows))
    return 3 if paused else 0 if len(rows) == expected else 1


def run_configs(cfgs: list[TrainConfig], args, start: float, deadline: float | None) -> tuple[list[dict], int]:
    """Run `cfgs` (resumable under --checkpoint-dir, paused at `deadline`), print and append each result to
    --out as it finishes; the results and the number of paused runs."""
    rows, paused = [], 0
    run_dirs = [os.path.join(args.checkpoint_dir, run_dir_name(c)) for c in cfgs] if args.checkpoint_dir else None
    for r in _run_all(cfgs, args.jobs, quick_autotune=args.device.startswith("cuda"), run_dirs=run_dirs,
                      deadline=deadline):
        if r.get("paused"):
            paused += 1
            print(f"[{time.time() - start:.0f}s] {r['kind']} {r['task']} seed {r['seed']}: paused at step "
                  f"{r['steps_run']} ({r['train_seconds']}s trained)", flush=True)
            continue
        rows.append(r)
        print(f"[{time.time() - start:.0f}s] {r['kind']} {r['task']} L{r['config']['n_layers']} seed {r['seed']}"
              f"{' ' + r['config']['name'] if r['config'].get('name') else ''}: "
              f"acc 40..256 {100 * r['acc_mean']:.1f}%, at 256 {100 * r['acc_max_len']:.1f}%, "
              + (f"selected {100 * r['acc_selected_mean']:.1f}% (step {r['val_best_step']}), "
                 if "acc_selected_mean" in r else "") +
              f"loss {r['train_loss']:.3g} ({r['steps_run']} steps, {r['seconds']}s)", flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(r) + "\n")
    return rows, paused


if __name__ == "__main__":
    sys.exit(main())

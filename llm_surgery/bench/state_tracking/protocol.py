"""One protocol for every mixer kind: the same steps, curriculum, validation-based selection, optimizer
and learning-rate search for pdssm, mamba2 and deltanet, with models whose parameter counts match within 5%.

Two stages per (kind, task):
1. search: each rate of LR_GRID trains SEARCH_SEEDS (seeds apart from the reported ones) for SEARCH_FRAC of the
   steps; the rate whose runs reach the best mean validation accuracy (lengths 40..256, `val_best`) is chosen.
   Test accuracy is never read.
2. final: the chosen rate trains the reported seeds 0..n-1 for the full steps; the tables report the
   validation-selected weights on the separate test sequences. No retries.

What differs between kinds is the mixer's own options only: pdssm the CLI default preset (`automaton` for
Table 1, the one-layer recipes of ONE_LAYER_RECIPES), mamba2 and deltanet their layer defaults at the sizes of
MATCHED, chosen so that the whole model's count is within 5% of pdssm's at the same width and depth.
"""

from __future__ import annotations

import math

from ...layers.registry import MIXER_KINDS
from .__main__ import _mean_se
from .tasks import TABLE1_TASKS
from .train import ONE_LAYER_RECIPES, TrainConfig, build_model, cli_defaults

GROUP_TASKS = ("s3", "s3_gen", "a5", "a5_gen")
KINDS = MIXER_KINDS
# Training settings shared by every kind. pdssm's Table 1 settings as in BENCHMARKS.md's table (its ~37k steps a
# run, validation every 500 steps, curriculum over 30%, Adam eps 1e-6), now fixed in steps rather than seconds, so
# that every kind gets the same number of updates whatever its speed.
PROTOCOL = dict(batch_size=256, weight_decay=0.0, adam_eps=1e-6, warmup_frac=0.1, grad_clip=1.0,
                curriculum_frac=0.3, curriculum_mode="linear", eval_every=500, stop_acc=1.0, time_limit_s=0.0,
                ema_decay=0.0, restarts=1, retries=0, tau_start=1.0, tau_end=1.0)
STEPS = {"table1": 37_000, "groups": 10_000}  # full runs per setting; the search trains SEARCH_FRAC of them
LR_GRID = (1e-3, 2e-3, 4e-3)  # around the paper's 2e-3 (appendix B.1), the same grid for every kind
SEARCH_SEEDS = (100, 101)
SEARCH_FRAC = 0.25
PAPER_LR = 2e-3  # a tie in the search goes to the rate nearest this one
# Mixer sizes of the comparison kinds per setting ("table1": 2 layers of width 128; a group task: one layer at
# the width of pdssm's recipe). Whole-model counts (param_counts): Table 1 pdssm 347k, mamba2 +1.7%, deltanet -3.1%;
# S3 pdssm 26k, mamba2 +2.3%, deltanet +0.5%; A5 (elements, K = 120) 82k, +0.6%, +0.1%; A5 (generators) 39k,
# +0.2%, -0.6%.
# Mamba2's inner width stays an integer multiple of the width (mamba-ssm's module holds it then).
MATCHED = {
    "table1": {"mamba2": dict(num_heads=4, head_dim=96, state_size=96, n_groups=1),
               "deltanet": dict(num_heads=4, head_dim=64)},
    "s3": {"mamba2": dict(num_heads=2, head_dim=32, state_size=96, n_groups=1),
           "deltanet": dict(num_heads=3, head_dim=16, value_head_dim=32)},
    "a5": {"mamba2": dict(num_heads=10, head_dim=16, state_size=96, n_groups=2),
           "deltanet": dict(num_heads=5, head_dim=16, value_head_dim=48)},
    "a5_gen": {"mamba2": dict(num_heads=5, head_dim=16, state_size=80, n_groups=1),
               "deltanet": dict(num_heads=5, head_dim=16)},
}
MATCHED["s3_gen"] = MATCHED["s3"]


def setting(task: str) -> str:
    """'table1' for the paper's Table 1 tasks (two layers), else the group task's own name (one layer)."""
    if task in TABLE1_TASKS:
        return "table1"
    if task in GROUP_TASKS:
        return task
    raise ValueError(f"task {task!r} is in no protocol setting; choose from {', '.join(TABLE1_TASKS + GROUP_TASKS)}")


def model_options(kind: str, task: str) -> dict:
    """Depth, width and mixer options of `kind` in `task`'s setting: the only fields that differ between kinds."""
    s = setting(task)
    if s == "table1":
        shape = dict(n_layers=2, d_model=128)
    else:
        shape = dict(n_layers=1, d_model=ONE_LAYER_RECIPES[task]["d_model"])
    if kind == "pdssm":
        return dict(shape, mixer=dict(ONE_LAYER_RECIPES[task]["mixer"]) if s != "table1" else {})
    if kind not in MATCHED[s]:
        raise ValueError(f"unknown kind {kind!r}; choose from {', '.join(KINDS)}")
    return dict(shape, mixer=dict(MATCHED[s][kind]))


def config(kind: str, task: str, seed: int, lr: float, stage: str = "final", **overrides) -> TrainConfig:
    """The protocol's run of `kind` on `task`: stage "final" (full steps, name "protocol") or "search"
    (SEARCH_FRAC of the steps, name "search-lr<lr>"); `overrides` (device, eval_batch) are the same for all."""
    steps = STEPS["table1" if setting(task) == "table1" else "groups"]
    if stage == "search":
        steps, name = max(1, round(SEARCH_FRAC * steps)), f"search-lr{lr:g}"
    elif stage == "final":
        name = "protocol"
    else:
        raise ValueError(f"stage must be 'search' or 'final', got {stage!r}")
    return cli_defaults(kind, task=task, seed=seed, lr=lr, steps=steps, name=name,
                        **{**PROTOCOL, **model_options(kind, task), **overrides})


def search_configs(kinds, tasks, **overrides) -> list[TrainConfig]:
    return [config(k, t, s, lr, "search", **overrides) for t in tasks for k in kinds for lr in LR_GRID
            for s in SEARCH_SEEDS]


def select_lr(rows: list[dict]) -> dict[tuple[str, str], float]:
    """(kind, task) -> the learning rate whose search runs reach the best mean validation accuracy, for every
    (kind, task) whose search is complete (every rate, every search seed). Reads `val_best` only, never test."""
    scores: dict[tuple[str, str], dict[float, list[float]]] = {}
    for r in rows:
        if r["config"].get("name", "").startswith("search-"):
            scores.setdefault((r["kind"], r["task"]), {}).setdefault(r["config"]["lr"], []).append(r["val_best"])
    chosen = {}
    for key, by_lr in scores.items():
        if set(by_lr) == set(LR_GRID) and all(len(v) == len(SEARCH_SEEDS) for v in by_lr.values()):
            chosen[key] = max(LR_GRID, key=lambda lr: (sum(by_lr[lr]) / len(by_lr[lr]),
                                                        -abs(math.log(lr / PAPER_LR))))
    return chosen


def final_configs(kinds, tasks, seeds: int, chosen: dict, **overrides) -> list[TrainConfig]:
    """The reported runs of every (kind, task) whose learning rate has been chosen (select_lr)."""
    return [config(k, t, s, chosen[(k, t)], "final", **overrides) for t in tasks for k in kinds
            if (k, t) in chosen for s in range(seeds)]


def param_counts(task: str) -> dict[str, int]:
    """Whole-model parameter count per kind in `task`'s protocol setting."""
    return {k: sum(p.numel() for p in build_model(config(k, task, 0, PAPER_LR)).parameters()) for k in KINDS}


def param_report(tasks=("parity",) + GROUP_TASKS) -> str:
    """Markdown table of the protocol's parameter counts, each kind against pdssm's."""
    lines = ["| task (setting) | " + " | ".join(KINDS) + " |", "| --- " * (len(KINDS) + 1) + "|"]
    for t in tasks:
        c = param_counts(t)
        lines.append(f"| {t} ({setting(t)}) | " + " | ".join(
            f"{c[k]:,}" + ("" if k == "pdssm" else f" ({100 * (c[k] / c['pdssm'] - 1):+.1f}%)") for k in KINDS) + " |")
    return "\n".join(lines)


def tables(rows: list[dict]) -> str:
    """The headline tables of the protocol's final runs (validation-selected weights on the test sequences):
    Table 1 (mean ± s.e. over seeds of the accuracy over lengths 40..256) and the one-layer group problems
    (seeds at >= 99% at the longest length, and per seed the largest image of the group that one pdssm head tracks:
    group_image.py). One row per kind (and group task); no retries. Of two results of one (kind, task, seed), the
    later in `rows` counts: a task run again (with a changed recipe, in a later call's file) replaces the earlier."""
    rows = list({(r["kind"], r["task"], r["seed"]): r for r in rows if r["config"].get("name") == "protocol"}.values())
    out = ["Table 1 under one protocol (validation-selected weights, test sequences):",
           "| model | " + " | ".join(TABLE1_TASKS) + " | Avg. | seeds | steps | lr | params |",
           "| --- " * (len(TABLE1_TASKS) + 6) + "|"]
    for kind in KINDS:
        mine = [r for r in rows if r["kind"] == kind and r["task"] in TABLE1_TASKS]
        if not mine:
            continue
        cells, means, lrs = [], [], []
        for task in TABLE1_TASKS:
            accs = [100 * r["acc_selected_mean"] for r in mine if r["task"] == task]
            cells.append(_mean_se(accs) if accs else "—")
            means += [sum(accs) / len(accs)] if accs else []
            lrs += [f"{r['config']['lr']:g}" for r in mine if r["task"] == task][:1]
        avg = f"{sum(means) / len(means):.1f}" if len(means) == len(TABLE1_TASKS) else "—"
        seeds = min(sum(r["task"] == t for r in mine) for t in {r["task"] for r in mine})
        steps = f"{min(r['steps_run'] for r in mine)}-{max(r['steps_run'] for r in mine)}"
        out.append(f"| {kind} | " + " | ".join(cells) + f" | {avg} | {seeds} | {steps} | {', '.join(lrs)} | "
                   f"{mine[0]['params']:,} |")
    out += ["", "One layer, group word problems under one protocol (validation-selected weights):",
            "| task | kind | seeds >= 99% at the longest length | acc there per seed (%) | steps | lr | params | "
            "largest image a head tracks (tokens on the natural action, best head), per seed |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for task in GROUP_TASKS:
        for kind in KINDS:
            mine = sorted((r for r in rows if r["task"] == task and r["kind"] == kind), key=lambda r: r["seed"])
            if not mine:
                continue
            at = [r["acc_selected"][str(max(map(int, r["acc_selected"])))] for r in mine]
            steps = f"{min(r['steps_run'] for r in mine)}-{max(r['steps_run'] for r in mine)}"
            images = (", ".join(_image_cell(r.get("group_image")) for r in mine)
                      if any("group_image" in r for r in mine) else "—")
            out.append(f"| {task} | {kind} | {sum(a >= 0.99 for a in at)} of {len(at)} | "
                       f"{', '.join(f'{100 * a:.1f}' for a in at)} | {steps} | {mine[0]['config']['lr']:g} | "
                       f"{mine[0]['params']:,} | {images} |")
    return "\n".join(out)


def _image_cell(g: dict | None) -> str:
    """'6 (6/6)': the largest image of the group one head tracks, and the most tokens one head maps as the group's
    natural action (group_image.summary); '?' for a run without it."""
    if g is None:
        return "?"
    return f"{g['largest']}" + (f" ({g['closest']}/{g['symbols']})" if g.get("closest") is not None else "")

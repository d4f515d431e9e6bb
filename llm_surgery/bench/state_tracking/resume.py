"""Pause a state-tracking run and resume it exactly, so that the paper's 100k-step runs fit into time-boxed calls.

A run directory holds `step-NNNNNNNN/` checkpoints (the newest kept), written atomically as the trainer's
(train/checkpoint.py: temporary directory, fsync, rename), and, once the run has finished, `result.json`.
A checkpoint is everything the rest of the run depends on: weights, AdamW's moments and step counts, the
weight average and the validation-selected weights, both data generators, the step, the training clock, the
curriculum and the validation history. Resuming from it continues the same step sequence (checked on the CPU
by tests/test_state_tracking_resume.py: an interrupted run ends with the uninterrupted run's weights).

    run.safetensors   model.*, best.*, ema.<i>, optim.<i>.<state>, rng.gen, rng.probe
    state.json        step, clock, losses, curriculum, validation curve, the run's config
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ...train.checkpoint import CheckpointError, list_checkpoints, publish

FILES = ("run.safetensors", "state.json")
RESULT = "result.json"
# config fields that may differ between the call that paused and the one that resumes (nothing else may)
MAY_CHANGE = ("device", "cuda_graphs")


def run_dir_name(cfg) -> str:
    """A run's folder under a sweep's checkpoint directory: kind, variant name, task, seed (and try, after the
    first: the name `train` gives a retry of a run in `<run_dir>-attempt<k>`)."""
    parts = (cfg.kind, cfg.name.replace("/", "_"), cfg.task, f"seed{cfg.seed}", cfg.attempt and f"attempt{cfg.attempt}")
    return "-".join(p for p in parts if p)


def config_dict(cfg) -> dict:
    """The run's config as JSON-ready values (tuples as lists), the form stored and compared."""
    return json.loads(json.dumps(asdict(cfg)))


def check_config(stored: dict, cfg, where: Path) -> None:
    """A checkpoint resumes only the run it came from: any differing field (but MAY_CHANGE) is an error."""
    now = config_dict(cfg)
    diff = sorted(k for k in set(stored) | set(now) if k not in MAY_CHANGE and stored.get(k) != now.get(k))
    if diff:
        shown = ", ".join(f"{k}: {stored.get(k)!r} there, {now.get(k)!r} now" for k in diff[:4])
        raise CheckpointError(f"{where} belongs to another run configuration ({shown}); use another "
                              "checkpoint directory or the same options")


def _tensors(run) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in run.model.state_dict().items()}
    if run.best_state is not None:
        out.update({f"best.{k}": v for k, v in run.best_state.items()})
    for i, t in enumerate(run.ema or []):
        out[f"ema.{i}"] = t
    for i, state in run.opt.state_dict()["state"].items():
        for key, value in state.items():
            if not torch.is_tensor(value):
                raise TypeError(f"optimizer state {key!r} is not a tensor ({type(value).__name__})")
            out[f"optim.{i}.{key}"] = value
    out["rng.gen"] = run.gen.get_state()
    out["rng.probe"] = run.probe_gen.get_state()
    # safetensors stores each tensor on its own: contiguous CPU copies (tied or shared storage is fine)
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in out.items()}


def save_run(run, run_dir: str | os.PathLike) -> Path:
    """Write the run's checkpoint at its current step; returns its directory."""
    root = Path(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{run.step:08d}"
    tmp = root / f".tmp-step-{run.step:08d}"
    tmp.mkdir(exist_ok=True)
    save_file(_tensors(run), tmp / "run.safetensors")
    state = {"step": run.step, "seconds": run.seconds, "losses": run.losses, "done": bool(run.done),
             "cur_len": run.cur_len, "val_curve": run.val_curve, "best_val": run.best_val,
             "best_step": run.best_step, "seed": run.seed, "config": config_dict(run.cfg)}
    (tmp / "state.json").write_text(json.dumps(state, indent=1))
    publish(tmp, final, keep_last=1)
    return final


def latest(run_dir: str | os.PathLike) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def load_run(run, run_dir: str | os.PathLike) -> bool:
    """Restore `run` (freshly built from the same config) from the newest checkpoint in `run_dir`; False when
    there is none. Call before the first training step (captured CUDA graphs keep the optimizer's tensors)."""
    path = latest(run_dir)
    if path is None:
        return False
    missing = [f for f in FILES if not (path / f).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {path} is incomplete: missing {', '.join(missing)}")
    try:
        state = json.loads((path / "state.json").read_text())
        tensors = load_file(path / "run.safetensors")
    except Exception as e:  # any decode failure
        raise CheckpointError(f"checkpoint {path} is corrupt: {type(e).__name__}: {e}") from None
    check_config(state["config"], run.cfg, path)
    if state["seed"] != run.seed:
        raise CheckpointError(f"checkpoint {path} is of seed {state['seed']}, this run's seed is {run.seed}")
    part = {}
    for key, value in tensors.items():
        head, _, rest = key.partition(".")
        part.setdefault(head, {})[rest] = value
    try:
        run.model.load_state_dict(part["model"])
    except RuntimeError as e:
        raise CheckpointError(f"checkpoint {path} does not fit the model: {e}") from None
    device = next(run.model.parameters()).device
    run.best_state = {k: v.to(device) for k, v in part["best"].items()} if "best" in part else None
    if run.ema is not None:
        for i, t in enumerate(run.ema):
            t.copy_(part["ema"][str(i)])
    optim: dict[int, dict] = {}
    for key, value in part.get("optim", {}).items():
        i, _, name = key.partition(".")
        optim.setdefault(int(i), {})[name] = value
    sd = run.opt.state_dict()
    sd["state"] = optim
    run.opt.load_state_dict(sd)
    run.gen.set_state(part["rng"]["gen"])
    run.probe_gen.set_state(part["rng"]["probe"])
    run.step, run.seconds, run.losses = state["step"], state["seconds"], state["losses"]
    run.done, run.cur_len = state["done"], state["cur_len"]
    run.val_curve = [tuple(v) for v in state["val_curve"]]
    run.best_val, run.best_step = state["best_val"], state["best_step"]
    return True


def save_result(result: dict, run_dir: str | os.PathLike) -> None:
    """The finished run's results, written atomically: a later call returns them instead of training again."""
    root = Path(run_dir)
    tmp = root / f".{RESULT}.tmp"
    tmp.write_text(json.dumps(result))
    os.replace(tmp, root / RESULT)


def load_result(cfg, run_dir: str | os.PathLike) -> dict | None:
    """The results of the finished run in `run_dir` (None if it has not finished)."""
    path = Path(run_dir) / RESULT
    if not path.is_file():
        return None
    try:
        result = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is corrupt: {e}") from None
    check_config(result["config"], cfg, path)
    return result

"""Resumable checkpoints that hold only what training changes: the trainable weights (inserted layers, LoRA),
optimizer, scheduler, every rank's RNG states and the data position. Written atomically (temporary directory,
fsync, rename), so a run killed mid-write leaves the previous checkpoint intact; the last N of the run are kept
(state.json carries the run's id and settings: pruning touches only that run's checkpoints, and a resume compares
the settings).

Why not Accelerate's `save_state`/`load_state`: they save the whole model (a frozen multi-GB host with every
checkpoint, where this keeps the trainable ~1-5%), in their own layout with no run id, settings check or pruning per
run, and would still need this module's atomic write around them; the few lines here are the simpler of the two.

Layout of `<output_dir>/checkpoints/step-00000100/`:
  trainable.safetensors  optimizer.pt  scheduler.pt  rng-rank{r}.pt  state.json
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

STEP_DIR = re.compile(r"^step-(\d{8})$")
REQUIRED = ("trainable.safetensors", "optimizer.pt", "scheduler.pt", "state.json")


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, corrupt or from an incompatible run."""


# ---------------------------------------------------------------- RNG

def rng_state() -> dict:
    """Every RNG a step can draw from, as tensors and lists (loadable with weights_only=True)."""
    np_state = np.random.get_state()
    state = {
        "python": [list(x) if isinstance(x, tuple) else x for x in random.getstate()],
        "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_pos": [int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    pos, has_gauss, cached = state["numpy_pos"]
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ---------------------------------------------------------------- files

def fsync_tree(path: Path) -> None:
    for f in path.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_dir(tmp: Path, final: Path) -> None:
    """Rename the written directory `tmp` to `final`. An older `final` is first moved aside, then deleted: a crash
    leaves the old directory (possibly under its aside name) or the new one, never half of one."""
    aside = final.with_name(f".old-{final.name}")
    if aside.exists():
        shutil.rmtree(aside)
    if final.exists():
        os.replace(final, aside)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    shutil.rmtree(aside, ignore_errors=True)


def publish(tmp: Path, final: Path, keep_last: int, run_id: str | None = None) -> None:
    """Make a fully written temporary directory the checkpoint `final` (fsync, then rename) and keep the newest
    `keep_last` checkpoints of its folder: of run `run_id` alone when given (other runs' are never touched)."""
    fsync_tree(tmp)
    replace_dir(tmp, final)
    mine = [p for p in list_checkpoints(final.parent) if run_id is None or checkpoint_run_id(p) == run_id]
    for old in mine[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def checkpoint_run_id(path: Path) -> str | None:
    """The run id in a checkpoint's state.json (None when unreadable or absent)."""
    try:
        return json.loads((path / "state.json").read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def list_checkpoints(ckpt_root: str | os.PathLike) -> list[Path]:
    """Finished checkpoints (temporary directories excluded), oldest first."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)), key=lambda p: p.name)


def resolve_checkpoint(resume: str, ckpt_root: str | os.PathLike) -> Path:
    """`latest` -> newest finished checkpoint under ckpt_root; otherwise the given path, which must exist."""
    if resume == "latest":
        found = list_checkpoints(ckpt_root)
        if not found:
            raise CheckpointError(f"--resume latest: no checkpoint under {ckpt_root}")
        return found[-1]
    path = Path(resume).expanduser()
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist (expected a directory with {', '.join(REQUIRED)})")
    return path


def _trainable_names(model: torch.nn.Module) -> set[str]:
    return set(_trainable_shapes(model))


def _trainable_shapes(model: torch.nn.Module) -> dict[str, tuple]:
    """Trainable parameter names and whole shapes (an FSDP2 DTensor reports its unsharded shape)."""
    return {n: tuple(p.shape) for n, p in unwrap(model).named_parameters() if p.requires_grad}


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module under DDP (FSDP2 keeps the module itself)."""
    return getattr(model, "module", model)


# ---------------------------------------------------------------- save / load

def save_checkpoint(accelerator, ckpt_root: str | os.PathLike, step: int, model, optimizer, scheduler,
                    data_state: dict, keep_last: int, extra: dict | None = None) -> Path:
    """Collective: every rank must call it. Returns the final directory."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)  # (0.5 s to import)
    root = Path(ckpt_root)
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}"
    full = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    # gathering is collective (FSDP): all ranks take part, rank 0 writes.
    trainable = _trainable_names(model)  # (tied frozen weights can slip through ignore_frozen_params)
    weights = {k: v for k, v in get_model_state_dict(model, options=full).items() if k in trainable}
    optim = get_optimizer_state_dict(model, _inner(optimizer), options=full)
    if accelerator.is_main_process:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    torch.save(rng_state(), tmp / f"rng-rank{accelerator.process_index}.pt")
    if accelerator.is_main_process:
        save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, tmp / "trainable.safetensors")
        torch.save(optim, tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        state = {"step": step, "world_size": accelerator.num_processes, **data_state, **(extra or {})}
        (tmp / "state.json").write_text(json.dumps(state, indent=2))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        publish(tmp, final, keep_last, run_id=(extra or {}).get("run_id"))
    accelerator.wait_for_everyone()
    return final


def _inner(optimizer):
    return getattr(optimizer, "optimizer", optimizer)


def read_state(path: Path) -> dict:
    """Check that a checkpoint is complete and readable; returns its state.json."""
    missing = [f for f in REQUIRED if not (path / f).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {path} is incomplete: missing {', '.join(missing)}")
    try:
        return json.loads((path / "state.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint {path} is corrupt: state.json is not valid JSON ({e})") from None


def load_checkpoint(accelerator, path: Path, model, optimizer, scheduler) -> dict:
    """Restore weights, optimizer, scheduler and this rank's RNG; returns state.json (step, data position)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)
    state = read_state(path)
    if state.get("world_size") != accelerator.num_processes:
        raise CheckpointError(f"checkpoint {path} was written by {state.get('world_size')} processes, this run has "
                              f"{accelerator.num_processes}: the data order would differ, so it cannot resume "
                              "exactly")
    try:
        weights = load_file(path / "trainable.safetensors")
        optim = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
        sched = torch.load(path / "scheduler.pt", map_location="cpu", weights_only=True)
        rng_file = path / f"rng-rank{accelerator.process_index}.pt"
        rng = torch.load(rng_file, map_location="cpu", weights_only=True) if rng_file.is_file() else None
    except Exception as e:  # any decode failure of any file
        raise CheckpointError(f"checkpoint {path} is corrupt: {type(e).__name__}: {e}") from None
    expected = _trainable_shapes(model)
    if set(weights) != set(expected):
        raise CheckpointError(f"checkpoint {path} does not match the model's trainable parameters: "
                              f"missing {sorted(set(expected) - set(weights))[:5]}, "
                              f"unexpected {sorted(set(weights) - set(expected))[:5]}")
    shapes = [f"{k} {tuple(weights[k].shape)} there, {expected[k]} here" for k in sorted(expected)
              if tuple(weights[k].shape) != expected[k]]
    if shapes:
        raise CheckpointError(f"checkpoint {path} holds tensors of other shapes than this model's: "
                              f"{'; '.join(shapes[:5])}")
    from accelerate.utils import DistributedType
    full = accelerator.distributed_type == DistributedType.FSDP
    opts = StateDictOptions(full_state_dict=full, strict=False)
    set_model_state_dict(model, weights, options=opts)
    set_optimizer_state_dict(model, _inner(optimizer), optim, options=opts)
    scheduler.load_state_dict(sched)
    if rng is not None:
        set_rng_state(rng)
    return state

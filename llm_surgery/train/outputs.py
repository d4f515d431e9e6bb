"""Who owns an output directory, and how its files are written.

- A fresh run refuses a directory that already holds a run's outputs (checkpoints, `final/`, results, logs):
  `--resume` continues that run, `--overwrite` deletes those outputs first (only those: other files stay).
- A lock file (`.llm-surgery.lock`, created with O_EXCL, holding the pid and host name) keeps a second process off
  a directory while a run uses it. Only the main process of a launch takes it. A lock left by a process that no
  longer runs on this host (a killed run) is stale and taken over, with a log line; a lock of another host cannot
  be checked, so it is refused and the message names the file to delete. (Two processes that find the same stale
  lock at the same instant may both take it over: the check is not atomic.)
- `final/`, `results.json` and `config.json` are replaced atomically (written beside, fsync, rename), so a crash
  leaves the old version or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

from .checkpoint import fsync_tree, replace_dir
from .config import UsageError
from .messages import logger

LOCK = ".llm-surgery.lock"
# a run's outputs: any of these makes a fresh run refuse the directory (config.json alone is a run that never
# started training, and is replaced)
RUN_OUTPUTS = ("checkpoints", "final", "results.json", "metrics.jsonl", "tensorboard")
CLEARED_BY_OVERWRITE = RUN_OUTPUTS + ("config.json", "accuracy.png", "step_profile.json", ".tmp-final", ".old-final",
                                      ".tmp-results.json", ".tmp-config.json", ".tmp-step_profile.json")


def existing_outputs(out_dir: Path) -> list[str]:
    return [name for name in RUN_OUTPUTS if (out_dir / name).exists()]


def check_fresh(out_dir: Path, overwrite: bool) -> None:
    """A fresh run (no --resume) may only write into a directory without another run's outputs."""
    found = existing_outputs(out_dir)
    if found and not overwrite:
        raise UsageError(f"output dir {out_dir} already holds a run ({', '.join(found)}); pass --resume latest to "
                         "continue it, --overwrite to delete its outputs and start again, or another --output-dir")


def clear_outputs(out_dir: Path) -> list[str]:
    """--overwrite: delete the outputs of the earlier run (and nothing else); returns what was deleted."""
    gone = []
    for name in CLEARED_BY_OVERWRITE:
        path = out_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        gone.append(name)
    return gone


# ---------------------------------------------------------------- lock

def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def acquire_lock(out_dir: Path, log=logger.info) -> Path:
    """Create the directory's lock file or raise UsageError naming the process that holds it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / LOCK
    me = {"pid": os.getpid(), "host": socket.gethostname()}
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                holder = json.loads(path.read_text())
                pid, host = int(holder["pid"]), str(holder["host"])
            except (OSError, ValueError, KeyError, TypeError):
                raise UsageError(f"output dir {out_dir} is locked by {path}, which names no process (a run is "
                                 "starting, or one died while taking it); delete the file if no run uses the "
                                 "directory") from None
            if host == me["host"] and not _alive(pid):
                log(f"taking over the stale lock {path} of process {pid}, which no longer runs")
                path.unlink(missing_ok=True)
                continue
            where = "this host" if host == me["host"] else f"host {host}"
            raise UsageError(f"output dir {out_dir} is in use by process {pid} on {where} (lock {path}); wait for "
                             "it, use another --output-dir, or delete the lock if that process is not a run here")
        with os.fdopen(fd, "w") as fh:
            json.dump(me, fh)
        return path
    raise UsageError(f"could not take the lock {path}: another process took it first")


def release_lock(path: Path | None) -> None:
    """Remove the lock if this process holds it."""
    if path is None:
        return
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


# ---------------------------------------------------------------- atomic writes

def write_json(path: Path, obj) -> None:
    """Write JSON beside `path`, fsync, rename over it."""
    tmp = path.with_name(f".tmp-{path.name}")
    with open(tmp, "w") as fh:
        fh.write(json.dumps(obj, indent=2))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def publish_dir(tmp: Path, final: Path) -> None:
    """A fully written directory `tmp` becomes `final` (replacing an older one)."""
    fsync_tree(tmp)
    replace_dir(tmp, final)


# ---------------------------------------------------------------- resume

def check_resume(state: dict, cfg, world_size: int, mixed_precision: str, path: Path) -> str:
    """A checkpoint continues only the run it came from, with the same settings (the mixed precision in effect
    included, wherever it was set); returns that run's id."""
    from .checkpoint import CheckpointError
    from .config import settings_diff

    saved, run_id = state.get("settings"), state.get("run_id")
    if not isinstance(saved, dict) or not run_id:
        raise CheckpointError(f"checkpoint {path} records no run settings (an older llm-surgery wrote it), so it "
                              "cannot be checked against this run; start a fresh run")
    diff = settings_diff(saved, cfg.resume_settings(world_size, mixed_precision))
    if diff:
        raise CheckpointError(f"--resume {path}: this run's settings differ from the checkpoint's ({'; '.join(diff)}); "
                              "resume with the checkpoint's settings, or start a fresh run in another --output-dir")
    return run_id

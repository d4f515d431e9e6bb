"""The opt-in step-time breakdown of a run (`--profile-steps N`): where the time of a training step goes.

Over the last N steps (after warm-up), every phase of the step is timed on the host from its start until the device
has finished it (a synchronisation at each phase boundary), and so is the whole step; `other` is the step's time
outside the named phases (the loop's own Python: schedule, temperature, meters, progress bar). Beside each phase's
time is the host's time to issue it (Python and kernel launches, before the wait): a phase whose issue time is
close to its time is bound by the host, not by the device. The backward includes DDP's wait for its last
gradient all-reduce (the reducer makes the stream wait for it); comparing the backward of N processes with one
process's gives the communication the backward did not hide. These steps synchronise, so they are left out of
the run's throughput. When steps replay from CUDA graphs (`graphs.py`), `forward` is the replay of the forward and
backward together, and `backward` the gradients' all-reduce of several processes.
"""

from __future__ import annotations

import contextlib
import time

import torch

PHASES = ("data", "forward", "backward", "optimizer", "check_and_log")


class StepProfile:
    def __init__(self, device, first_step: int, steps: int):
        self.device, self.window = device, range(first_step, first_step + max(steps, 0))
        self.active, self.steps, self.step_s = False, 0, 0.0
        self.wall = dict.fromkeys(PHASES, 0.0)
        self.issue = dict.fromkeys(PHASES, 0.0)
        self.evaluations: list[dict] = []
        self._t = 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def begin_step(self, step: int) -> bool:
        """Whether step `step` (0-based) is profiled."""
        self.active = step in self.window
        if self.active:
            self._sync()
            self._t = time.perf_counter()
        return self.active

    def end_step(self) -> None:
        if self.active:
            self._sync()
            self.step_s += time.perf_counter() - self._t
            self.steps += 1
            self.active = False

    @contextlib.contextmanager
    def phase(self, name: str):
        if not self.active:
            yield
            return
        t0 = time.perf_counter()
        yield
        t1 = time.perf_counter()
        self._sync()
        self.wall[name] += time.perf_counter() - t0
        self.issue[name] += t1 - t0

    @contextlib.contextmanager
    def evaluation(self, split: str):
        """Wall time of an evaluation (outside the steps), recorded whether or not steps are profiled."""
        self._sync()
        t0 = time.perf_counter()
        yield
        self._sync()
        self.evaluations.append({"split": split, "seconds": time.perf_counter() - t0})

    def result(self) -> dict | None:
        if not self.steps:
            return None
        ms = lambda s: 1e3 * s / self.steps
        phases = {name: ms(self.wall[name]) for name in PHASES}
        phases["other"] = ms(self.step_s) - sum(phases.values())
        return {"steps": self.steps, "step_ms": ms(self.step_s), "phases_ms": phases,
                "issue_ms": {name: ms(self.issue[name]) for name in PHASES}, "evaluations": self.evaluations}


def profile_table(profile: dict) -> str:
    """Markdown: one row per phase, its mean time per step, share of the step and host issue time."""
    step = profile["step_ms"]
    lines = [f"step-time breakdown over {profile['steps']} steps: {step:.1f} ms per step", "",
             "| phase | ms per step | share | host issue ms |", "| --- | --- | --- | --- |"]
    for name, v in profile["phases_ms"].items():
        issue = profile["issue_ms"].get(name)
        lines.append(f"| {name} | {v:.2f} | {100 * v / step:.0f}% | {'-' if issue is None else f'{issue:.2f}'} |")
    for e in profile["evaluations"]:
        lines.append(f"| evaluation ({e['split']}, once) | {1e3 * e['seconds']:.0f} | - | - |")
    return "\n".join(lines)

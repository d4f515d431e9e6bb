"""Where numbers go: a JSONL log (always), TensorBoard (when installed), and the rich results table."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch


class MetricsLog:
    """Main-process sink for step metrics: one JSON object per line in `metrics.jsonl`."""

    def __init__(self, output_dir: str | Path, tensorboard: bool = True, append: bool = False):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a" if append else "w")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(str(Path(output_dir) / "tensorboard"))
            except ImportError:  # tensorboard is optional
                self._tb = None

    def log(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None and "step" in record:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(k, v, record["step"])

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def truncate_after(path: str | Path, step: int) -> None:
    """On resume: drop log lines of steps after the checkpoint so the log reads as one uninterrupted run."""
    path = Path(path)
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by the kill
        if rec.get("step", 0) <= step:
            keep.append(line)
    path.write_text("".join(k + "\n" for k in keep))


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def results_table(results: dict, title: str | None = None):
    """A rich Table: IID / OOD / overall, then each number of transitions; the host alone beside the trained
    model when the run evaluated it (`results["host_alone"]`)."""
    from rich.table import Table

    test, host = results["test"], results.get("host_alone")
    trained = f"+ {results.get('n', '?')} {results.get('kind', '?')}"
    table = Table(title=title or f"Box test accuracy (%) - host + {results.get('n', '?')} x "
                                 f"{results.get('kind', '?')} inserted layers")
    table.add_column("split")
    table.add_column("examples", justify="right")
    metrics = (("exact match", "accuracy"), ("state acc.", "state_accuracy"), ("token acc.", "token_accuracy"))
    for name, _ in metrics:
        if host is not None:
            table.add_column(f"{name}\nhost alone", justify="right")
        table.add_column(f"{name}\n{trained}" if host is not None else name, justify="right")

    def row(label, part, host_part):
        cells = []
        for _, key in metrics:
            if host is not None:
                cells.append(_pct((host_part or {}).get(key)))
            cells.append(_pct(part.get(key)))
        table.add_row(label, str(part["num_examples"]), *cells)

    for label, key in (("IID (<= %d ops)" % test["train_max_ops"], "iid"),
                       ("OOD (> %d ops)" % test["train_max_ops"], "ood")):
        row(label, test[key], host and host[key])
    row("all", test, host)
    table.add_section()
    host_by = {str(k): v for k, v in (host or {}).get("by_num_ops", {}).items()}
    for n, part in test["by_num_ops"].items():
        row(f"{n} transitions", part, host_by.get(str(n)))
    return table


def print_results(results: dict, title: str | None = None) -> None:
    try:
        from rich.console import Console
    except ImportError:  # plain text where rich is missing
        test, host = results["test"], results.get("host_alone")
        if host:
            print(f"host alone: IID {_pct(host['iid']['accuracy'])}  OOD {_pct(host['ood']['accuracy'])}")
        print(f"IID {_pct(test['iid']['accuracy'])}  OOD {_pct(test['ood']['accuracy'])}  "
              f"all {_pct(test['accuracy'])}")
        for n, part in test["by_num_ops"].items():
            print(f"  {n:>3} transitions: {_pct(part['accuracy'])}")
        return
    console = Console()
    console.width = max(console.width, 110)  # the side-by-side table needs ~100 columns; piped output gets 80
    console.print(results_table(results, title))


class Throughput:
    """Training tokens/s of this process, leaving out the first `skip` steps (kernel autotuning, warm-up) and
    the time spent in evaluation and checkpoints, and everything after `freeze` (profiled steps). Synchronises CUDA
    only at those boundaries."""

    def __init__(self, device, skip: int):
        self.device, self.skip = device, skip
        self.steps, self.tokens, self.seconds, self._t, self.frozen = 0, 0, 0.0, None, False

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self) -> None:
        self._t = self._now()

    def step_done(self, tokens: int) -> None:
        if self.frozen:
            return
        self.steps += 1
        if self.steps <= self.skip:
            if self.steps == self.skip:
                self._t = self._now()
            return
        self.tokens += tokens

    def pause(self) -> None:
        if self._t is not None and self.steps >= self.skip:
            self.seconds += self._now() - self._t
        self._t = None

    def resume(self) -> None:
        if not self.frozen:
            self._t = self._now()

    def freeze(self) -> None:
        """Stop counting for good (idempotent)."""
        if not self.frozen:
            self.pause()
            self.frozen = True

    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")

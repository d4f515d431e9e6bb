"""The training package's progress messages go through the `llm_surgery.train` logger (a library does not
print); the command lines (`llm-surgery-train`, the recipes, `make_host`) show them on stdout, one plain line
each. The results table stays a print: it is the program's output, not a message about the run."""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("llm_surgery.train")


class _Stdout(logging.Handler):
    """Writes each message on its own line of `sys.stdout` as it is at that moment, as print does (a replaced stdout
    is followed), through `tqdm.write`: it lifts the training progress bar (on stderr) off the line first, where a
    plain write would glue the message to the bar's unfinished line."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm.auto import tqdm  # the class of the trainer's bar (write clears only its own class's bars)

        try:
            tqdm.write(self.format(record), file=sys.stdout)
            sys.stdout.flush()
        except Exception:  # noqa: BLE001 - logging's contract: report, never raise
            self.handleError(record)


def show_messages() -> None:
    """For command lines: INFO messages on stdout, unless the program has configured logging itself."""
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = _Stdout()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)

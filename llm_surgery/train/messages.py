"""The training package's progress messages go through the `llm_surgery.train` logger (a library does not
print); the command lines (`llm-surgery-train`, the recipes, `make_host`) show them on stdout, one plain line
each. The results table stays a print: it is the program's output, not a message about the run."""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("llm_surgery.train")


class _Stdout(logging.StreamHandler):
    """Writes to `sys.stdout` as it is at each message, as print does (a replaced stdout is followed)."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:
        pass


def show_messages() -> None:
    """For command lines: INFO messages on stdout, unless the program has configured logging itself."""
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = _Stdout()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)

"""`python -m llm_surgery.train [--flags]` / `llm-surgery-train`: with no flags, the embedded tiny-host run.

Errors the user can fix (a bad setting, a refused output directory or checkpoint, a host that cannot be had) are
printed as one line, `<prog>: error: ...`, with exit status 2; a run stopped by a non-finite loss exits with 1.
"""

from __future__ import annotations

import os
import sys


def run(argv: list[str] | None = None, defaults: dict | None = None, prog: str | None = None) -> dict:
    """Parse the command line (recipe `defaults` first) and train; returns the results dict."""
    from .config import parse_config
    from .trainer import train

    cfg = parse_config(sys.argv[1:] if argv is None else argv, defaults=defaults, prog=prog)
    return train(cfg)


def main(argv: list[str] | None = None, defaults: dict | None = None, prog: str | None = None) -> None:
    """Console entry point (returns None so that `sys.exit(main())` exits with status 0)."""
    from .checkpoint import CheckpointError
    from .config import UsageError
    from .messages import show_messages
    from .trainer import TrainingDiverged

    show_messages()
    try:
        run(argv, defaults, prog)
    except (UsageError, CheckpointError, TrainingDiverged) as e:
        if os.environ.get("RANK", "0") == "0":  # every process of a launch raises the same error: say it once
            name = prog or os.path.basename(sys.argv[0])
            print(f"{name}: error: {e}", file=sys.stderr, flush=True)
        sys.exit(1 if isinstance(e, TrainingDiverged) else 2)


if __name__ == "__main__":
    main(prog="python -m llm_surgery.train")

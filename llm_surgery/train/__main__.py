"""`python -m llm_surgery.train [--flags]` / `llm-surgery-train`: with no flags, the embedded tiny-host run.

Errors the user can fix (a bad setting, a refused output directory or checkpoint, a host that cannot be had) are
printed as one line, `<prog>: error: ...`, with exit status 2; a run stopped by a non-finite loss exits with 1.
"""

from __future__ import annotations

import os
import sys


def run(argv: list[str] | None = None, defaults: dict | None = None, prog: str | None = None) -> dict:
    """Parse the command line (recipe `defaults` first) and train; returns the results dict. The trainer (and with
    it transformers, Accelerate, PEFT) is imported after the parse, so `--help` and a bad flag answer in ~2 s."""
    from .config import parse_config

    cfg = parse_config(sys.argv[1:] if argv is None else argv, defaults=defaults, prog=prog)
    from .trainer import train

    return train(cfg)


def main(argv: list[str] | None = None, defaults: dict | None = None, prog: str | None = None) -> None:
    """Console entry point (returns None so that `sys.exit(main())` exits with status 0)."""
    from .checkpoint import CheckpointError
    from .config import UsageError
    from .messages import show_messages

    show_messages()
    try:
        run(argv, defaults, prog)
    except (UsageError, CheckpointError) as e:
        fail(e, prog, 2)
    except RuntimeError as e:
        from .trainer import TrainingDiverged  # imported by then: only training raises it

        if not isinstance(e, TrainingDiverged):
            raise
        fail(e, prog, 1)


def fail(e: Exception, prog: str | None, status: int) -> None:
    """One line, `<prog>: error: ...`, from rank 0 alone (every process of a launch raises the same error)."""
    if os.environ.get("RANK", "0") == "0":
        name = prog or os.path.basename(sys.argv[0])
        print(f"{name}: error: {e}", file=sys.stderr, flush=True)
    sys.exit(status)


if __name__ == "__main__":
    main(prog="python -m llm_surgery.train")

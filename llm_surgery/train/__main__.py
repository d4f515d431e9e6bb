"""`python -m llm_surgery.train [--flags]` / `llm-surgery-train`: with no flags, the embedded tiny-host run."""

from __future__ import annotations

import sys


def run(argv: list[str] | None = None, defaults: dict | None = None, prog: str | None = None) -> dict:
    """Parse the command line (recipe `defaults` first) and train; returns the results dict."""
    from .config import parse_config
    from .trainer import train

    cfg = parse_config(sys.argv[1:] if argv is None else argv, defaults=defaults, prog=prog)
    return train(cfg)


def main(argv: list[str] | None = None, defaults: dict | None = None, prog: str | None = None) -> None:
    """Console entry point (returns None so that `sys.exit(main())` exits with status 0)."""
    run(argv, defaults, prog)


if __name__ == "__main__":
    main(prog="python -m llm_surgery.train")

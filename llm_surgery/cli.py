"""What the package's command lines share: a refused input is one line, `<prog>: error: ...`, with exit status 2;
a negative number in any notation (`--lr -1e-3`, `--tau -inf`) is a value, not an option, so that the range check
names the flag instead of argparse saying "expected one argument"; `--help` shows every flag's default; and a
`--device` is checked before any work."""

from __future__ import annotations

import argparse
import re

# argparse's own pattern takes "-1" and "-.5" but not "-1e-3" or "-inf" for numbers
NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|infinity|nan)$", re.IGNORECASE)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """ArgumentDefaultsHelpFormatter that writes a default of None as `none` (the word the flags accept)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "%(default)" in text or "(default" in text or action.default is argparse.SUPPRESS or \
                not action.option_strings or action.required:  # (a help that states its default keeps it)
            return text
        if action.default is None:
            return f"{text} (default: none)".strip()
        return f"{text} (default: %(default)s)".strip()


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors, negative numbers as values and every default in --help (a flag added
    without help text still shows its default)."""

    def __init__(self, *args, hint: str = "", **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = NEGATIVE_NUMBER
        self.hint = hint

    def add_argument(self, *args, **kwargs):
        action = super().add_argument(*args, **kwargs)
        if not (action.help or "").strip() and action.option_strings and not action.required:
            # argparse prints nothing for a flag without help text, not even its default
            action.help = "(default: none)" if action.default is None else "(default: %(default)s)"
        return action

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}{self.hint}\n")


def json_object(text: str, flag: str, error=ValueError) -> dict:
    """A flag's JSON-object value (`--mixer-options '{"dict_size": 32}'`), or `error` naming the flag and why not."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{flag} must be a JSON object, got {text!r}: {e}") from None
    if not isinstance(value, dict):
        raise error(f"{flag} must be a JSON object, got {text!r}")
    return value


def check_device(device: str) -> None:
    """A `--device` this machine has (cpu, cuda, cuda:N), or a ValueError saying why not: before any work, instead
    of every run failing on its own."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"--device {device!r} is not a device ({e})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: no CUDA device here (torch {torch.__version__}); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise ValueError(f"--device {device}: only cpu and cuda[:N] are supported")

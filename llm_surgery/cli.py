"""What the package's command lines share: a refused input is one line, `<prog>: error: ...`, with exit status 2;
a negative number in any notation (`--lr -1e-3`, `--tau -inf`) is a value, not an option, so that the range check
names the flag instead of argparse saying "expected one argument"; and `--help` shows every flag's default."""

from __future__ import annotations

import argparse
import re

# argparse's own pattern takes "-1" and "-.5" but not "-1e-3" or "-inf" for numbers
NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|infinity|nan)$", re.IGNORECASE)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """ArgumentDefaultsHelpFormatter that writes a default of None as `none` (the word the flags accept)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "%(default)" in text or action.default is argparse.SUPPRESS or not action.option_strings:
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
        if not (action.help or "").strip() and action.option_strings:
            # argparse prints nothing for a flag without help text, not even its default
            action.help = "(default: none)" if action.default is None else "(default: %(default)s)"
        return action

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}{self.hint}\n")

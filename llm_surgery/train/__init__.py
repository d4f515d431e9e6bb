"""The Accelerate trainer: `TrainConfig` (every field a command-line flag) and `train(cfg)`.

    python -m llm_surgery.train                      # embedded tiny host, CPU, a few minutes
    accelerate launch recipes/granite3b.py --kind mamba2 --model /path/to/granite-4.0-h-micro
"""

from .config import TrainConfig, build_parser, parse_config


def train(cfg: TrainConfig) -> dict:
    from .trainer import train as _train
    return _train(cfg)


def run(argv=None, defaults=None, prog=None) -> dict:
    """Command line -> results dict (for scripts and tests)."""
    from .__main__ import run as _run
    return _run(argv, defaults, prog)


def main(argv=None, defaults=None, prog=None) -> None:
    """Command line -> training run (recipes and the console script)."""
    from .__main__ import main as _main
    _main(argv, defaults, prog)


__all__ = ["TrainConfig", "build_parser", "main", "parse_config", "run", "train"]

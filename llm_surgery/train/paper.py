"""The paper's per-host training settings (appendix A.2), kept in one table; `recipes/<name>.py` is a thin entry
point whose file name is its row (`run_recipe(__file__)`).

AdamW with weight decay 0.1 everywhere, 10% linear warm-up; Granite 350M/1B: lr 1e-3 then constant;
Granite 3B/7B: lr 5e-4, cosine to 0.1x; Nemotron-H: lr 1e-4, same cosine; 4 inserted layers.

The paper trains Flash PD-SSM with "slope annealed" straight-through estimation (sec. 3) but gives no start, end
or shape; the recipes anneal the temperature geometrically from 1.0 to 0.1 over the run (`tau_schedule`'s
defaults; no effect on mamba2 / deltanet).
"""

from __future__ import annotations

from pathlib import Path

_COMMON = dict(n=4, weight_decay=0.1, warmup_ratio=0.1, num_sequences=1000, batch_size=8,
               max_steps=None, max_eval_examples=None,  # one epoch, the whole test split
               tau=1.0, tau_end=0.1)


def _constant(lr: float) -> dict:
    return dict(lr=lr, schedule="constant")


def _cosine(lr: float) -> dict:
    return dict(lr=lr, schedule="cosine", min_lr_ratio=0.1)


PAPER_HOSTS: dict[str, tuple[str, dict]] = {
    "granite350m": ("ibm-granite/granite-4.0-h-350m", _constant(1e-3)),
    "granite1b": ("ibm-granite/granite-4.0-h-1b", _constant(1e-3)),
    "granite3b": ("ibm-granite/granite-4.0-h-micro", _cosine(5e-4)),
    "granite7b": ("ibm-granite/granite-4.0-h-tiny", _cosine(5e-4)),
    "nemotronh9b": ("nvidia/NVIDIA-Nemotron-Nano-9B-v2", _cosine(1e-4)),
    "nemotronh12b": ("nvidia/NVIDIA-Nemotron-Nano-12B-v2", _cosine(1e-4)),
    # 60 GB of bf16 weights: shard the frozen host too
    "nemotronh30b": ("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", {**_cosine(1e-4), "fsdp": True}),
}


def recipe_defaults(name: str) -> dict:
    """The TrainConfig defaults of recipe `name` (a key of PAPER_HOSTS)."""
    if name not in PAPER_HOSTS:
        raise ValueError(f"unknown recipe {name!r}; known: {', '.join(PAPER_HOSTS)}")
    model, schedule = PAPER_HOSTS[name]
    return {**_COMMON, "model": model, **schedule, "output_dir": f"runs/{name}"}


def run_recipe(script: str, argv: list[str] | None = None) -> None:
    """The command line of `recipes/<name>.py`: the trainer with row `<name>`'s defaults (--help lists them)."""
    from . import main

    name = Path(script).stem
    main(argv, defaults=recipe_defaults(name), prog=f"recipes/{name}.py")

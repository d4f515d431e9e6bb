"""Granite 4.0 H 1B + 4 inserted layers on Box, with the paper's settings:
AdamW, weight decay 0.1, lr 1e-3, constant after 10% linear warm-up.

    accelerate launch recipes/granite1b.py --kind pdssm                      # hub checkpoint (downloads)
    accelerate launch recipes/granite1b.py --kind mamba2 --model /path/to/ckpt  # local copy

Throughput run without the checkpoint: --random-init-config granite-4.0-h-1b. Any TrainConfig field can be overridden on the command line (--help).
"""

from llm_surgery.train import main
from llm_surgery.train.paper import recipe_defaults

DEFAULTS = recipe_defaults("granite1b")

if __name__ == "__main__":
    main(defaults=DEFAULTS, prog="recipes/granite1b.py")

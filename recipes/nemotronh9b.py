"""Nemotron-H 9B (NVIDIA-Nemotron-Nano-9B-v2) + 4 inserted layers on Box, with the paper's settings:
AdamW, weight decay 0.1, lr 1e-4, cosine to 0.1x after 10% linear warm-up.

    accelerate launch recipes/nemotronh9b.py --kind pdssm                      # hub checkpoint (downloads)
    accelerate launch recipes/nemotronh9b.py --kind mamba2 --model /path/to/ckpt  # local copy

Throughput run without the checkpoint: --random-init-config nemotron-nano-9b-v2. Any TrainConfig field can be overridden on the command line (--help).
"""

from llm_surgery.train import main
from llm_surgery.train.paper import recipe_defaults

DEFAULTS = recipe_defaults("nemotronh9b")

if __name__ == "__main__":
    main(defaults=DEFAULTS, prog="recipes/nemotronh9b.py")

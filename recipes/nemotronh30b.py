"""Nemotron-H 30B (NVIDIA-Nemotron-3-Nano-30B-A3B) + 4 inserted layers on Box, with the paper's settings:
AdamW, weight decay 0.1, lr 1e-4, cosine to 0.1x after 10% linear warm-up; FSDP (60 GB of bf16 weights).

    accelerate launch recipes/nemotronh30b.py --kind pdssm                      # hub checkpoint (downloads)
    accelerate launch recipes/nemotronh30b.py --kind mamba2 --model /path/to/ckpt  # local copy

No random-init configuration is recorded for this host (llm_surgery.hosts.HOST_CONFIGS). Any TrainConfig field can be overridden on the command line (--help).
"""

from llm_surgery.train import main
from llm_surgery.train.paper import recipe_defaults

DEFAULTS = recipe_defaults("nemotronh30b")

if __name__ == "__main__":
    main(defaults=DEFAULTS, prog="recipes/nemotronh30b.py")

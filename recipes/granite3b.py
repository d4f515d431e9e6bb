"""Granite 4.0 H Micro (3B) + 4 inserted layers on Box, with the paper's settings: row `granite3b` of
`llm_surgery.train.paper.PAPER_HOSTS` (--help shows them; any flag overrides them).

    accelerate launch recipes/granite3b.py --kind pdssm                      # hub checkpoint (downloads)
    accelerate launch recipes/granite3b.py --kind mamba2 --model /path/to/ckpt  # local copy

Throughput run without the checkpoint: --random-init-config granite-4.0-h-micro.
"""

from llm_surgery.train.paper import run_recipe

if __name__ == "__main__":
    run_recipe(__file__)

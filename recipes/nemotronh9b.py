"""Nemotron-H 9B (NVIDIA-Nemotron-Nano-9B-v2) + 4 inserted layers on Box,
with the paper's settings:
row `nemotronh9b` of `llm_surgery.train.paper.PAPER_HOSTS` (--help shows them; any flag overrides them).

    accelerate launch recipes/nemotronh9b.py --kind pdssm                      # hub checkpoint (downloads)
    accelerate launch recipes/nemotronh9b.py --kind mamba2 --model /path/to/ckpt  # local copy

Throughput run without the checkpoint: --random-init-config nemotron-nano-9b-v2.
"""

from llm_surgery.train.paper import run_recipe

if __name__ == "__main__":
    run_recipe(__file__)

"""Nemotron-H 30B (NVIDIA-Nemotron-3-Nano-30B-A3B) + 4 inserted layers on Box,
with the paper's settings; FSDP (60 GB of bf16 weights):
row `nemotronh30b` of `llm_surgery.train.paper.PAPER_HOSTS` (--help shows them; any flag overrides them).

    accelerate launch recipes/nemotronh30b.py --kind pdssm                      # hub checkpoint (downloads)
    accelerate launch recipes/nemotronh30b.py --kind mamba2 --model /path/to/ckpt  # local copy

No random-init configuration is recorded for this host (llm_surgery.hosts.HOST_CONFIGS).
"""

from llm_surgery.train.paper import run_recipe

if __name__ == "__main__":
    run_recipe(__file__)

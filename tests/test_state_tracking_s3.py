"""Issue 9 on the CPU: a one-layer Flash PD-SSM learns the S3 word problem (two generator tokens, the
transposition (0 1) and the 3-cycle) on lengths <= 40 and is exact at length 256, from a fixed seed.
Recipe: docs/bench/state_tracking.md (b_gate="decay", no convolution, random initial state, curriculum)."""

import pytest
import torch

from llm_surgery.bench.state_tracking.train import ROBUST_PDSSM, TrainConfig, train

S3_RECIPE = dict(task="s3_gen", kind="pdssm", n_layers=1, d_model=64, steps=800, batch_size=64, lr=2e-3,
                 curriculum_frac=0.3, eval_lengths=(256,), eval_batch=512,
                 mixer=dict(ROBUST_PDSSM, num_heads=16, state_size=3, dict_size=8, complex=False))


@pytest.mark.slow
def test_one_layer_pdssm_learns_s3_generators_and_generalises_to_256():
    torch.set_num_threads(min(2, torch.get_num_threads()))
    result = train(TrainConfig(**S3_RECIPE, seed=0))
    assert result["train_loss"] < 0.05, result
    assert result["acc"]["256"] >= 0.99, result

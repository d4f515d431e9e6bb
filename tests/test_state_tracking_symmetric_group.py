"""The S3 word problem on the CPU: a one-layer Flash PD-SSM learns the S3 word problem (two generator tokens, the
transposition (0 1) and the 3-cycle) on lengths <= 40 and is exact at length 256, from a fixed seed, with the
benchmark CLI's defaults (docs/bench/state_tracking.md: b_gate="decay", no convolution, random initial state,
curriculum) and the one-layer S3 sizes of the GPU run; only the step count and batch are smaller."""

import pytest
import torch

from llm_surgery.bench.state_tracking.train import ONE_LAYER_RECIPES, cli_defaults, train


def s3_config(seed: int = 0):
    return cli_defaults("pdssm", task="s3_gen", steps=800, batch_size=64, eval_lengths=(256,), eval_batch=512,
                        seed=seed, **ONE_LAYER_RECIPES["s3_gen"])


@pytest.mark.slow
def test_one_layer_pdssm_learns_s3_generators_and_generalises_to_256():
    torch.set_num_threads(min(2, torch.get_num_threads()))
    result = train(s3_config(seed=0))
    assert result["train_loss"] < 0.05, result
    assert result["acc"]["256"] >= 0.99, result
    # what its dictionary does (group_image): some head's token maps are S3 itself, not a quotient of it
    assert result["group_image"]["faithful"] >= 1, result["group_image"]


def test_untrained_s3_model_is_near_chance():
    """The measurement can fail: the same model before training is far from 99% at length 256."""
    from llm_surgery.bench.state_tracking.tasks import get_task
    from llm_surgery.bench.state_tracking.train import build_model, evaluate
    torch.manual_seed(0)
    acc = evaluate(build_model(s3_config()), get_task("s3_gen"), (256,), 512, torch.Generator().manual_seed(1), "cpu")
    assert acc[256] < 0.5

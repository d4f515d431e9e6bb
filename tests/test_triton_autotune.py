"""Quick autotuning tries the leanest Triton config first (the one least likely to run out of shared memory)."""

from types import SimpleNamespace

from llm_surgery.triton_autotune import config_size


def _cfg(stages, warps, **blocks):
    return SimpleNamespace(num_stages=stages, num_warps=warps, kwargs=blocks)


def test_leanest_config_first():
    # mamba-ssm's _chunk_scan_fwd_kernel lists its largest config first (3 stages of 128 x 256 x 64 tiles): it
    # needed 279,552 bytes of shared memory on an H200 in one specialisation; the leanest must come first
    configs = [_cfg(3, 8, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64), _cfg(4, 4, BLOCK_M=64, BLOCK_N=64, BLOCK_K=32),
               _cfg(5, 2, BLOCK_M=64, BLOCK_N=32, BLOCK_K=32), _cfg(2, 2, BLOCK_M=16, BLOCK_N=16, FLAG=True)]
    order = sorted(configs, key=config_size)
    assert [(c.num_stages, c.kwargs["BLOCK_M"]) for c in order] == [(2, 16), (5, 64), (4, 64), (3, 128)]

"""Launched by tests/test_train.py with `accelerate launch`: the trainer under FSDP2 on CPU processes (gloo).

Accelerate enables FSDP only on accelerators, yet torch's FSDP2 shards on CPU as well; this script makes the
Accelerator report FSDP so that a CPU test covers the trainer's FSDP code (sharded parameters, gathered
checkpoints, the final artifact, resume) that otherwise runs only on GPUs."""

import sys

from accelerate import Accelerator
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

import llm_surgery.train.trainer as trainer
from llm_surgery.train import main


def fsdp_accelerator_on_cpu(cfg):
    assert cfg.fsdp, "launch this script with --fsdp"
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", reshard_after_forward=True,
        state_dict_type="FULL_STATE_DICT", cpu_ram_efficient_loading=False)
    accelerator = Accelerator(cpu=True, mixed_precision="no")
    accelerator.state.distributed_type = DistributedType.FSDP  # prepare() shards with this plugin
    accelerator.state.fsdp_plugin = plugin
    # (the shared state can be reset to MULTI_CPU later; the trainer must keep seeing FSDP)
    type(accelerator).distributed_type = property(lambda self: DistributedType.FSDP)
    return accelerator


if __name__ == "__main__":
    trainer.make_accelerator = fsdp_accelerator_on_cpu
    main(sys.argv[1:])

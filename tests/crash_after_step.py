"""Launched by tests/test_train.py with `accelerate launch`: the trainer, with rank 0 SIGKILLed (a real crash: no
exception, no clean-up) right after it logs step STEP's loss, i.e. when update STEP + 1 begins.

    accelerate launch ... tests/crash_after_step.py STEP [SCRIPT.py] TRAINER_FLAGS...

SCRIPT.py (another launcher script of tests/, e.g. fsdp_on_cpu.py) is run as __main__ with TRAINER_FLAGS;
without it the trainer's own command line takes them. The hook lives here, not in the shipped trainer."""

import os
import runpy
import signal
import sys

import llm_surgery.train.trainer as trainer
from llm_surgery.train import main


def crash_after(step: int) -> None:
    """Make the trainer's metrics log (rank 0's alone) kill its process once step `step`'s loss is written."""

    class CrashingLog(trainer.MetricsLog):
        def log(self, record: dict) -> None:
            super().log(record)
            if record.get("step") == step and "loss" in record:
                os.kill(os.getpid(), signal.SIGKILL)

    trainer.MetricsLog = CrashingLog


if __name__ == "__main__":
    crash_after(int(sys.argv[1]))
    if len(sys.argv) > 2 and sys.argv[2].endswith(".py"):
        sys.argv = sys.argv[2:]
        runpy.run_path(sys.argv[0], run_name="__main__")
    else:
        main(sys.argv[2:])

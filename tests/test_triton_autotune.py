"""Quick autotuning tries the leanest Triton config first (the one least likely to run out of shared memory);
persistent autotuning keeps each choice on disk for later processes."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from llm_surgery.triton_autotune import RETUNE_ENV, config_size
from interpreter import require_interpreter_kernels


def _cfg(stages, warps, **blocks):
    return SimpleNamespace(num_stages=stages, num_warps=warps, kwargs=blocks)


def test_leanest_config_first():
    # mamba-ssm's _chunk_scan_fwd_kernel lists its largest config first (3 stages of 128 x 256 x 64 tiles): it
    # needed 279,552 bytes of shared memory on an H200 in one specialisation; the leanest must come first
    configs = [_cfg(3, 8, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64), _cfg(4, 4, BLOCK_M=64, BLOCK_N=64, BLOCK_K=32),
               _cfg(5, 2, BLOCK_M=64, BLOCK_N=32, BLOCK_K=32), _cfg(2, 2, BLOCK_M=16, BLOCK_N=16, FLAG=True)]
    order = sorted(configs, key=config_size)
    assert [(c.num_stages, c.kwargs["BLOCK_M"]) for c in order] == [(2, 16), (5, 64), (4, 64), (3, 128)]


TUNE_SCRIPT = '''
import json, os, sys
import torch, triton, triton.language as tl
from llm_surgery import triton_autotune

assert triton_autotune.persistent_autotune() is not None
timed = []


def bench(fn, quantiles):  # each round times BLOCK 16 at 2.0, then BLOCK 32 at 1.0: the second config wins
    fn()
    timed.append([2.0, 1.0][len(timed) % 2])
    return [timed[-1]] * 3


def zero_y(nargs):  # a config pre_hook: Triton's own on-disk cache skips such kernels
    nargs["y"].zero_()


def make():
    """The same kernel source each call: a new autotuner with no choices in memory, as in a new process."""
    @triton.autotune(configs=[triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32}, pre_hook=zero_y)],
                     key=["n"], do_bench=bench)
    @triton.jit
    def double(x, y, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y + i, 2 * tl.load(x + i, mask=i < n), mask=i < n)
    return double


def call(n=100):
    kernel = make()
    x = torch.randn(n)
    y = torch.full_like(x, float("nan"))
    kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, y, n)
    assert torch.equal(y, 2 * x)
    return kernel.best_config.kwargs["BLOCK"], len(timed)


folder = triton_autotune.autotune_cache_dir()
steps = {"first": call(), "second": call()}
files = sorted(folder.iterdir())
steps["files"] = len(files)
triton_autotune.persistent_autotune(retune=True)
steps["retuned"] = call()
triton_autotune.persistent_autotune(retune=False)
files[0].write_text("{")  # as a process killed mid-write would leave it without the atomic rename
steps["after_garbage"] = call()
steps["stored_again"] = json.loads(files[0].read_text())["choice"]
steps["other_key"] = call(n=50)
steps["files_after"] = len(list(folder.iterdir()))
print(json.dumps(steps))
'''


@pytest.mark.slow
def test_choices_persist_across_autotuners(tmp_path):
    """A new autotuner of the same kernel takes the stored choice without timing (a config with a pre_hook
    included); --retune and a damaged record time again; another tuning key gets its own record."""
    require_interpreter_kernels()
    from triton.runtime.autotuner import Autotuner

    if not hasattr(Autotuner, "check_disk_cache"):
        pytest.skip("this Triton's Autotuner has no check_disk_cache hook")
    script = tmp_path / "tune.py"
    script.write_text(TUNE_SCRIPT)
    env = dict(os.environ, TRITON_INTERPRET="1", LLM_SURGERY_AUTOTUNE_CACHE=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")]))
    env.pop(RETUNE_ENV, None)
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = json.loads(out.stdout.strip().splitlines()[-1])
    assert steps["first"] == [32, 2]          # timed both, kept the faster
    assert steps["second"] == [32, 2]         # nothing timed: the stored choice
    assert steps["files"] == 1
    assert steps["retuned"] == [32, 4]        # timed again
    assert steps["after_garbage"] == [32, 6]  # a damaged record is tuned again and rewritten
    assert steps["stored_again"] == 1
    assert steps["other_key"] == [32, 8]
    assert steps["files_after"] == 2

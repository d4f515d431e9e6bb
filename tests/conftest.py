"""Test-session set-up.

One CPU thread for torch, here and in the subprocesses the tests start (unless OMP_NUM_THREADS is set): the tests'
tensors are tiny, so a second thread only adds synchronisation, and on a busy 2-core machine it made the quick
suite several times slower (a thread waiting for a descheduled peer at every op).

On a CUDA machine the libraries' Triton autotuners (fla, mamba-ssm) keep their leanest working config instead of
timing every config per new shape (minutes per test on a cold machine). The tests check results, which do not
depend on the config; speed is measured by the benchmarks, with full autotuning."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402 - after the thread count is set

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

if torch.cuda.is_available():
    from llm_surgery.triton_autotune import quick_autotune

    quick_autotune()

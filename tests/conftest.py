"""Test-session set-up: on a CUDA machine the libraries' Triton autotuners (fla, mamba-ssm) keep their leanest
working config instead of timing every config per new shape (minutes per test on a cold machine). The tests check
results, which do not depend on the config; speed is measured by the benchmarks, with full autotuning."""

import torch

if torch.cuda.is_available():
    from llm_surgery.triton_autotune import quick_autotune

    quick_autotune()

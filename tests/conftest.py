"""Test-session set-up.

One CPU thread for torch, here and in the subprocesses the tests start (unless OMP_NUM_THREADS is set): the tests'
tensors are tiny, so a second thread only adds synchronisation, and on a busy 2-core machine it made the quick
suite several times slower (a thread waiting for a descheduled peer at every op).

On a CUDA machine the libraries' Triton autotuners (fla, mamba-ssm) keep their leanest working config instead of
timing every config per new shape (minutes per test on a cold machine). The tests check results, which do not
depend on the config; speed is measured by the benchmarks, with full autotuning."""

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402 - after the thread count is set

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

if torch.cuda.is_available():
    from llm_surgery.triton_autotune import quick_autotune

    quick_autotune()


@pytest.fixture(scope="session")
def tiny_box_host(tmp_path_factory):
    """`tiny_box_host(hidden_size)`: the folder of a tiny Granite-4.0 host (2 attention blocks) saved like a user's
    checkpoint, with the Box word tokenizer; one per width per session."""
    made = {}

    def make(hidden_size: int = 32):
        if hidden_size not in made:
            from llm_surgery.box_data import build_box_tokenizer
            from llm_surgery.hosts import build_tiny_host

            path = tmp_path_factory.mktemp(f"host{hidden_size}")
            tok = build_box_tokenizer()
            build_tiny_host("granite", seed=0, hidden_size=hidden_size, vocab_size=len(tok), pattern="M*M*",
                            mamba_chunk_size=64).save_pretrained(path)
            tok.save_pretrained(path)
            made[hidden_size] = path
        return made[hidden_size]

    return make


@pytest.fixture(scope="session")
def tiny_host_dir(tiny_box_host):
    return tiny_box_host(32)

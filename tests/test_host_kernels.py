"""llm_surgery.host_kernels: CUDA tensors go to the kernel, CPU tensors keep transformers' reference."""

import importlib

import pytest
import torch
from gpu_libraries import require_gpu_library

from llm_surgery import host_kernels
from llm_surgery.hosts import build_tiny_host


class _CudaLike:
    is_cuda = True


def test_route_by_device_and_filter_kwargs():
    calls = []

    def reference(x, y=0, **kw):
        calls.append(("ref", kw))
        return "ref"

    def kernel(x, y=0, chunk=1):
        calls.append(("kernel", {"chunk": chunk}))
        return "kernel"

    routed = host_kernels._route(reference, kernel)
    assert routed(torch.zeros(1), y=1, extra=2) == "ref"
    assert calls[-1] == ("ref", {"extra": 2})  # the reference gets everything (transformers filters itself)
    assert routed(_CudaLike(), y=1, chunk=3, extra=2) == "kernel"  # the kernel only what it takes
    assert calls[-1] == ("kernel", {"chunk": 3})


def test_patch_is_idempotent_and_cpu_outputs_unchanged(monkeypatch):
    mod = importlib.import_module(host_kernels.HOST_MODULES[0])
    for attr in ("mamba2_chunk_scan", "mamba2_selective_state_update"):
        monkeypatch.setattr(mod, attr, getattr(mod, attr))  # restored after the test
    model = build_tiny_host("granite", seed=0, hidden_size=32, vocab_size=50, pattern="M*M*", mamba_chunk_size=8)
    ids = torch.randint(0, 50, (2, 11))
    before = model(ids).logits

    def fake_kernel(*a, **k):
        raise AssertionError("a CPU tensor reached the CUDA kernel")

    import llm_surgery.layers.mamba2 as m2
    monkeypatch.setattr(m2, "mamba_kernels", lambda: (fake_kernel, fake_kernel))
    line = host_kernels.use_mamba_kernels_for_hosts()
    assert "granitemoehybrid (mamba2_chunk_scan, mamba2_selective_state_update)" in line
    patched = mod.mamba2_chunk_scan
    host_kernels.use_mamba_kernels_for_hosts()
    assert mod.mamba2_chunk_scan is patched  # not wrapped twice
    torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)


def test_no_kernels_says_so(monkeypatch):
    import llm_surgery.layers.mamba2 as m2
    monkeypatch.setattr(m2, "mamba_kernels", lambda: None)
    assert "torch reference" in host_kernels.use_mamba_kernels_for_hosts()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and mamba-ssm's Triton kernels")
def test_host_on_cuda_matches_reference():
    require_gpu_library("mamba2")
    model = build_tiny_host("granite", seed=0, hidden_size=64, vocab_size=50, pattern="M*M*", mamba_chunk_size=16)
    model = model.cuda().float()
    ids = torch.randint(0, 50, (2, 40), device="cuda")
    ref = model(ids).logits
    host_kernels.use_mamba_kernels_for_hosts()
    torch.testing.assert_close(model(ids).logits, ref, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("arch", ["granite", "nemotron"])
@pytest.mark.parametrize("hidden_size", [32, 64, 128])
def test_tiny_hosts_suit_causal_conv1d(arch, hidden_size):
    """causal-conv1d's channel-last kernel (the hosts' CUDA path where it is installed) needs the Mamba in_proj rows
    and the convolution's channels in multiples of 8, as every real host has them: so must the tiny hosts."""
    model = build_tiny_host(arch, hidden_size=hidden_size)
    rows = [m.out_features for n, m in model.named_modules() if n.endswith("in_proj")]
    channels = [m.weight.shape[0] for n, m in model.named_modules() if n.endswith("conv1d")]
    assert rows and channels
    assert all(r % 8 == 0 for r in rows + channels), (rows, channels)


def test_cpu_convolutions_go_to_torch_where_causal_conv1d_is_installed(monkeypatch):
    """With causal-conv1d importable, transformers' decorated causal_conv1d_fn calls its CUDA kernel for any tensor;
    after routing, a CPU tensor reaches the torch function the decorator wraps and a CUDA one the package."""
    import functools

    mod = importlib.import_module(host_kernels.HOST_MODULES[0])

    def torch_function(x, weight, bias=None, activation=None, **kwargs):
        return "torch"

    @functools.wraps(torch_function)
    def package(*args, **kwargs):   # what transformers' decorator returns with causal-conv1d installed
        if not getattr(args[0], "is_cuda", False):
            raise RuntimeError("Expected x.is_cuda() to be true, but got false.")
        return "package"

    monkeypatch.setattr(mod, "causal_conv1d_fn", package)
    with pytest.raises(RuntimeError, match="is_cuda"):
        mod.causal_conv1d_fn(torch.zeros(1), None)
    assert f"{host_kernels.HOST_MODULES[0].rsplit('.', 1)[-1]}.causal_conv1d_fn" in \
        host_kernels.keep_cpu_convolutions_in_torch()
    assert mod.causal_conv1d_fn(torch.zeros(1), None) == "torch"
    assert mod.causal_conv1d_fn(_CudaLike(), None) == "package"
    routed = mod.causal_conv1d_fn
    host_kernels.keep_cpu_convolutions_in_torch()
    assert mod.causal_conv1d_fn is routed   # not wrapped twice


def test_surgery_routes_cpu_convolutions_so_a_cpu_host_runs_where_causal_conv1d_is_installed(monkeypatch):
    """insert_layers applies `keep_cpu_convolutions_in_torch`: a CPU host with inserted layers runs its Mamba2
    convolutions in torch even where transformers would call causal-conv1d's CUDA-only kernel (which, before,
    failed the tokens-alone test on a GPU machine with causal-conv1d)."""
    import functools

    from llm_surgery.hosts import build_tiny_host
    from llm_surgery.insert import insert_layers

    host = build_tiny_host("granite", seed=1, pattern="M*")
    mod = importlib.import_module(type(host).__module__)
    torch_function = getattr(mod.causal_conv1d_fn, "__wrapped__", None) or mod.causal_conv1d_fn
    calls = []

    @functools.wraps(torch_function)
    def package(x, *args, **kwargs):   # transformers' decorated function with causal-conv1d installed
        calls.append(x.device.type)
        if not x.is_cuda:
            raise RuntimeError("Expected x.is_cuda() to be true, but got false.")

    monkeypatch.setattr(mod, "causal_conv1d_fn", package)
    model = insert_layers(host, "pdssm", 1).eval()
    with torch.no_grad():
        model(torch.randint(0, model.config.vocab_size, (1, 6)), use_cache=False)
    assert calls == []   # the CPU tensors went to the torch function

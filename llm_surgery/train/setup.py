"""The set-up a run and a re-evaluation of its artifact share: the Accelerator (device, mixed precision, DDP or
FSDP2), the process-wide CUDA kernel choices, the host on this process's device, LoRA, and which tensors train
(kept in float32 under mixed precision). The trainer and `evaluate_run` both import it, so neither imports the
other."""

from __future__ import annotations

import os

import torch

from .artifact import lora_config
from .config import TrainConfig, UsageError


def resolve_precision(flag: str | None, on_cuda: bool, env=os.environ) -> tuple[str, str]:
    """(mixed precision, where it came from): the --mixed-precision flag, else Accelerate's setting (`accelerate
    config` or `accelerate launch --mixed_precision` reach the process as ACCELERATE_MIXED_PRECISION), else auto;
    auto is bf16 on CUDA and no on the CPU."""
    source = "--mixed-precision"
    if flag is None and env.get("ACCELERATE_MIXED_PRECISION"):
        flag, source = env["ACCELERATE_MIXED_PRECISION"].lower(), "Accelerate's config (ACCELERATE_MIXED_PRECISION)"
        if flag not in ("no", "bf16", "fp16"):
            raise UsageError(f"Accelerate's config sets mixed precision {flag!r} (ACCELERATE_MIXED_PRECISION), which "
                             "this trainer does not support; use no, bf16 or fp16 (accelerate config, or "
                             "--mixed-precision)")
    elif flag is None:
        flag, source = "auto", "default"
    if flag == "auto":
        return ("bf16" if on_cuda else "no"), f"{source}: auto"
    return flag, source


def make_accelerator(cfg: TrainConfig):
    """The run's Accelerator. DDP: only the trainable tensors are in its buckets (frozen ones have requires_grad
    False); gradients are views of the buckets (no copy in and out); buffers are not broadcast before every
    forward (the host's and the inserted layers' buffers are the same on every rank); a static graph when every
    step runs the same graph with one backward."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    on_cuda = torch.cuda.is_available() and not cfg.cpu and os.environ.get("ACCELERATE_USE_CPU", "").lower() \
        not in ("1", "true", "yes")
    precision, source = resolve_precision(cfg.mixed_precision, on_cuda)
    kwargs = dict(cpu=cfg.cpu or not on_cuda, mixed_precision=precision)
    if cfg.fsdp:
        from accelerate.utils import FullyShardedDataParallelPlugin

        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap", reshard_after_forward=True,
            state_dict_type="FULL_STATE_DICT", cpu_ram_efficient_loading=False)
    else:
        kwargs["kwargs_handlers"] = [DistributedDataParallelKwargs(
            find_unused_parameters=False, gradient_as_bucket_view=True, broadcast_buffers=False,
            bucket_cap_mb=cfg.ddp_bucket_mb, static_graph=cfg.grad_accum == 1 and not cfg.gradient_checkpointing)]
    accelerator = Accelerator(**kwargs)
    accelerator.precision_source = source
    if cfg.fsdp and accelerator.distributed_type.value != "FSDP":
        raise UsageError(f"--fsdp needs 2 or more GPU processes (Accelerate shards only on accelerators); this "
                         f"launch gives {accelerator.num_processes} process(es) of type "
                         f"{accelerator.distributed_type.value}. Launch with accelerate launch --num_processes N.")
    return accelerator


def use_cuda_kernels(cfg: TrainConfig, accelerator, log) -> None:
    """Process-wide kernel choices of a run on CUDA (idempotent): the pd_scan kernels built in the background
    while the host loads (pdssm layers), Triton autotuning kept on disk (and quick, or redone, on request),
    mamba-ssm kernels for the host's Mamba2 layers."""
    if accelerator.device.type != "cuda":
        return
    if "pdssm" in cfg.kind.split("+"):
        from llm_surgery.ops.pd_scan.cuda import start_build
        start_build()
    from llm_surgery.triton_autotune import persistent_autotune, quick_autotune

    if cfg.quick_autotune:
        log(f"quick Triton autotuning: {'on' if quick_autotune() else 'unavailable'}")
    folder = persistent_autotune(retune=cfg.retune)
    log("Triton autotuning: " + ("unavailable in this Triton" if folder is None else
                                 f"{'timed again (--retune), then ' if cfg.retune else ''}kept in {folder}"))
    if cfg.host_kernels:
        from llm_surgery.host_kernels import use_mamba_kernels_for_hosts
        log(use_mamba_kernels_for_hosts())


def load_host(cfg: TrainConfig, accelerator, log):
    """(model, tokenizer, description) on this process's device."""
    from .host import load_pretrained, random_init_host, resolve_dtype

    dtype = resolve_dtype(cfg.host_dtype, accelerator.device.type == "cuda")
    if cfg.random_init_config:
        model, tok = random_init_host(cfg.random_init_config, dtype, accelerator.device, cfg.seed)
        return model, tok, f"random-init {cfg.random_init_config}"
    path = cfg.model
    if path is None:  # the shipped host if intact, else one pretrained here (main process first, then cached)
        from .host import embedded_host
        if accelerator.is_main_process:
            embedded_host(cfg, log=log)
        accelerator.wait_for_everyone()
        path = str(embedded_host(cfg, log=lambda msg: None))
    model, tok = load_pretrained(path, dtype, accelerator.device, log=log)
    return model, tok, path


def add_lora(model, cfg: TrainConfig):
    """LoRA adapters on the host's attention projections (peft), trained with the inserted layers."""
    from peft import inject_adapter_in_model

    lcfg = lora_config(cfg, model)
    inject_adapter_in_model(lcfg, model)
    if not any("lora_" in n for n, _ in model.named_parameters()):
        raise UsageError(f"--lora-targets {sorted(lcfg.target_modules)} matched no module of this host")
    return lcfg


def mark_trainable(model) -> list[str]:
    """Only inserted layers and LoRA weights train; everything else is frozen. Returns the trainable names."""
    from llm_surgery.insert import inserted_layers

    inserted = {id(p) for block in inserted_layers(model).values() for p in block.parameters()}
    names = []
    for n, p in model.named_parameters():
        p.requires_grad_(id(p) in inserted or "lora_" in n)
        if p.requires_grad:
            names.append(n)
    if not names:
        raise RuntimeError("no trainable parameters after the surgery")
    return names


def upcast_trainable(model, accelerator) -> None:
    """Under bf16/fp16 mixed precision the trainable tensors are kept in float32 (master weights); autocast does
    the compute in low precision. Training and a re-evaluation of its artifact run the same way."""
    if accelerator.mixed_precision in ("bf16", "fp16"):
        for p in model.parameters():
            if p.requires_grad and p.is_floating_point():
                p.data = p.data.float()

"""The final artifact of a run: a `save_inserted` directory (inserted layers + inserted.json), plus the LoRA
adapter weights when LoRA was on (`lora.safetensors` + `lora.json`), and the way back (`load_trained`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LORA_WEIGHTS, LORA_CONFIG = "lora.safetensors", "lora.json"


def save_final(accelerator, model, final_dir: Path, cfg) -> None:
    """Collective. Rank 0 writes, into a temporary directory that then replaces `final_dir` (outputs.publish_dir:
    a crash never leaves half an artifact). Under FSDP2 the trainable tensors (and buffers) are gathered first, to
    rank 0's CPU: each rank holds only shards of them."""
    import shutil

    from .outputs import publish_dir

    from accelerate.utils import DistributedType
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from llm_surgery.insert import save_inserted

    inner = accelerator.unwrap_model(model)
    full = None
    if accelerator.distributed_type == DistributedType.FSDP:
        full = get_model_state_dict(model, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True, ignore_frozen_params=True))
    if accelerator.is_main_process:
        final_dir = Path(final_dir)
        tmp = final_dir.with_name(f".tmp-{final_dir.name}")
        if tmp.exists():
            shutil.rmtree(tmp)
        save_inserted(inner, tmp, full_state_dict=full)
        if cfg.lora_r:
            state = full if full is not None else inner.state_dict()
            lora = {k: v.detach().cpu().contiguous() for k, v in state.items() if "lora_" in k}
            save_file(lora, str(tmp / LORA_WEIGHTS))
            (tmp / LORA_CONFIG).write_text(json.dumps(
                {"r": cfg.lora_r, "alpha": cfg.lora_alpha, "dropout": cfg.lora_dropout,
                 "targets": cfg.lora_targets}, indent=2))
        publish_dir(tmp, final_dir)
    accelerator.wait_for_everyone()


def lora_config(r: int, alpha: float, dropout: float, targets: list[str]):
    """peft LoRA on the host's modules named `targets`, never inside the inserted layers (`pre_ssm`): DeltaNet's
    projections carry the attention names (q/k/v/o_proj), and a mixer runs its library layer on its own
    parameters, which a LoRA wrapper would rename."""
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                      exclude_modules=r".*\.pre_ssm\..*")


def load_trained(model, final_dir: str | Path):
    """Put a run's trained layers (and LoRA adapters, if saved) into a fresh host; returns the model."""
    from peft import inject_adapter_in_model

    from llm_surgery.insert import load_inserted

    final_dir = Path(final_dir)
    load_inserted(model, final_dir)
    if (final_dir / LORA_CONFIG).is_file():
        spec = json.loads((final_dir / LORA_CONFIG).read_text())
        targets = [t.strip() for t in spec["targets"].split(",") if t.strip()]
        inject_adapter_in_model(lora_config(spec["r"], spec["alpha"], spec["dropout"], targets), model)
        weights = load_file(str(final_dir / LORA_WEIGHTS))
        missing = set(weights) - set(model.state_dict())
        if missing:
            raise ValueError(f"{final_dir / LORA_WEIGHTS} has tensors this host lacks: {sorted(missing)[:5]}")
        with torch.no_grad():
            model.load_state_dict(weights, strict=False)
    for p in model.parameters():
        p.requires_grad_(False)
    return model

"""The final artifact of a run: a `save_inserted` directory (inserted layers + inserted.json), plus, when LoRA was
on, a standard peft adapter in `lora/` (`adapter_config.json` + `adapter_model.safetensors`: the surgery keeps the
host's module names, so `PeftModel.from_pretrained(host, final/lora)` loads it onto the plain host too), and the
way back (`load_trained`)."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file, save_file

LORA_DIR = "lora"
PEFT_PREFIX = "base_model.model."   # the key prefix of a PeftModel's saved adapter


def lora_config(cfg, model=None):
    """The peft LoraConfig of a run (`--lora-r`, `--lora-alpha`, `--lora-dropout`, `--lora-targets`): on the host's
    modules of those names; given the `model` to inject into, never inside its inserted layers (`pre_ssm`):
    DeltaNet's projections carry the attention names (q/k/v/o_proj), and a mixer runs its library layer on its own
    parameters, which a LoRA wrapper would rename. Without `model`: the saved adapter's config, the host's alone."""
    from peft import LoraConfig

    targets = [t.strip() for t in cfg.lora_targets.split(",") if t.strip()]
    return LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout, target_modules=targets,
                      exclude_modules=None if model is None else _inserted_layers_pattern(targets, model))


def _inserted_layers_pattern(targets, model) -> str | None:
    """The exclusion that keeps LoRA out of `model`'s inserted layers, or None where none of them has a module of a
    target's name (peft warns about an exclusion that excludes nothing, e.g. on the plain host)."""
    names = set(targets)
    inside = any(".pre_ssm." in name and name.rsplit(".", 1)[-1] in names for name, _ in model.named_modules())
    return r".*\.pre_ssm\..*" if inside else None


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
            from peft import get_peft_model_state_dict

            lcfg = lora_config(cfg)   # the host's alone: load_trained sets the exclusion for the model it fills
            lcfg.base_model_name_or_path = str(cfg.model) if cfg.model else None
            lcfg.save_pretrained(str(tmp / LORA_DIR))
            lora = get_peft_model_state_dict(inner, state_dict=full)
            save_file({PEFT_PREFIX + k: v.detach().cpu().contiguous() for k, v in lora.items()},
                      str(tmp / LORA_DIR / "adapter_model.safetensors"))
        publish_dir(tmp, final_dir)
    accelerator.wait_for_everyone()


def load_trained(model, final_dir: str | Path):
    """Put a run's trained layers (and LoRA adapters, if saved) into a fresh host; returns the model."""
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict

    from llm_surgery.insert import load_inserted

    final_dir = Path(final_dir)
    load_inserted(model, final_dir)
    adapter = final_dir / LORA_DIR
    if (adapter / "adapter_config.json").is_file():
        lcfg = LoraConfig.from_pretrained(str(adapter))
        lcfg.exclude_modules = _inserted_layers_pattern(lcfg.target_modules, model)
        inject_adapter_in_model(lcfg, model)
        saved = load_file(str(adapter / "adapter_model.safetensors"))
        weights = {k.removeprefix(PEFT_PREFIX): v for k, v in saved.items()}
        result = set_peft_model_state_dict(model, weights)
        if result.unexpected_keys:
            raise ValueError(f"{adapter} has tensors this host lacks: {sorted(result.unexpected_keys)[:5]}")
    for p in model.parameters():
        p.requires_grad_(False)
    return model

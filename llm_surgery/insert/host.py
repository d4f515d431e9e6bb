"""What the surgery needs to know about a host: which architectures are supported, where the decoder layers
and attention blocks are, and the host's norm epsilon, dtype and device."""

from __future__ import annotations

import torch
from transformers import GraniteMoeHybridModel, NemotronHModel, PreTrainedModel

#: model_type -> (base model class, config attribute holding the RMSNorm epsilon)
SUPPORTED = {
    "granitemoehybrid": (GraniteMoeHybridModel, "rms_norm_eps"),
    "nemotron_h": (NemotronHModel, "layer_norm_epsilon"),
}
_ALLOWED = ("GraniteMoeHybridForCausalLM / GraniteMoeHybridModel (Granite 4.0 hybrids, model_type "
            "'granitemoehybrid') and NemotronHForCausalLM / NemotronHModel (Nemotron-H, model_type 'nemotron_h')")


def base_model(model) -> torch.nn.Module:
    """The decoder stack (`GraniteMoeHybridModel` / `NemotronHModel`) of a supported host, or a clear error."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"expected a transformers model, got {type(model).__name__}; supported: {_ALLOWED}. "
                        "Do the surgery before wrapping the model (Accelerate, DDP, FSDP).")
    model_type = getattr(model.config, "model_type", None)
    if model_type not in SUPPORTED:
        raise ValueError(f"unsupported architecture {type(model).__name__} (model_type {model_type!r}); "
                         f"supported: {_ALLOWED}")
    base = model.base_model
    if not isinstance(base, SUPPORTED[model_type][0]):
        raise ValueError(f"{type(model).__name__} has no {SUPPORTED[model_type][0].__name__} decoder stack; "
                         f"supported: {_ALLOWED}")
    return base


def attention_layers(base) -> list[int]:
    """Decoder-layer indices of the attention blocks, in order."""
    return [i for i, layer in enumerate(base.layers) if getattr(layer, "block_type", None) == "full_attention"]


def norm_eps(base) -> float:
    return float(getattr(base.config, SUPPORTED[base.config.model_type][1]))


def dtype_and_device(layer: torch.nn.Module) -> tuple[torch.dtype, torch.device]:
    """Where new modules next to `layer` must live: the dtype/device of its floating-point parameters."""
    for p in layer.parameters():
        if p.is_floating_point():
            return p.dtype, p.device
    return torch.get_default_dtype(), torch.device("cpu")


def host_signature(base) -> dict:
    """What an inserted-layer checkpoint must match to be loaded into a host."""
    return {
        "model_type": base.config.model_type,
        "hidden_size": int(base.config.hidden_size),
        "num_hidden_layers": len(base.layers),
        "attention_layers": attention_layers(base),
    }

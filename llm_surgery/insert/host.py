"""What the surgery needs to know about a host: which architectures are supported, where the decoder layers
and attention blocks are, and the host's norm epsilon, dtype and device."""

from __future__ import annotations

import hashlib
import json

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


#: Config fields that do not shape the network a checkpoint's layers were trained in (paths, versions, dtype,
#: output switches, the special token ids and loss coefficients that trainers such as TRL's set on the model);
#: fields starting with "_" are internal and left out too.
_RUNTIME_FIELDS = {"transformers_version", "dtype", "torch_dtype", "architectures", "use_cache", "output_attentions",
                   "output_hidden_states", "output_router_logits", "return_dict", "id2label", "label2id",
                   "problem_type", "use_mamba_kernels", "tokenizer_class", "pad_token_id", "bos_token_id",
                   "eos_token_id", "router_aux_loss_coef"}


def host_config(base) -> dict:
    """The host config's fields that define its network, as JSON values (what an inserted-layer checkpoint
    records and compares)."""
    full = json.loads(base.config.to_json_string(use_diff=False))
    return {k: v for k, v in sorted(full.items()) if not k.startswith("_") and k not in _RUNTIME_FIELDS}


def config_hash(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def config_differences(saved: dict, current: dict) -> list[str]:
    """Fields both configs have with different values. A field only one side has comes from another transformers
    release (new fields get defaults) and is not a difference of the host."""
    return [f"{k}: checkpoint {saved[k]!r}, model {current[k]!r}"
            for k in sorted(set(saved) & set(current)) if saved[k] != current[k]]

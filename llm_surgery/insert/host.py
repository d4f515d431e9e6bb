"""What the surgery needs to know about a host: where its decoder layers are, which of them are attention blocks
(an inserted layer goes directly before one), its norm epsilon, dtype and device.

One table, `FAMILIES`, answers this per transformers `model_type`; docs/hosts.md shows it to users. A model type
not in the table is accepted when it is shaped like the others (`family`'s generic rule: a `layers` list of decoder
layers, some holding a `self_attn` module); anything else is refused in one line that says what was not found.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

#: `config.layer_types` values whose decoder layer runs attention. Sliding-window and chunked attention count;
#: "hybrid" is a layer that runs attention beside a recurrent mixer (Falcon-H1: every layer; Zamba2: the layers
#: that call the shared attention block). The legacy name "attention" is what transformers releases before the
#: remap of legacy layer names keep.
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "hybrid", "attention")

#: Config fields that hold a family's norm epsilon, in the order the generic rule tries them.
EPS_FIELDS = ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "norm_eps")


@dataclass(frozen=True)
class Family:
    """How to read one host family.

    attention: "self_attn" (the decoder layers that hold a `self_attn` module: dense models, where that is every
        layer) or "layer_types" (the layers whose `config.layer_types` entry is in ATTENTION_LAYER_TYPES: hybrids,
        whose recurrent layers may also be called attention modules).
    eps: the config field of the host's norm epsilon (the inserted block's RMSNorm uses the same).
    layers: the attribute of the base model (`model.base_model`) holding the decoder layers.
    """
    attention: str
    eps: str = "rms_norm_eps"
    layers: str = "layers"


_DENSE = Family("self_attn")
_HYBRID = Family("layer_types")

#: model_type -> Family. Every row is built as a tiny host and checked by tests/test_any_host.py.
FAMILIES: dict[str, Family] = {
    **dict.fromkeys(("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
                     "gemma3_text", "granite", "granitemoe", "phi3", "olmo2", "olmo3", "smollm3"), _DENSE),
    **dict.fromkeys(("granitemoehybrid", "falcon_h1", "bamba", "jamba", "zamba2", "qwen3_next", "qwen3_5_text",
                     "olmo_hybrid", "minimax"), _HYBRID),
    "nemotron_h": Family("layer_types", eps="layer_norm_epsilon"),
    "lfm2": Family("layer_types", eps="norm_eps"),
}

_ADD_A_ROW = "add a row for its model_type to llm_surgery.insert.host.FAMILIES (see docs/hosts.md)"


def family(model) -> Family:
    """The table's row for this model's type, or the generic rule; a one-line error for a model shaped otherwise."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"expected a transformers model, got {type(model).__name__}. Do the surgery before "
                        "wrapping the model (Accelerate, DDP, FSDP).")
    model_type = getattr(model.config, "model_type", None)
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    base = model.base_model
    layers = getattr(base, "layers", None)
    what = f"unsupported architecture {type(model).__name__} (model_type {model_type!r}, not in the host table)"
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"{what}: its base model {type(base).__name__} has no `layers` list of decoder layers; "
                         + _ADD_A_ROW)
    if not any(getattr(layer, "self_attn", None) is not None for layer in layers):
        raise ValueError(f"{what}: none of its {len(layers)} decoder layers has a `self_attn` module; " + _ADD_A_ROW)
    eps = next((f for f in EPS_FIELDS if isinstance(getattr(model.config, f, None), float)), None)
    if eps is None:
        raise ValueError(f"{what}: its config has none of the norm-epsilon fields {EPS_FIELDS}; " + _ADD_A_ROW)
    return Family("layer_types" if _layer_types(model.config, len(layers)) else "self_attn", eps=eps)


def _layer_types(config, n_layers: int) -> list[str] | None:
    types = getattr(config, "layer_types", None)
    return list(types) if isinstance(types, (list, tuple)) and len(types) == n_layers else None


def unwrap_peft(model):
    """A peft `PeftModel`'s transformers model (`get_base_model()`), else `model`: the surgery's functions that read
    or save the inserted layers take either."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) and hasattr(model, "peft_config") else model


def running_block(module) -> torch.nn.Module:
    """The inserted block that runs: under peft's `modules_to_save` (a wrapper holding the original and one trained
    copy per adapter) the active adapter's copy, or the original while adapters are off; else the block itself."""
    copies = module._modules.get("modules_to_save")  # the child registry: no AttributeError raised per forward
    if not isinstance(copies, torch.nn.ModuleDict):
        return module
    active = [] if module.disable_adapters else module.active_adapters
    return copies[active[0]] if active and active[0] in copies else module.original_module


def base_model(model) -> torch.nn.Module:
    """The decoder stack (the model's `base_model`, e.g. `LlamaModel`) of a host (or of a peft model's host), or a
    clear error."""
    model = unwrap_peft(model)
    row = family(model)
    base = model.base_model
    layers = getattr(base, row.layers, None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"{type(model).__name__}'s base model {type(base).__name__} has no decoder-layer list "
                         f"`{row.layers}`; " + _ADD_A_ROW)
    return base


def decoder_layers(base) -> torch.nn.ModuleList:
    return getattr(base, family(base).layers)


def attention_layers(base) -> list[int]:
    """Decoder-layer indices of the attention blocks, in order (the family's rule)."""
    layers = decoder_layers(base)
    if family(base).attention == "self_attn":
        return [i for i, layer in enumerate(layers) if getattr(layer, "self_attn", None) is not None]
    types = _layer_types(base.config, len(layers))
    if types is None:
        raise ValueError(f"{type(base).__name__}: config.layer_types is missing or does not list its "
                         f"{len(layers)} decoder layers, so its attention blocks cannot be found")
    return [i for i, t in enumerate(types) if t in ATTENTION_LAYER_TYPES]


def norm_eps(base) -> float:
    return float(getattr(base.config, family(base).eps))


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
        "num_hidden_layers": len(decoder_layers(base)),
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

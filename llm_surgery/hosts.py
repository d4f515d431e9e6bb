"""Host models for tests and reports: tiny random Granite 4.0 / Nemotron-H hosts built from configs, and the
published configurations of the real checkpoints (so shapes and parameter counts can be checked on the meta
device without downloading anything).

The real configurations come from the checkpoints' config.json files on the hub;
only the fields that shape the network are kept.
"""

from __future__ import annotations

import copy

import torch
from transformers import (GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM, NemotronHConfig,
                          NemotronHForCausalLM)

ARCHITECTURES = ("granite", "nemotron")

_GRANITE_COMMON = dict(
    model_type="granitemoehybrid", position_embedding_type="nope", mamba_n_groups=1, mamba_d_conv=4,
    mamba_expand=2, mamba_chunk_size=256, mamba_conv_bias=True, mamba_proj_bias=False, embedding_multiplier=12.0,
    tie_word_embeddings=True, vocab_size=100352, hidden_act="silu", rms_norm_eps=1e-5, attention_bias=False,
    max_position_embeddings=131072,
)


def _granite_layers(n: int, attention: list[int]) -> list[str]:
    return ["attention" if i in attention else "mamba" for i in range(n)]


def _nemotron(pattern: str, **kw) -> dict:
    return dict(model_type="nemotron_h", hybrid_override_pattern=pattern, n_groups=8, conv_kernel=4,
                ssm_state_size=128, head_dim=128, mlp_hidden_act="relu2", vocab_size=131072,
                tie_word_embeddings=False, layer_norm_epsilon=1e-5, chunk_size=128, **kw)


#: Published shapes of the real hosts (config.json fields; legacy layer names as in the files).
HOST_CONFIGS: dict[str, dict] = {
    "granite-4.0-h-350m": dict(
        _GRANITE_COMMON, hidden_size=768, num_hidden_layers=32, layer_types=_granite_layers(32, [10, 13, 17, 27]),
        num_attention_heads=12, num_key_value_heads=4, mamba_n_heads=48, mamba_d_head=32, mamba_d_state=128,
        num_local_experts=0, num_experts_per_tok=0, intermediate_size=2048, shared_intermediate_size=2048,
        residual_multiplier=0.246, attention_multiplier=0.015625, logits_scaling=3.0,
        max_position_embeddings=32768),
    "granite-4.0-h-1b": dict(
        _GRANITE_COMMON, hidden_size=1536, num_hidden_layers=40, layer_types=_granite_layers(40, [5, 15, 25, 35]),
        num_attention_heads=12, num_key_value_heads=4, mamba_n_heads=48, mamba_d_head=64, mamba_d_state=128,
        num_local_experts=0, num_experts_per_tok=0, intermediate_size=4096, shared_intermediate_size=4096,
        residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=6.0),
    "granite-4.0-h-micro": dict(
        _GRANITE_COMMON, hidden_size=2048, num_hidden_layers=40, layer_types=_granite_layers(40, [5, 15, 25, 35]),
        num_attention_heads=32, num_key_value_heads=8, mamba_n_heads=64, mamba_d_head=64, mamba_d_state=128,
        num_local_experts=0, num_experts_per_tok=0, intermediate_size=8192, shared_intermediate_size=8192,
        residual_multiplier=0.22, attention_multiplier=0.015625, logits_scaling=8.0),
    "granite-4.0-h-tiny": dict(
        _GRANITE_COMMON, hidden_size=1536, num_hidden_layers=40, layer_types=_granite_layers(40, [5, 15, 25, 35]),
        num_attention_heads=12, num_key_value_heads=4, mamba_n_heads=48, mamba_d_head=64, mamba_d_state=128,
        num_local_experts=64, num_experts_per_tok=6, intermediate_size=512, shared_intermediate_size=1024,
        residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=6.0),
    "nemotron-nano-9b-v2": _nemotron(
        "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-", hidden_size=4480, intermediate_size=15680,
        num_attention_heads=40, num_key_value_heads=8, mamba_num_heads=128, mamba_head_dim=80),
    "nemotron-nano-12b-v2": _nemotron(
        "M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M-", hidden_size=5120,
        intermediate_size=20480, num_attention_heads=40, num_key_value_heads=8, mamba_num_heads=128,
        mamba_head_dim=80),
}


def config_from_dict(d: dict):
    """A transformers config object from one of the dicts above (or any dict with a supported model_type)."""
    d = copy.deepcopy(d)
    model_type = d.pop("model_type")
    if model_type == "granitemoehybrid":
        return GraniteMoeHybridConfig(**d)
    if model_type == "nemotron_h":
        return NemotronHConfig(**d)
    raise ValueError(f"unsupported model_type {model_type!r}; expected 'granitemoehybrid' or 'nemotron_h'")


def build_host(name_or_config: str | dict, device: str | torch.device = "meta",
               dtype: torch.dtype = torch.bfloat16, num_hidden_layers: int | None = None):
    """A randomly initialised (or, on "meta", unallocated) causal LM with a real host's shapes.

    `num_hidden_layers` keeps only the first layers (Granite: rewrites `layer_types`; Nemotron: cuts the
    pattern), for benchmarks that need the real width but cannot afford the full depth.
    """
    if isinstance(name_or_config, str):
        if name_or_config not in HOST_CONFIGS:
            raise ValueError(f"unknown host {name_or_config!r}; known: {sorted(HOST_CONFIGS)}")
        d = copy.deepcopy(HOST_CONFIGS[name_or_config])
    else:
        d = copy.deepcopy(name_or_config)
    if num_hidden_layers is not None:
        if d["model_type"] == "granitemoehybrid":
            d["layer_types"] = d["layer_types"][:num_hidden_layers]
            d["num_hidden_layers"] = num_hidden_layers
        else:
            d["hybrid_override_pattern"] = d["hybrid_override_pattern"][:num_hidden_layers]
    config = config_from_dict(d)
    with torch.device(device):
        model = _causal_lm_class(config)(config)
    return model.to(dtype)


def _causal_lm_class(config):
    return GraniteMoeHybridForCausalLM if config.model_type == "granitemoehybrid" else NemotronHForCausalLM


def tiny_config(arch: str = "granite", hidden_size: int = 64, vocab_size: int = 128, pattern: str | None = None,
                moe: bool = False, **overrides):
    """A small config of either architecture with a mix of Mamba and attention layers.

    Granite: `pattern` uses "M" (mamba) and "*" (attention), default "M*M*"; `moe=True` adds 4 experts (top-2).
    Nemotron: `pattern` is its `hybrid_override_pattern`, default "M*E-M*" (mamba, attention, moe, mlp).
    """
    if hidden_size % 16:
        raise ValueError(f"hidden_size must be a multiple of 16 for the tiny hosts, got {hidden_size}")
    heads = max(2, hidden_size // 16)
    # Mamba heads a multiple of 8, as in every real host: the in_proj rows (2 inner + 2 groups x state + heads) then
    # stay a multiple of 8, which causal-conv1d's channel-last kernel needs where it is installed (CUDA)
    mamba_heads = -(-heads // 8) * 8
    if arch == "granite":
        pattern = pattern or "M*M*"
        if set(pattern) - {"M", "*"}:
            raise ValueError(f"Granite pattern may only use 'M' and '*', got {pattern!r}")
        d = dict(
            model_type="granitemoehybrid", vocab_size=vocab_size, hidden_size=hidden_size,
            num_hidden_layers=len(pattern),
            layer_types=["attention" if c == "*" else "mamba" for c in pattern],
            num_attention_heads=heads, num_key_value_heads=heads // 2, intermediate_size=2 * hidden_size,
            shared_intermediate_size=2 * hidden_size, num_local_experts=4 if moe else 0,
            num_experts_per_tok=2 if moe else 0, mamba_n_heads=mamba_heads, mamba_n_groups=1, mamba_d_state=16,
            mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, position_embedding_type="nope",
            embedding_multiplier=12.0, residual_multiplier=0.246, attention_multiplier=1.0 / 16,
            logits_scaling=3.0, tie_word_embeddings=True, max_position_embeddings=512, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5)
    elif arch == "nemotron":
        pattern = pattern or "M*E-M*"
        d = dict(
            model_type="nemotron_h", vocab_size=vocab_size, hidden_size=hidden_size,
            hybrid_override_pattern=pattern, num_attention_heads=heads, num_key_value_heads=heads // 2,
            head_dim=16, intermediate_size=2 * hidden_size, mamba_num_heads=mamba_heads, mamba_head_dim=16, n_groups=2,
            ssm_state_size=16, conv_kernel=4, chunk_size=8, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=hidden_size, moe_shared_expert_intermediate_size=hidden_size,
            tie_word_embeddings=False, max_position_embeddings=512, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, layer_norm_epsilon=1e-5)
    else:
        raise ValueError(f"arch must be one of {ARCHITECTURES}, got {arch!r}")
    d.update(overrides)
    return config_from_dict(d)


def build_tiny_host(arch: str = "granite", seed: int = 0, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu", **config_kwargs):
    """A tiny random causal LM (`GraniteMoeHybridForCausalLM` or `NemotronHForCausalLM`) for tests and smoke runs.

    Deterministic for a given seed. Save it with `save_pretrained` and reload with `from_pretrained` to test the
    path a user's checkpoint takes. Keyword arguments go to `tiny_config`.
    """
    config = tiny_config(arch, **config_kwargs)
    torch.manual_seed(seed)
    model = _causal_lm_class(config)(config)
    return model.to(device=device, dtype=dtype).eval()

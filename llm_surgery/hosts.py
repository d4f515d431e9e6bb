"""Host models for tests and reports: tiny random hosts built from configs (Granite 4.0 / Nemotron-H by
`build_tiny_host`, every family of the surgery's host table by `build_tiny_family_host`), and the published
configurations of real checkpoints (so shapes and parameter counts can be checked on the meta device, and
throughput measured on random weights, without downloading anything).

The real configurations are the fields of the checkpoints' published config.json files that shape the network
(for Granite 4.0 and Nemotron-H see docs/hosts.md, which also names the source of every configuration here).
"""

from __future__ import annotations

import copy

import torch
from transformers import CONFIG_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig

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
    # Dense and other hybrid families (config.json of meta-llama/Llama-3.2-1B, Qwen/Qwen3-0.6B,
    # Qwen/Qwen3-Next-80B-A3B-Instruct, tiiuae/Falcon-H1-0.5B-Base, ai21labs/Jamba-v0.1).
    "llama-3.2-1b": dict(
        model_type="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, intermediate_size=8192, vocab_size=128256, hidden_act="silu", rms_norm_eps=1e-5,
        max_position_embeddings=131072, tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
        rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                               high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "qwen3-0.6b": dict(
        model_type="qwen3", hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, intermediate_size=3072, vocab_size=151936, hidden_act="silu", rms_norm_eps=1e-6,
        max_position_embeddings=40960, tie_word_embeddings=True, attention_bias=False, rope_theta=1000000.0),
    "qwen3-next-80b-a3b": dict(
        model_type="qwen3_next", hidden_size=2048, num_hidden_layers=48, full_attention_interval=4,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, intermediate_size=5120,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, decoder_sparse_step=1, norm_topk_prob=True, vocab_size=151936,
        hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=262144, tie_word_embeddings=False,
        rope_theta=10000000.0, partial_rotary_factor=0.25),
    "falcon-h1-0.5b": dict(
        model_type="falcon_h1", hidden_size=1024, num_hidden_layers=36, num_attention_heads=8, num_key_value_heads=2,
        head_dim=64, intermediate_size=2048, vocab_size=32784, mamba_d_ssm=1536, mamba_n_heads=24, mamba_d_head=64,
        mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=128,
        mamba_conv_bias=True, mamba_proj_bias=False, mamba_rms_norm=False, mamba_norm_before_gate=False,
        mamba_use_mlp=True, projectors_bias=False, attention_bias=False, mlp_bias=False, hidden_act="silu",
        rms_norm_eps=1e-5, max_position_embeddings=16384, tie_word_embeddings=False, rope_theta=1e11,
        embedding_multiplier=5.656854249492381, lm_head_multiplier=0.0390625, key_multiplier=0.39062499999999994,
        attention_in_multiplier=1.0, attention_out_multiplier=0.9375, ssm_in_multiplier=1.25,
        ssm_out_multiplier=0.23570226039551587, mlp_multipliers=[0.8838834764831844, 0.5859375],
        ssm_multipliers=[0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738]),
    "jamba-v0.1": dict(
        model_type="jamba", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, attn_layer_period=8, attn_layer_offset=4, expert_layer_period=2,
        expert_layer_offset=1, num_experts=16, num_experts_per_tok=2, mamba_d_state=16, mamba_d_conv=4,
        mamba_expand=2, mamba_dt_rank=256, mamba_conv_bias=True, mamba_proj_bias=False, vocab_size=65536,
        hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=262144, tie_word_embeddings=False),
}


def config_from_dict(d: dict):
    """A transformers config object from one of the dicts above (or any dict naming a model_type transformers
    knows), built by the family's own config constructor."""
    d = copy.deepcopy(d)
    model_type = d.pop("model_type")
    if model_type not in CONFIG_MAPPING:
        import transformers

        raise ValueError(f"unsupported model_type {model_type!r}: transformers {transformers.__version__} has no "
                         "such model type")
    return AutoConfig.for_model(model_type, **d)


def build_host(name_or_config: str | dict, device: str | torch.device = "meta",
               dtype: torch.dtype = torch.bfloat16, num_hidden_layers: int | None = None):
    """A randomly initialised (or, on "meta", unallocated) causal LM with a real host's shapes.

    `num_hidden_layers` keeps only the first layers (Nemotron: cuts the pattern; other families: the layer count,
    and `layer_types` where the dict lists them), for benchmarks that need the real width but not the full depth.
    """
    if isinstance(name_or_config, str):
        if name_or_config not in HOST_CONFIGS:
            raise ValueError(f"unknown host {name_or_config!r}; known: {sorted(HOST_CONFIGS)}")
        d = copy.deepcopy(HOST_CONFIGS[name_or_config])
    else:
        d = copy.deepcopy(name_or_config)
    if num_hidden_layers is not None:
        if d["model_type"] == "nemotron_h":
            d["hybrid_override_pattern"] = d["hybrid_override_pattern"][:num_hidden_layers]
        else:
            if "layer_types" in d:
                d["layer_types"] = d["layer_types"][:num_hidden_layers]
            d["num_hidden_layers"] = num_hidden_layers
    config = config_from_dict(d)
    with torch.device(device):
        model = _causal_lm_class(config)(config)
    return model.to(dtype)


def _causal_lm_class(config):
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


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


#: Small sizes of every family in the surgery's host table (`llm_surgery.insert.host.FAMILIES`), for tests: two to
#: four decoder layers of width 64, attention among them where the family mixes layer kinds. Fields the families
#: derive in their config constructors are passed to it (`AutoConfig.for_model`), not set afterwards.
_TINY_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                    eos_token_id=2, tie_word_embeddings=False)
_TINY_MAMBA = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=8)
_TINY_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=16)
TINY_FAMILIES: dict[str, dict] = {
    **{t: dict(num_hidden_layers=2) for t in ("llama", "qwen2", "qwen3", "gemma", "granite", "phi3", "olmo2",
                                               "smollm3")},
    "mistral": dict(num_hidden_layers=2, sliding_window=4),
    "mixtral": dict(num_hidden_layers=2, num_local_experts=2, num_experts_per_tok=1),
    "qwen2_moe": dict(num_hidden_layers=2, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32),
    "qwen3_moe": dict(num_hidden_layers=2, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32),
    "granitemoe": dict(num_hidden_layers=2, num_local_experts=2, num_experts_per_tok=1),
    "gemma2": dict(num_hidden_layers=2, sliding_window=4),
    "gemma3_text": dict(num_hidden_layers=3, sliding_window=4, layer_types=["sliding_attention", "full_attention",
                                                                             "sliding_attention"]),
    "olmo3": dict(num_hidden_layers=2, sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    "granitemoehybrid": dict(_TINY_MAMBA, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
                             shared_intermediate_size=128, num_local_experts=0, position_embedding_type="nope"),
    "nemotron_h": dict(hybrid_override_pattern="M*-", mamba_num_heads=8, mamba_head_dim=16, n_groups=2,
                       ssm_state_size=16, chunk_size=8),
    "falcon_h1": dict(_TINY_MAMBA, num_hidden_layers=2, mamba_d_ssm=128, mamba_n_groups=1),
    "bamba": dict(_TINY_MAMBA, num_hidden_layers=3, attn_layer_indices=[1]),
    "jamba": dict(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1, num_experts=2, mamba_d_state=8, mamba_dt_rank=8, mamba_expand=2),
    "zamba2": dict(num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "mamba"], mamba_headdim=16,
                   mamba_d_state=16, n_mamba_heads=8, chunk_size=8, num_mem_blocks=1, attention_head_dim=32),
    "qwen3_next": dict(_TINY_LINEAR, num_hidden_layers=3, layer_types=["linear_attention", "full_attention",
                                                                       "linear_attention"],
                       num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32),
    "qwen3_5_text": dict(_TINY_LINEAR, num_hidden_layers=3, layer_types=["linear_attention", "full_attention",
                                                                         "linear_attention"]),
    "olmo_hybrid": dict(_TINY_LINEAR, num_hidden_layers=3, layer_types=["linear_attention", "full_attention",
                                                                        "linear_attention"]),
    "lfm2": dict(num_hidden_layers=3, full_attn_idxs=[1], layer_types=["conv", "full_attention", "conv"]),
    "minimax": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], num_local_experts=2,
                    num_experts_per_tok=1),
}


def tiny_family_config(model_type: str, **overrides):
    """A small config of any family in `TINY_FAMILIES`, built by the family's own config constructor."""
    if model_type not in TINY_FAMILIES:
        raise ValueError(f"no tiny sizes for model_type {model_type!r}; known: {sorted(TINY_FAMILIES)}")
    return AutoConfig.for_model(model_type, **{**_TINY_COMMON, **TINY_FAMILIES[model_type], **overrides})


def build_tiny_family_host(model_type: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A tiny random causal LM of any family in `TINY_FAMILIES` (the family's own `*ForCausalLM` class)."""
    from transformers import AutoModelForCausalLM

    config = tiny_family_config(model_type, **overrides)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).to(dtype).eval()


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

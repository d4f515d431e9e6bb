"""Real host configurations (config.json shapes of the published checkpoints) as plain dicts, for shape-level tests
on the meta device. The single source is `llm_surgery.hosts.HOST_CONFIGS` (the parameter report uses it too);
this module re-exports it for tests."""

import copy

from llm_surgery.hosts import HOST_CONFIGS, build_host, config_from_dict

GRANITE = [k for k, v in HOST_CONFIGS.items() if v["model_type"] == "granitemoehybrid"]
NEMOTRON = [k for k, v in HOST_CONFIGS.items() if v["model_type"] == "nemotron_h"]

#: Decoder-layer indices of the attention blocks, as published (host-configs note).
ATTENTION_LAYERS = {
    "granite-4.0-h-350m": [10, 13, 17, 27],
    "granite-4.0-h-1b": [5, 15, 25, 35],
    "granite-4.0-h-micro": [5, 15, 25, 35],
    "granite-4.0-h-tiny": [5, 15, 25, 35],
    "nemotron-nano-9b-v2": [14, 21, 30, 39],
    "nemotron-nano-12b-v2": [7, 16, 25, 34, 43, 52],
}


def host_config(name: str) -> dict:
    """A copy of one host's config dict (safe to modify)."""
    return copy.deepcopy(HOST_CONFIGS[name])


__all__ = ["ATTENTION_LAYERS", "GRANITE", "HOST_CONFIGS", "NEMOTRON", "build_host", "config_from_dict", "host_config"]

"""Save and load only the inserted layers: `inserted.safetensors` (weights) + `inserted.json` (what to rebuild
and which host it belongs to: its shape, name or path, and config with its hash). Loading checks the host, builds
the blocks and loads their weights strictly before it touches the model, so a failed load changes nothing.

A surgered model's `save_pretrained` is `save_pretrained_inserted` (the surgery puts it on the model and its decoder
stack), so that `transformers.Trainer` and TRL's `SFTTrainer` checkpoint it unchanged, while no directory is ever
written that `from_pretrained` would load silently without the inserted layers: no `config.json` at its top.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .host import base_model, config_differences, config_hash, host_config, host_signature
from .surgery import LayerSpec, _insert, inserted_layers, inserted_specs

CONFIG_FILE = "inserted.json"
WEIGHTS_FILE = "inserted.safetensors"
TRAINER_FILE = "model.safetensors"   # the same tensors under the model's own names: what Trainer's resume reads
HOST_DIR = "host"                    # save_pretrained(..., host_weights=True): the host's own save_pretrained
FORMAT = "llm_surgery.inserted"
FORMAT_VERSION = 2   # 2: pdssm's default heads fit the fused op (`FlashPDSSM.default_num_heads`); 1 is read too


def save_inserted(model, directory, full_state_dict: dict | None = None) -> Path:
    """Write the inserted layers of `model` to `directory` (created if needed); returns the directory.

    `full_state_dict`: the whole model's gathered state dict (keys as `model.named_parameters()`), for models whose
    own tensors are shards (FSDP2: `get_model_state_dict(..., full_state_dict=True)`); by default each inserted
    block's own `state_dict()` is read."""
    specs = inserted_specs(model)
    if not specs:
        raise ValueError("this model has no inserted layers to save; call insert_layers first")
    from llm_surgery import __version__

    tensors = {}
    prefix = {id(m): name for name, m in model.named_modules()} if full_state_dict is not None else {}
    for idx, block in inserted_layers(model).items():
        local = block.state_dict()
        if full_state_dict is not None:
            keys = {n: f"{prefix[id(block)]}.{n}" for n in local}
            missing = [k for k in keys.values() if k not in full_state_dict]
            if missing:
                raise ValueError(f"the gathered state dict lacks inserted layer {idx}'s tensors {missing[:3]}")
            local = {n: full_state_dict[k] for n, k in keys.items()}
        for name, t in local.items():
            if t.is_meta:
                raise ValueError(f"inserted layer {idx} is on the meta device; materialise the model before saving")
            tensors[f"layers.{idx}.{name}"] = t.detach().to("cpu").contiguous()
    config = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "llm_surgery_version": __version__,
        "host": _host_record(base_model(model)),
        "layers": [{"kind": s.kind, "attention_position": s.attention_position, "layer_idx": s.layer_idx,
                    "options": s.options} for s in specs],
    }
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    try:
        text = json.dumps(config, indent=2)
    except TypeError as exc:
        raise ValueError(f"layer options must be JSON-serialisable to be saved: {exc}") from exc
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    (directory / CONFIG_FILE).write_text(text + "\n")
    return directory


def _host_record(base) -> dict:
    config = host_config(base)
    return {**host_signature(base), "name_or_path": str(getattr(base.config, "_name_or_path", "") or ""),
            "config_hash": config_hash(config), "config": config}


def read_inserted_config(directory) -> dict:
    """The parsed `inserted.json` of a checkpoint directory, with clear errors naming the file."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"no inserted-layer checkpoint: {path} does not exist")
    try:
        config = json.loads(path.read_text())
        if config.get("format") != FORMAT:
            raise ValueError(f"'format' is {config.get('format')!r}, expected {FORMAT!r}")
        version = config.get("format_version")
        if version not in (1, FORMAT_VERSION):
            raise ValueError(f"format_version {version!r} is not 1 or {FORMAT_VERSION}")
        host = dict(config["host"])
        layers = [LayerSpec(d["kind"], int(d["attention_position"]), int(d["layer_idx"]),
                            _options_as_built(d["kind"], dict(d["options"]), int(host["hidden_size"]), version))
                  for d in config["layers"]]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"corrupt inserted-layer config {path}: {exc}") from exc
    return {**config, "host": host, "layers": layers}


def _options_as_built(kind: str, options: dict, hidden_size: int, version: int) -> dict:
    """A layer's saved options, naming the heads a format-1 pdssm layer was built with where today's default differs:
    format 1 always took `pow2_sqrt` heads, also where those heads were wider than the fused op serves."""
    if version != 1 or kind != "pdssm" or "num_heads" in options or "head_dim" in options:
        return options
    from ..layers.flash_pdssm import default_num_heads, pow2_sqrt

    built = pow2_sqrt(hidden_size)
    if built == default_num_heads(hidden_size, int(options.get("expand", 1)) * hidden_size):
        return options
    return {**options, "num_heads": built}


def load_inserted(model, directory):
    """Insert the layers saved in `directory` into a fresh `model` (same host config) and load their weights
    strictly. Everything is checked before the model is touched; a failure leaves it as it was. Returns the model.
    Checkpoints written before the config hash was recorded are checked by shape only."""
    directory = Path(directory)
    config = read_inserted_config(directory)
    base = base_model(model)
    saved, host = config["host"], host_signature(base)
    diffs = [f"{k}: checkpoint {saved.get(k)!r}, model {host[k]!r}" for k in host if saved.get(k) != host[k]]
    if not diffs and "config_hash" in saved:
        current = host_config(base)
        if saved["config_hash"] != config_hash(current):
            diffs = config_differences(dict(saved.get("config") or {}), current)
    if diffs:
        name = saved.get("name_or_path")
        raise ValueError(f"the inserted layers in {directory} were saved from a different host"
                         + (f" ({name})" if name else "") + ": " + "; ".join(diffs))
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise ValueError(f"no inserted-layer weights: {weights} does not exist")
    try:
        tensors = load_file(str(weights))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise ValueError(f"cannot read inserted-layer weights {weights}: {exc}") from exc
    return _insert(model, config["layers"], prepare=lambda blocks: _load_weights(blocks, tensors, weights))


def _load_weights(blocks: dict[int, torch.nn.Module], tensors: dict[str, torch.Tensor], weights: Path) -> None:
    used = set()
    for idx, block in blocks.items():
        prefix = f"layers.{idx}."
        sub = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        used.update(prefix + k for k in sub)
        upgrade = getattr(block.mixer, "upgrade_state_dict", None)  # a mixer whose parameter names changed
        if upgrade is not None:
            sub = upgrade(sub, "mixer.")
        expected = block.state_dict()
        missing, unexpected = sorted(set(expected) - set(sub)), sorted(set(sub) - set(expected))
        bad_shape = [k for k in set(sub) & set(expected) if sub[k].shape != expected[k].shape]
        if missing or unexpected or bad_shape:
            raise ValueError(f"{weights} does not match inserted layer {idx}: missing {missing}, "
                             f"unexpected {unexpected}, wrong shape {sorted(bad_shape)}")
        block.load_state_dict(sub, strict=True)
    extra = sorted(set(tensors) - used)
    if extra:
        raise ValueError(f"{weights} holds tensors for layers not in {CONFIG_FILE}: {extra[:5]}")


def save_pretrained_inserted(model, save_directory, state_dict: dict | None = None, is_main_process: bool = True,
                             host_weights: bool = False, **host_kwargs) -> None:
    """`model.save_pretrained` of a surgered model. Writes `inserted.safetensors` + `inserted.json`
    (`save_inserted`, what `load_inserted(fresh_host, directory)` reads), and `model.safetensors`: the same
    tensors under the model's parameter names, which `Trainer.train(resume_from_checkpoint=...)` loads
    non-strictly into the surgered model. No `config.json` is written, so `from_pretrained(directory)` fails
    loudly instead of returning the host without its layers. The host's weights only with `host_weights=True`,
    into `directory/host/` by the host class's own `save_pretrained` (given `host_kwargs`): the way back is then
    `load_inserted(AutoModelForCausalLM.from_pretrained(directory / "host"), directory)`.

    `state_dict`: the whole model's state dict (as Trainer passes it under FSDP or DeepSpeed), read instead of the
    modules' own tensors. `is_main_process=False` writes nothing (the other ranks of a launch)."""
    if not is_main_process:
        return
    directory = Path(save_directory)
    if directory.is_file():
        raise ValueError(f"save_pretrained needs a directory, {directory} is a file")
    names = {id(m): name for name, m in model.named_modules()}
    inserted = {}
    for block in inserted_layers(model).values():
        prefix = names[id(block)]
        local = block.state_dict() if state_dict is None else {
            k[len(prefix) + 1:]: v for k, v in state_dict.items() if k.startswith(prefix + ".")}
        inserted.update({f"{prefix}.{k}": v.detach().to("cpu").contiguous() for k, v in local.items()})
    save_inserted(model, directory, full_state_dict=inserted)
    save_file(inserted, str(directory / TRAINER_FILE), metadata={"format": "pt"})
    if host_weights:
        host_state = {k: v for k, v in (state_dict if state_dict is not None else model.state_dict()).items()
                      if k not in inserted}
        type(model).save_pretrained(model, directory / HOST_DIR, state_dict=host_state, **host_kwargs)

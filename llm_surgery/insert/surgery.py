"""Insert new sequence-mixing layers in front of a host's attention blocks, without renumbering anything.

How (see docs/design.md and the transformers-hybrid-internals note): the host's layer loop indexes its config by
position, so nothing is added to `model.layers`. Instead each chosen attention decoder layer gets a child
`pre_ssm` (an `InsertedBlock`) and a forward pre-hook that runs it on the layer's input. Host parameter names are
unchanged; the new ones are `model.layers.{i}.pre_ssm.*` (stable, FSDP-wrappable as whole blocks). The 2-D padding
mask, which attention layers do not receive, is captured by a pre-hook on the decoder stack. During generation
the blocks' (conv, recurrent) state is kept next to the cache object the host passes down (`state.py`); the
cache's own layers are not touched.

The surgery is transactional: every block is built before the model is touched, and any error while attaching
puts back the hooks, attributes and `requires_grad` flags as they were.
"""

from __future__ import annotations

import inspect
import math
import types
from dataclasses import dataclass, field
from functools import partial

import torch
from transformers.cache_utils import Cache

from llm_surgery.host_kernels import keep_cpu_convolutions_in_torch
from llm_surgery.layers.common import check_mask_values

from . import state
from .block import InsertedBlock
from .host import attention_layers, base_model, decoder_layers, dtype_and_device, norm_eps, running_block, unwrap_peft

_ATTR = "_llm_surgery"

# Inserted layers' options over the registry's. Flash PD-SSM dictionaries start as identities (a diagonal SSM that
# learns where to permute): from PD-SSM's random maps they stayed merging maps, which collapse a head's state to one
# entry within a Box example (`insert/probe.py`); on the CPU main job, 3 seeds, test IID exact match 26.9% with the
# random maps and 40.9% with identities (docs/bench/train.md).
INSERTED_DEFAULTS = {"pdssm": {"dict_init": "identity"}}


def _registry():
    """The mixer registry, imported late so that this module imports without the layer packages."""
    from llm_surgery.layers import registry
    return registry


@dataclass
class LayerSpec:
    """One inserted layer: its kind, which attention block it precedes (index into the attention blocks and
    decoder-layer index) and the mixer's constructor options."""
    kind: str
    attention_position: int
    layer_idx: int
    options: dict


@dataclass
class _Surgery:
    specs: list[LayerSpec]
    undo: list = field(default_factory=list)  # what remove_inserted runs, last first (requires_grad stays)
    mask: object = None  # the decoder stack's attention_mask argument during its forward
    generation_mask: object = None  # generate()'s 2-D mask for the next forward (see _prepare_inputs_for_generation)


# ----------------------------------------------------------------------------------------------------- checks
def _default_positions(n: int, n_attention: int) -> list[int]:
    """n attention blocks spread evenly over depth (the centre of each of n equal segments). n = all gives every
    block, as in the paper; fewer stay spread out like the host's own attention layers."""
    return [(2 * j + 1) * n_attention // (2 * n) for j in range(n)]


def _resolve(base, kind, n, positions, layer_options) -> list[LayerSpec]:
    reg = _registry()
    attn = attention_layers(base)
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"n must be an int, got {type(n).__name__}")
    if not 1 <= n <= len(attn):
        raise ValueError(f"n={n}: this host has {len(attn)} attention blocks (decoder layers {attn}); "
                         f"n must be between 1 and {len(attn)}")
    if not isinstance(kind, (str, list, tuple)):
        raise TypeError(f"kind must be a str or a list of str, got {type(kind).__name__}")
    kinds = [kind] * n if isinstance(kind, str) else list(kind)
    if len(kinds) != n:
        raise ValueError(f"got {len(kinds)} kinds for n={n}; pass one kind or a list of exactly n kinds")
    for k in kinds:
        reg.check_kind(k)
    if positions is None:
        positions = _default_positions(n, len(attn))
    else:
        positions = list(positions)
        if len(positions) != n:
            raise ValueError(f"positions has {len(positions)} entries but n={n}; give exactly n positions")
        for p in positions:
            if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < len(attn):
                raise ValueError(f"bad position {p!r}: positions index the {len(attn)} attention blocks "
                                 f"(decoder layers {attn}), so each must be an int in 0..{len(attn) - 1}")
        if len(set(positions)) != n:
            raise ValueError(f"duplicate positions {positions}: each attention block takes at most one layer")
    hidden = int(base.config.hidden_size)
    specs = []
    for k, p in zip(kinds, positions):
        opts = {**reg.default_options(k, hidden), **INSERTED_DEFAULTS.get(k, {}), **layer_options}
        specs.append(LayerSpec(k, p, attn[p], opts))
    return sorted(specs, key=lambda s: s.layer_idx)


def _surgery(model) -> _Surgery | None:
    return getattr(base_model(model), _ATTR, None)


# ------------------------------------------------------------------------------------------------------- hooks
def _recurrent_mask(mask, seq_len: int):
    """The [B, seq_len] padding mask for the inserted mixers (None on one-token decode or without a 2-D mask),
    as transformers' `create_recurrent_attention_mask` gives the host's own Mamba layers."""
    if isinstance(mask, dict):  # generate() with a compilable cache precomputes the masks
        mask = mask.get("linear_attention")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or seq_len == 1:
        return None
    return mask[:, -seq_len:]


def _find_cache(args, kwargs):
    """The cache the host hands its decoder layer, whatever the release calls it (`cache`, `past_key_values`)."""
    return next((v for v in (*args[1:], *kwargs.values()) if isinstance(v, Cache)), None)


def _layer_pre_hook(surgery: _Surgery, layer, args, kwargs):
    block = running_block(layer.pre_ssm)  # under peft's modules_to_save: the active copy
    hidden = args[0] if args else kwargs["hidden_states"]
    mask = _recurrent_mask(surgery.mask, hidden.shape[1])
    cache = _find_cache(args, kwargs)
    if cache is not None and block.gradient_checkpointing and block.training and torch.is_grad_enabled():
        cache = None  # as the host's checkpointed layers do: a recomputed forward must not update a cache twice
    out = block(hidden, attention_mask=mask) if cache is None else state.step(block, hidden, mask, cache)
    if args:
        return (out, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": out}


def _capture_mask(surgery: _Surgery, mask_arg: int, module, args, kwargs):
    mask = kwargs["attention_mask"] if "attention_mask" in kwargs else (args[mask_arg] if len(args) > mask_arg
                                                                      else None)
    if not (isinstance(mask, torch.Tensor) and mask.dim() == 2) and not (
            isinstance(mask, dict) and "linear_attention" in mask) and surgery.generation_mask is not None:
        mask = surgery.generation_mask  # the host got only its attention masks (generate() with a StaticCache)
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.dtype != torch.bool:
        # Checked once per model forward and handed on as bool: each inserted mixer would otherwise check the
        # same values again, one host sync per layer.
        check_mask_values(mask, "attention_mask")
        mask = mask.bool()
    surgery.mask = mask


def _release_mask(surgery: _Surgery, module, args, kwargs, output):
    surgery.mask = surgery.generation_mask = None


def _prepare_inputs_for_generation(surgery: _Surgery, model, *args, **kwargs):
    """generate() turns its 2-D padding mask into the host's attention masks when the cache is compilable
    (`StaticCache`); hybrid hosts' masks keep a 2-D "linear_attention" entry, dense hosts' do not. Keep the 2-D
    mask for the next forward's inserted layers (`_recurrent_mask` trims it to the tokens that forward sees)."""
    mask = kwargs.get("attention_mask")
    surgery.generation_mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
    return type(model).prepare_inputs_for_generation(model, *args, **kwargs)


# ------------------------------------------------------------------------------------------------------ surgery
def _build_block(spec: LayerSpec, hidden: int, eps: float, dtype, device) -> InsertedBlock:
    with torch.device(device):
        mixer = _registry().build_mixer(spec.kind, hidden, **spec.options)
        block = InsertedBlock(spec.kind, hidden, spec.layer_idx, mixer, eps)
    # Real floating tensors take the host dtype; complex ones (PD-SSM) keep theirs.
    block._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)
    if getattr(mixer, "out_proj", None) is None:
        raise TypeError(f"{type(mixer).__name__} has no out_proj; every mixer kind must have one")
    with torch.no_grad():  # zero output projection: the host's function is unchanged at insertion
        mixer.out_proj.weight.zero_()
        if getattr(mixer.out_proj, "bias", None) is not None:
            mixer.out_proj.bias.zero_()
    return block


def _check_specs(base, specs: list[LayerSpec]) -> None:
    """Every spec names an attention block of this host, consistently, at most once (load_inserted reads them
    from a file)."""
    attn = attention_layers(base)
    seen, n_layers = set(), len(decoder_layers(base))
    for s in specs:
        idx, pos = s.layer_idx, s.attention_position
        if not (isinstance(idx, int) and 0 <= idx < n_layers):
            raise ValueError(f"layer_idx {idx!r} is out of range: this host has {n_layers} decoder layers")
        if idx in seen:
            raise ValueError(f"layer_idx {idx} appears twice; each attention block takes at most one layer")
        seen.add(idx)
        if idx not in attn or not (isinstance(pos, int) and 0 <= pos < len(attn)) or attn[pos] != idx:
            raise ValueError(f"layer_idx {idx} with attention_position {pos!r} does not name an attention block "
                             f"of this host (attention blocks at decoder layers {attn})")


def _save_pretrained(model, *args, **kwargs):
    """A surgered model's save_pretrained: the inserted layers, never a directory that from_pretrained would load
    without them (checkpoint.save_pretrained_inserted)."""
    from .checkpoint import save_pretrained_inserted  # checkpoint imports this module

    return save_pretrained_inserted(model, *args, **kwargs)


def _set(undo: list, obj, name: str, value) -> None:
    """Set a plain attribute, remembering how to put back what was there (an instance value or nothing)."""
    old = obj.__dict__.get(name, _MISSING)
    obj.__dict__[name] = value
    undo.append(partial(_put_back, obj, name, old))


def _put_back(obj, name: str, old) -> None:
    if old is _MISSING:
        obj.__dict__.pop(name, None)
    else:
        obj.__dict__[name] = old


_MISSING = object()


def _insert(model, specs: list[LayerSpec], prepare=None):
    """Build every block (and `prepare({layer_idx: block})` them, e.g. load weights), then attach them all; an
    error at any point leaves the model as it was."""
    if unwrap_peft(model) is not model:
        raise ValueError("insert the layers before peft's get_peft_model: the surgery freezes every parameter there, "
                         "adapters included (to train the layers beside LoRA: LoraConfig(modules_to_save=['pre_ssm']))")
    base = base_model(model)
    existing = getattr(base, _ATTR, None)
    if existing is not None:
        raise ValueError(f"this model already has {len(existing.specs)} inserted layers (before decoder layers "
                         f"{[s.layer_idx for s in existing.specs]}); insert into a fresh host, or call "
                         "remove_inserted(model) first")
    _check_specs(base, specs)
    layers = decoder_layers(base)
    taken = [s.layer_idx for s in specs if hasattr(layers[s.layer_idx], "pre_ssm")]
    if taken:
        raise ValueError(f"decoder layers {taken} already have a 'pre_ssm' attribute; insert into a fresh host")
    keep_cpu_convolutions_in_torch()  # a host on the CPU must run where causal-conv1d (CUDA only) is installed
    hidden, eps = int(base.config.hidden_size), norm_eps(base)
    blocks = [_build_block(s, hidden, eps, *dtype_and_device(layers[s.layer_idx])) for s in specs]
    if prepare is not None:
        prepare({s.layer_idx: b for s, b in zip(specs, blocks)})
    mask_arg = list(inspect.signature(base.forward).parameters).index("attention_mask")

    surgery = _Surgery(specs)
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        for spec, block in zip(specs, blocks):
            layer = layers[spec.layer_idx]
            if getattr(layer, "gradient_checkpointing", False):  # checkpointing was enabled before the surgery
                block.gradient_checkpointing = True
                block._gradient_checkpointing_func = layer._gradient_checkpointing_func
            block.train(layer.training)
            layer.pre_ssm = block
            surgery.undo.append(partial(delattr, layer, "pre_ssm"))
            handle = layer.register_forward_pre_hook(partial(_layer_pre_hook, surgery), with_kwargs=True)
            surgery.undo.append(handle.remove)
        handle = base.register_forward_pre_hook(partial(_capture_mask, surgery, mask_arg), with_kwargs=True)
        surgery.undo.append(handle.remove)
        handle = base.register_forward_hook(partial(_release_mask, surgery), with_kwargs=True, always_call=True)
        surgery.undo.append(handle.remove)
        for m in {model, base}:
            names = list(getattr(m, "_no_split_modules", None) or [])
            if InsertedBlock.__name__ not in names:  # FSDP auto-wrap / device_map treat each block as one unit
                _set(surgery.undo, m, "_no_split_modules", names + [InsertedBlock.__name__])
            _set(surgery.undo, m, "save_pretrained", types.MethodType(_save_pretrained, m))
        if callable(getattr(type(model), "prepare_inputs_for_generation", None)):
            _set(surgery.undo, model, "prepare_inputs_for_generation",
                 types.MethodType(partial(_prepare_inputs_for_generation, surgery), model))
        _set(surgery.undo, base, _ATTR, surgery)
    except BaseException:
        for fn in reversed(surgery.undo):
            fn()
        for p, flag in flags:
            p.requires_grad_(flag)
        raise
    return model


def insert_layers(model, kind, n: int, positions=None, **layer_options):
    """Insert one new layer directly before each of `n` attention blocks of a frozen host (any family of
    `host.FAMILIES`, or shaped like them: docs/hosts.md).

    kind: "pdssm", "mamba2" or "deltanet", or a list of n kinds (paired with `positions` in order).
    positions: indices into the host's attention blocks (0 = first attention block). Default: n blocks spread
        evenly over depth; n = number of attention blocks gives one layer before every attention block (the paper).
    layer_options: mixer constructor options, on top of `default_options(kind, hidden_size)` and
        `INSERTED_DEFAULTS` (pdssm dictionaries start as identities); with mixed kinds
        they go to every kind.
    The whole host is frozen; only the inserted layers train. Each is `x + mixer(RMSNorm(x))` with `out_proj` at
    zero, so the model computes exactly what the host did. Returns the same model, modified in place.
    """
    specs = _resolve(base_model(model), kind, n, positions, layer_options)
    return _insert(model, specs)


def plan_insertion(model, kind, n: int, positions=None, **layer_options) -> list[LayerSpec]:
    """What `insert_layers` with these arguments would insert, or its error (architecture, kinds, n, positions),
    without touching the model or building a layer: it needs only the host's configuration, so a model on the
    meta device will do (the trainer checks a run's settings so before it loads any weights)."""
    return _resolve(base_model(model), kind, n, positions, layer_options)


def remove_inserted(model):
    """Undo the surgery (hooks, blocks and attributes removed; the host stays frozen). Returns the model."""
    base = base_model(model)
    surgery = getattr(base, _ATTR, None)
    if surgery is None:
        raise ValueError("this model has no inserted layers")
    for fn in reversed(surgery.undo):
        fn()
    return model


def inserted_specs(model) -> list[LayerSpec]:
    surgery = _surgery(model)
    return [] if surgery is None else list(surgery.specs)


def inserted_layers(model) -> dict[int, InsertedBlock]:
    """{decoder layer index: inserted block} (empty if nothing was inserted); under peft's `modules_to_save` the
    copy that runs and trains (`host.running_block`)."""
    layers = decoder_layers(base_model(model))
    return {s.layer_idx: running_block(layers[s.layer_idx].pre_ssm) for s in inserted_specs(model)}


def set_tau(model, tau: float) -> int:
    """Set the straight-through softmax temperature of every inserted PD-SSM mixer; returns how many were set."""
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) or tau <= 0:
        raise ValueError(f"tau must be a positive finite number, got {tau!r}")
    count = 0
    for block in inserted_layers(model).values():
        if block.kind == "pdssm":
            if not hasattr(block.mixer, "tau"):
                raise TypeError(f"{type(block.mixer).__name__} has no tau attribute")
            block.mixer.tau = float(tau)
            count += 1
    return count


def count_parameters(model) -> tuple[int, int]:
    """(parameters in inserted layers, all parameters of the model), shared tensors counted once."""
    inserted = sum(p.numel() for b in inserted_layers(model).values() for p in b.parameters())
    return inserted, sum(p.numel() for p in model.parameters())

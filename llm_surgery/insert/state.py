"""The inserted layers' generation state, kept by the project next to the host's transformers `Cache`.

Why not inside the cache: the cache's linear-attention layer API (conv/recurrent accessors, layer classes,
`crop`'s meaning) changes between transformers releases, and the cache layer at an attention index holds keys
and values. So each cache object the host passes down gets one `InsertedState` attribute holding
{decoder layer index: {tokens seen: (conv_state, recurrent_state)}}, and the cache methods that change the batch
or the length (`reset`, `reorder_cache`, `crop`, `batch_repeat_interleave`, `batch_select_indices`) are wrapped on
that cache instance, once, so the state follows them. Only public `Cache` methods are used; the wrappers are
bound methods, so a `copy.deepcopy` of the cache carries a state that follows the copy.
"""

from __future__ import annotations

import types

import torch

_ATTR = "_llm_surgery_state"


class InsertedState:
    """The inserted layers' (conv, recurrent) states for one cache, each under the number of tokens it has seen.

    Only the newest state of a layer is kept unless `keep_history` (see `keep_state_history`): then the state at
    the end of every forward is kept too, so `crop` can go back to it exactly."""

    def __init__(self, keep_history: bool = False):
        self.keep_history = keep_history
        self.layers: dict[int, dict[int, tuple[torch.Tensor, ...]]] = {}

    def latest(self, layer_idx: int) -> tuple[int, tuple | None]:
        """(tokens seen, state) of a layer; (0, None) before its first forward with this cache."""
        steps = self.layers.get(layer_idx)
        if not steps:
            return 0, None
        seen = next(reversed(steps))
        return seen, steps[seen]

    def put(self, layer_idx: int, seen: int, state: tuple) -> None:
        steps = self.layers.setdefault(layer_idx, {})
        if not self.keep_history:
            steps.clear()
        steps[seen] = tuple(state)

    def clear(self) -> None:
        self.layers.clear()

    def map(self, fn) -> None:
        """Apply a batch operation to every kept tensor (all have the batch first)."""
        for steps in self.layers.values():
            for seen, state in steps.items():
                steps[seen] = tuple(fn(t) for t in state)

    def crop_to(self, length: int) -> None:
        """Go back to the state after `length` tokens: exact (the start state, or a kept state) or a ValueError."""
        for idx, steps in self.layers.items():
            seen = next(reversed(steps))
            if 0 < length < seen and length not in steps:
                kept = sorted(steps)
                raise ValueError(
                    f"the cache was cropped to {length} tokens, but inserted layer {idx} keeps its recurrent state "
                    f"only after {kept} tokens and cannot go back to {length}; call "
                    "llm_surgery.insert.keep_state_history(cache) before the first forward to crop to the end of any "
                    "earlier forward, or crop to 0 / reset() the cache")
        for idx in list(self.layers):
            steps = self.layers[idx]
            for seen in [s for s in steps if s > length]:
                del steps[seen]
            if not steps:
                del self.layers[idx]


def _followed(cache) -> InsertedState:
    return cache.__dict__[_ATTR]


def _reset(cache, *args, **kwargs):
    out = type(cache).reset(cache, *args, **kwargs)
    _followed(cache).clear()
    return out


def _reorder_cache(cache, beam_idx, *args, **kwargs):
    out = type(cache).reorder_cache(cache, beam_idx, *args, **kwargs)
    _followed(cache).map(lambda t: t.index_select(0, beam_idx.to(t.device)))
    return out


def _batch_repeat_interleave(cache, repeats, *args, **kwargs):
    out = type(cache).batch_repeat_interleave(cache, repeats, *args, **kwargs)
    _followed(cache).map(lambda t: t.repeat_interleave(repeats, dim=0))
    return out


def _batch_select_indices(cache, indices, *args, **kwargs):
    out = type(cache).batch_select_indices(cache, indices, *args, **kwargs)
    _followed(cache).map(lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor) else indices])
    return out


def _crop(cache, *args, **kwargs):
    # The argument's meaning differs between releases (a max length or a count to remove); the length the cache
    # holds afterwards does not.
    out = type(cache).crop(cache, *args, **kwargs)
    _followed(cache).crop_to(int(cache.get_seq_length()))
    return out


_WRAPPERS = {"reset": _reset, "reorder_cache": _reorder_cache, "crop": _crop,
             "batch_repeat_interleave": _batch_repeat_interleave, "batch_select_indices": _batch_select_indices}


def cache_state(cache) -> InsertedState:
    """The inserted layers' state attached to `cache`, attached (and the cache's methods wrapped) on first use."""
    state = cache.__dict__.get(_ATTR)
    if state is None:
        state = cache.__dict__[_ATTR] = InsertedState()
        for name, fn in _WRAPPERS.items():
            if callable(getattr(type(cache), name, None)):
                setattr(cache, name, types.MethodType(fn, cache))
    return state


def keep_state_history(cache):
    """Keep the inserted layers' state at the end of every forward with `cache`, so that `cache.crop(...)` back to
    any of those lengths restores it exactly (without this, a crop that removes tokens raises). Costs one state
    per layer per forward; returns the cache."""
    cache_state(cache).keep_history = True
    return cache


def cached_tokens(cache, layer_idx: int) -> int:
    """Tokens the cache holds at the attention layer `layer_idx` (before that layer's update in this forward)."""
    return int(cache.get_seq_length(layer_idx))


def step(block, hidden: torch.Tensor, mask, cache) -> torch.Tensor:
    """Run `block` on `hidden` continuing its state in `cache`: prefill when it has none for this cache, else
    continue from it; refuses a cache whose attention length and the block's state disagree.

    Unless the history is kept, no one else holds the layer's state, so the mixer may update its tensors in place
    (`inplace`: no state copy per decoded token). A call that fails may have left them half-updated: the layer's
    state is then dropped, and the cache refused until reset(), instead of continuing from it."""
    state = cache_state(cache)
    seen, previous = state.latest(block.layer_idx)
    held = cached_tokens(cache, block.layer_idx)
    if held != seen:
        if previous is None:
            raise ValueError(f"the cache already holds {held} tokens that inserted layer {block.layer_idx} did not "
                             "see (filled before the surgery, by another model, or by a forward that failed); start "
                             "from an empty cache or reset() it")
        raise ValueError(f"the cache holds {held} tokens but inserted layer {block.layer_idx}'s state covers "
                         f"{seen}: the cache was changed in a way the inserted layers cannot follow; reset() it")
    inplace = not state.keep_history
    try:
        out, new = block(hidden, attention_mask=mask, state=previous, return_state=True, inplace=inplace)
    except BaseException:
        if inplace:
            state.layers.pop(block.layer_idx, None)
        raise
    state.put(block.layer_idx, seen + hidden.shape[1], new)
    return out

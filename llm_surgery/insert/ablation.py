"""What do the inserted layers add? Two evaluations against the normal one tell:

`host_alone(model)`: the inserted layers' output projections at zero, as at insertion, so the model computes exactly
what the host does; the trainer evaluates the host alone so at the end of a run, not before its first step.

`tokens_alone(model)`: every inserted mixer sees each token as a sequence of its own (no recurrent state, no
convolution over earlier tokens) while the host runs unchanged, so an evaluation inside it measures what the layers
add as per-token transforms; the gap to the normal evaluation is what their memory adds."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .surgery import inserted_layers

# one-token sequences per mixer call: mamba-ssm's scan puts the batch in a CUDA grid dimension (at most 65,535), and
# a test batch of 64 long Box examples makes ~60,000 (an illegal memory access on an H100)
MAX_SEQUENCES = 8192


@contextmanager
def host_alone(model):
    """Within the block the inserted layers add exactly nothing (each `out_proj` zeroed in place, as
    `insert_layers` leaves it); the trained weights are restored on exit, also after an error. In place, so
    sharded (FSDP) parameters and captured CUDA graphs see the same storage."""
    blocks = list(inserted_layers(model).values())
    if not blocks:
        raise ValueError("host_alone: the model has no inserted layers")
    params = [p for b in blocks for p in (b.mixer.out_proj.weight, getattr(b.mixer.out_proj, "bias", None))
              if p is not None]
    with torch.no_grad():
        saved = [p.detach().clone() for p in params]
        for p in params:
            p.zero_()
    try:
        yield model
    finally:
        with torch.no_grad():
            for p, kept in zip(params, saved):
                p.copy_(kept)


@contextmanager
def tokens_alone(model):
    """Within the block, each inserted mixer maps [b, L, d] through b*L one-token sequences. Refuses to wrap a
    model without inserted layers; the mixers' forwards are restored on exit, also after an error."""
    blocks = list(inserted_layers(model).values())
    if not blocks:
        raise ValueError("tokens_alone: the model has no inserted layers")
    originals = [(b.mixer, b.mixer.forward) for b in blocks]

    def alone(forward):
        def run(hidden_states: torch.Tensor, attention_mask=None, state=None, return_state: bool = False,
                inplace: bool = False):
            if state is not None or return_state:
                raise ValueError("tokens_alone: the mixers keep no state; run the model with use_cache=False")
            b, L, d = hidden_states.shape
            tokens = hidden_states.reshape(b * L, 1, d)
            return torch.cat([forward(part) for part in tokens.split(MAX_SEQUENCES)]).reshape(b, L, -1)
        return run

    for mixer, forward in originals:
        mixer.forward = alone(forward)
    try:
        yield model
    finally:
        for mixer, _ in originals:
            del mixer.forward  # back to the class's method

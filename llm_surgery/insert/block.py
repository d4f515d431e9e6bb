"""The inserted layer: a pre-norm residual block `x + mixer(RMSNorm(x))`. It knows nothing of caches: the surgery
hands it its (conv, recurrent) state and keeps the new one (`state.py`)."""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from llm_surgery.layers.common import RMSNorm


class InsertedBlock(GradientCheckpointingLayer):
    """`x + mixer(norm(x))`, run by a forward pre-hook of the attention decoder layer at `layer_idx`.

    A `GradientCheckpointingLayer`, so `model.gradient_checkpointing_enable()` checkpoints it on its own (the
    pre-hook runs outside the host layer's checkpoint). `state` / `return_state` / `inplace` are the mixer's: during
    generation the surgery passes the state it keeps for the cache and stores the one returned.
    """

    def __init__(self, kind: str, hidden_size: int, layer_idx: int, mixer: nn.Module, eps: float = 1e-5):
        super().__init__()
        self.kind = kind
        self.layer_idx = layer_idx
        self.norm = RMSNorm(hidden_size, eps)
        self.mixer = mixer

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, state=None,
                return_state: bool = False, inplace: bool = False):
        x = self.norm(hidden_states)
        if not return_state:
            return hidden_states + self.mixer(x, attention_mask=attention_mask, state=state).to(hidden_states.dtype)
        y, new_state = self.mixer(x, attention_mask=attention_mask, state=state, return_state=True, inplace=inplace)
        return hidden_states + y.to(hidden_states.dtype), new_state

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}, layer_idx={self.layer_idx}"

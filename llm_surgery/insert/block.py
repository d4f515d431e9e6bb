"""The inserted layer: a pre-norm residual block `x + mixer(RMSNorm(x))` that keeps its state in the host's
hybrid cache at the index of the attention layer it sits in front of."""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 (as the hosts' own norms are), cast back to the input dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class InsertedBlock(GradientCheckpointingLayer):
    """`x + mixer(norm(x))`, run by a forward pre-hook of the attention decoder layer at `layer_idx`.

    A `GradientCheckpointingLayer`, so `model.gradient_checkpointing_enable()` checkpoints it on its own (the
    pre-hook runs outside the host layer's checkpoint). With a cache, the mixer's (conv, recurrent) state lives
    in `past_key_values.layers[layer_idx]`, which the surgery turns into a linear+full attention cache layer.
    """

    def __init__(self, kind: str, hidden_size: int, layer_idx: int, mixer: nn.Module, eps: float = 1e-5):
        super().__init__()
        self.kind = kind
        self.layer_idx = layer_idx
        self.norm = RMSNorm(hidden_size, eps)
        self.mixer = mixer

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values=None) -> torch.Tensor:
        x = self.norm(hidden_states)
        if past_key_values is None:
            y = self.mixer(x, attention_mask=attention_mask)
        else:
            conv = past_key_values.get_conv_state(self.layer_idx)
            rec = past_key_values.get_recurrent_state(self.layer_idx)
            state = None if conv is None or rec is None else (conv, rec)
            y, (conv, rec) = self.mixer(x, attention_mask=attention_mask, state=state, return_state=True)
            # The cache keeps the last `conv_kernel_size` columns; the mixer's conv state is exactly that window.
            past_key_values.update_conv_state(conv, self.layer_idx, conv_kernel_size=conv.shape[-1])
            past_key_values.update_recurrent_state(rec, self.layer_idx)
        return hidden_states + y.to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}, layer_idx={self.layer_idx}"

"""A small sequence classifier for synthetic state tracking: embedding, n pre-norm residual mixer blocks
(+ MLP), final norm, a linear head reading the last position. The mixer kind is any of build_mixer's; the norm
and the mixers are the library's own."""

from __future__ import annotations

import torch
from torch import nn

from ...layers import FlashPDSSM
from ...layers.common import RMSNorm
from ...layers.registry import build_mixer


class Block(nn.Module):
    def __init__(self, mixer: nn.Module, d_model: int, mlp: bool):
        super().__init__()
        self.norm = RMSNorm(d_model)
        self.mixer = mixer
        self.mlp = nn.Sequential(RMSNorm(d_model), nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model)) if mlp else None

    def forward(self, x):
        x = x + self.mixer(self.norm(x))
        return x + self.mlp(x) if self.mlp is not None else x


class StateTracker(nn.Module):
    """Predicts a class (the automaton's final state) from a token sequence."""

    def __init__(self, vocab_size: int, num_classes: int, d_model: int = 128, n_layers: int = 2,
                 kind: str = "pdssm", mlp: bool = False, **mixer_options):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(Block(build_mixer(kind, d_model, **mixer_options), d_model, mlp)
                                    for _ in range(n_layers))
        self.norm = RMSNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, -1]))

    def set_tau(self, tau: float) -> None:
        """The straight-through temperature of every Flash PD-SSM mixer (the layer's own setter checks it)."""
        for m in self.modules():
            if isinstance(m, FlashPDSSM):
                m.tau = tau

"""MAD's two backbones with this library's mixers: a language model (every task but compress) and an autoencoder
(compress), built as MAD's benchmark builds them: width 128, the layers "mixer, SwiGLU, mixer, SwiGLU", each a
pre-norm residual block (x + layer(RMSNorm(x))), no position embeddings, a final RMSNorm and a linear read-out.

Kinds: "pdssm", "mamba2", "deltanet" (the library's mixers with `build_mixer`'s parameter-matched defaults, as
the surgery inserts them; pdssm is complex-valued there, the paper ran MAD with the real-valued layer and reports
little difference) and "attention", softmax attention as the reference (MAD's mh-attention: 16 heads, rotary
embeddings on the whole head, biased projections).
MAD's init (embeddings N(0, 0.02), biases 0; the autoencoder's linear weights N(0, 0.02)) is applied to the
embedding, read-out and decoder; every mixer keeps its own init.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ...layers.common import RMSNorm
from ...layers.registry import MIXER_KINDS, build_mixer

KINDS = ("attention", *MIXER_KINDS)


def check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; choose from {', '.join(KINDS)}")


class SwiGLU(nn.Module):
    """MAD's SwiGLU channel mixer: inner width 2 * 4/3 * d rounded up to a multiple of 16, no biases."""

    def __init__(self, d_model: int):
        super().__init__()
        inner = 16 * math.ceil(int(8 * d_model / 3) / 16)
        self.gate = nn.Linear(d_model, inner, bias=False)
        self.up = nn.Linear(d_model, inner, bias=False)
        self.down = nn.Linear(inner, d_model, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


def rotary(x: torch.Tensor, base: float = 10_000.0) -> torch.Tensor:
    """Rotary position embedding over the whole last dim of x (batch, heads, length, head_dim), halves rotated."""
    half = x.shape[-1] // 2
    freqs = base ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = torch.arange(x.shape[-2], device=x.device, dtype=torch.float32)[:, None] * freqs
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class CausalAttention(nn.Module):
    """Multi-head causal softmax attention (torch's SDPA) with rotary embeddings: the reference kind."""

    def __init__(self, d_model: int, head_dim: int = 8):
        super().__init__()
        if d_model % head_dim or head_dim % 2:
            raise ValueError(f"attention: width {d_model} must split into heads of {head_dim} (an even size)")
        self.num_heads = d_model // head_dim
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(rotary(q), rotary(k), v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(b, n, d))


def sequence_mixer(kind: str, d_model: int) -> nn.Module:
    check_kind(kind)
    if kind == "attention":
        return CausalAttention(d_model)
    return build_mixer(kind, d_model)


class PreNorm(nn.Module):
    """One of MAD's blocks: x + layer(RMSNorm(x))."""

    def __init__(self, layer: nn.Module, d_model: int):
        super().__init__()
        self.norm, self.layer = RMSNorm(d_model), layer

    def forward(self, x):
        return x + self.layer(self.norm(x))


def sincos(length: int, dim: int) -> torch.Tensor:
    """Fixed sine-cosine position embeddings (length, dim): the autoencoder's decoder queries."""
    pos = torch.arange(length, dtype=torch.float32)[:, None]
    freqs = 10_000.0 ** (-torch.arange(dim // 2, dtype=torch.float32) / (dim // 2 - 1 or 1))
    return torch.cat([(pos * freqs).sin(), (pos * freqs).cos()], dim=1)


class MADModel(nn.Module):
    """tokens (batch, L) -> logits (batch, L, vocab). `autoencoder`: MAD's compression backbone, which decodes
    every position from the state at the last one through a 2-layer MLP with fixed position embeddings."""

    def __init__(self, kind: str, vocab_size: int, seq_len: int, d_model: int = 128, n_layers: int = 2,
                 autoencoder: bool = False):
        super().__init__()
        self.kind, self.autoencoder = kind, autoencoder
        self.embed = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList()
        for _ in range(n_layers):
            self.blocks.append(PreNorm(sequence_mixer(kind, d_model), d_model))
            self.blocks.append(PreNorm(SwiGLU(d_model), d_model))
        if autoencoder:
            self.register_buffer("positions", sincos(seq_len, d_model), persistent=False)
            self.decoder = nn.Sequential(RMSNorm(d_model), nn.Linear(d_model, d_model), nn.GELU(),
                                         RMSNorm(d_model), nn.Linear(d_model, d_model), nn.GELU())
        self.head = nn.Sequential(RMSNorm(d_model), nn.Linear(d_model, vocab_size))
        nn.init.normal_(self.embed.weight, std=0.02)
        for m in [*self.head.modules(), *(self.decoder.modules() if autoencoder else ())]:
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)
                if autoencoder:
                    nn.init.normal_(m.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        if self.autoencoder:
            x = self.decoder(x[:, -1:] + self.positions[: tokens.shape[1]])
        return self.head(x)

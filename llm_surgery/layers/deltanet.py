"""DeltaNet sequence mixer (delta rule with a learned write strength beta) with the parameter names and layout of
fla's `fla.layers.DeltaNet` (use_beta, use_gate, short convs with SiLU, L2-normalised q/k), so their state dicts
load into each other.

On CUDA (when `fla` imports) fla's own `DeltaNet` layer runs on this module's parameters; a call that continues
or returns a state (prefill and one-token decode in generation) runs fla's pieces: its short convolutions with
their cache (one token: causal-conv1d's in-place update, where it imports, on the mixer's own conv state) and its
delta-rule kernels (fused-recurrent up to 64 tokens, chunked beyond). Anywhere else an exact chunked (WY-form)
torch scan computes the same function. The final projection is `o_proj` (fla's name); `out_proj` (the mixer
contract) is an alias.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .common import (apply_padding_mask, causal_conv1d, check_attention_mask, check_hidden_states, conv_update,
                     library_layer)

BACKENDS = ("auto", "torch", "kernel")
_KERNELS: dict[str, object] = {}
FUSED_RECURRENT_MAX_LEN = 64  # fla itself uses the recurrent kernel up to this length


def fla_kernels():
    """(chunk_delta_rule, fused_recurrent_delta_rule, fla.layers.DeltaNet) from fla, or None; cached. Only
    called for CUDA tensors: fla's kernels are Triton-only and have no CPU path."""
    if "fla" not in _KERNELS:
        try:
            from fla.layers.delta_net import DeltaNet
            from fla.ops.delta_rule import chunk_delta_rule, fused_recurrent_delta_rule
            _KERNELS["fla"] = (chunk_delta_rule, fused_recurrent_delta_rule, DeltaNet)
        except Exception as exc:  # noqa: BLE001 - any failure means "no kernels"
            if not isinstance(exc, ImportError):
                warnings.warn(f"fla delta-rule kernels unavailable ({exc!r}); using the torch scan")
            _KERNELS["fla"] = None
    return _KERNELS["fla"]


def delta_rule_torch(q, k, v, beta, S0=None, chunk_size=64):
    """Exact chunked delta rule in plain torch (WY form), differentiable.

    q, k [b, l, h, dk] (q already scaled), v [b, l, h, dv], beta [b, l, h], S0 [b, h, dk, dv].
    Per step: S_t = S_{t-1} + k_t (beta_t (v_t - S_{t-1}^T k_t))^T, o_t = S_t^T q_t.
    Inside a chunk the pseudo-values U solve (I + tril(beta k k^T, -1)) U = beta v - beta k S0.
    Returns (o [b, l, h, dv], S_L).
    """
    b, L, H, dk = k.shape
    q, k, v, beta = (t.transpose(1, 2) for t in (q, k, v, beta))  # [b, h, l, ...]
    S = q.new_zeros(b, H, dk, v.shape[-1]) if S0 is None else S0.to(q.dtype)
    outs = []
    for s in range(0, L, chunk_size):
        qc, kc, vc, bc = (t[:, :, s:s + chunk_size] for t in (q, k, v, beta))
        T = kc.shape[2]
        kb = kc * bc[..., None]
        system = torch.eye(T, dtype=q.dtype, device=q.device) + (kb @ kc.transpose(-1, -2)).tril(-1)
        rhs = vc * bc[..., None] - kb @ S
        U = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        outs.append(qc @ S + (qc @ kc.transpose(-1, -2)).tril() @ U)
        S = S + kc.transpose(-1, -2) @ U
    return torch.cat(outs, dim=2).transpose(1, 2), S


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (fla's convention)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


class NormThenGate(nn.Module):
    """RMSNorm(x) * weight * silu(g), per head: fla's FusedRMSNormGated (the gate after the norm)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        ct = torch.promote_types(x.dtype, torch.float32)  # float32, or float64 for float64 layers
        xf = x.to(ct)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.to(ct)
        return (xf * F.silu(g.to(ct))).to(x.dtype)


class DeltaNetMixer(nn.Module):
    """DeltaNet block: q/k/v projections -> short causal convs + SiLU -> L2-normalised q/k,
    beta = sigmoid(b_proj) -> delta-rule scan -> per-head RMSNorm gated by silu(g_proj) -> o_proj.

    `head_dim` sets the key and value head width (`value_head_dim` overrides the value side).
    `backend`: "auto" (fla on CUDA when importable, torch otherwise), "torch", or "kernel". `inplace=True` lets the
    decode step write the new conv state into the given one (docs/design.md, sequence mixers).
    """

    def __init__(self, hidden_size: int, num_heads: int | None = None, head_dim: int = 64,
                 value_head_dim: int | None = None, conv_kernel: int = 4, conv_bias: bool = False,
                 use_gate: bool = True, allow_neg_eigval: bool = False, norm_eps: float = 1e-5,
                 chunk_size: int = 64, backend: str = "auto"):
        super().__init__()
        if num_heads is None:
            if hidden_size % head_dim:
                raise ValueError(f"hidden_size = {hidden_size} is not a multiple of head_dim = {head_dim}; "
                                 "pass num_heads")
            num_heads = hidden_size // head_dim
        value_head_dim = value_head_dim or head_dim
        if min(hidden_size, num_heads, head_dim, value_head_dim, conv_kernel, chunk_size) < 1:
            raise ValueError("DeltaNetMixer sizes must be positive")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.hidden_size, self.num_heads, self.conv_kernel = hidden_size, num_heads, conv_kernel
        self.head_k_dim, self.head_v_dim = head_dim, value_head_dim
        self.key_dim, self.value_dim = num_heads * head_dim, num_heads * value_head_dim
        self.use_gate, self.allow_neg_eigval = use_gate, allow_neg_eigval
        self.chunk_size, self.backend, self.norm_eps = chunk_size, backend, norm_eps

        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (
            nn.Conv1d(c, c, conv_kernel, groups=c, padding=conv_kernel - 1, bias=conv_bias)
            for c in (self.key_dim, self.key_dim, self.value_dim))
        if use_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
            self.o_norm = NormThenGate(self.head_v_dim, eps=norm_eps)
        else:
            self.o_norm = nn.RMSNorm(self.head_v_dim, eps=norm_eps)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        self._register_load_state_dict_pre_hook(_rename_old_keys)

    @property
    def out_proj(self) -> nn.Linear:
        """The mixer contract's name for the final projection (fla's `o_proj`)."""
        return self.o_proj

    @staticmethod
    def upgrade_state_dict(state_dict: dict, prefix: str = "") -> dict:
        """A copy of `state_dict` with the keys of an older DeltaNetMixer under `prefix` renamed (`out_proj.*` ->
        `o_proj.*`); `load_state_dict` does this itself, this is for code that compares keys first."""
        state_dict = dict(state_dict)
        _rename_old_keys(state_dict, prefix)
        return state_dict

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def _check_state(self, state, batch: int):
        if state is None:
            return None, None
        if not isinstance(state, (tuple, list)) or len(state) != 2:
            raise TypeError("state must be a (conv_state, recurrent_state) tuple from an earlier call")
        want = ((batch, self.conv_channels, self.conv_kernel - 1),
                (batch, self.num_heads, self.head_k_dim, self.head_v_dim))
        for name, t, shape in zip(("conv_state", "recurrent_state"), state, want):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"DeltaNetMixer {name} must have shape {shape}, got {got}")
        return state

    def _use_kernels(self, x: torch.Tensor):
        ok = x.is_cuda and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
        if self.backend == "torch" or (self.backend == "auto" and not ok):
            return None
        kernels = fla_kernels() if ok else None
        if kernels is None and self.backend == "kernel":
            raise RuntimeError("backend='kernel' needs CUDA fp32/fp16/bf16 tensors and an importable fla")
        return kernels

    # -- fla's own layer -------------------------------------------------------------------------------
    def library_options(self) -> dict:
        """`fla.layers.DeltaNet`'s options for this layer's shape (its widths are `expand * hidden_size`)."""
        return dict(mode="chunk", hidden_size=self.hidden_size, expand_k=self.key_dim / self.hidden_size,
                    expand_v=self.value_dim / self.hidden_size, num_heads=self.num_heads, use_beta=True,
                    use_gate=self.use_gate, use_short_conv=True, conv_size=self.conv_kernel,
                    conv_bias=self.q_conv1d.bias is not None, allow_neg_eigval=self.allow_neg_eigval,
                    qk_activation="silu", qk_norm="l2", norm_eps=self.norm_eps)

    def _library(self, layer_cls):
        """fla's `DeltaNet` running on this module's parameters (`common.library_layer`)."""
        def build():
            with torch.device("meta"):
                return layer_cls(**self.library_options())
        return library_layer(self, build)

    def _short_convs(self, layer, x, mask, conv_state, inplace: bool):
        """(q, k, v) after fla's short convolutions (with their SiLU), and the new conv state.

        One token without a mask or autograd, where causal-conv1d imports: its in-place update (the kernel of
        fla's "cuda" conv backend), which takes our conv state as it is, on the q, k and v channels of the given
        state when `inplace`, else of a copy. Otherwise fla's convolutions with their caches, which hold the last
        conv_kernel inputs of each of q, k, v (ours the last conv_kernel - 1, concatenated): each cache gets a zero
        column in front (the oldest, shifted out before use), and the new ones are cut and concatenated."""
        convs, projs = (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d), (layer.q_proj, layer.k_proj, layer.v_proj)
        sizes = [self.key_dim, self.key_dim, self.value_dim]
        update = conv_update()
        if (x.shape[1] == 1 and mask is None and not torch.is_grad_enabled() and update is not None
                and 2 <= self.conv_kernel <= 4):
            state = (x.new_zeros(x.shape[0], self.conv_channels, self.conv_kernel - 1) if conv_state is None
                     else conv_state.to(x.dtype, copy=not inplace))
            x1 = x[:, 0]
            qkv = [update(proj(x1), s, conv.weight[:, 0], conv.bias, conv.activation)[:, None]
                   for proj, conv, s in zip(projs, convs, state.split(sizes, 1))]
            return qkv, state
        mask = None if mask is None else mask.to(x.dtype)  # fla's conv multiplies x by it in place
        caches = ([None] * 3 if conv_state is None
                  else [F.pad(c.to(x.dtype), (1, 0)) for c in conv_state.split(sizes, 1)])
        qkv, new_conv = [], []
        for proj, conv, cache in zip(projs, convs, caches):
            y, final = conv(x=proj(x), mask=mask, cache=cache, output_final_state=True)
            qkv.append(y)
            new_conv.append(final[:, :, 1:])
        return qkv, torch.cat(new_conv, 1)

    def _library_with_state(self, kernels, layer, x, mask, conv_state, S0, inplace: bool):
        """fla's pieces on a call that continues or returns a state (`_short_convs`, then fla's delta-rule
        kernels); padded positions get zero conv input and beta = 0, the identity on the state."""
        chunk, recurrent, _ = kernels
        b, L, _ = x.shape
        H, dk, dv = self.num_heads, self.head_k_dim, self.head_v_dim
        (q, k, v), new_conv = self._short_convs(layer, x, mask, conv_state, inplace)
        q, k, v = q.reshape(b, L, H, dk), k.reshape(b, L, H, dk), v.reshape(b, L, H, dv)
        beta = layer.b_proj(x).sigmoid()
        if self.allow_neg_eigval:
            beta = beta * 2
        if mask is not None:
            beta = beta * mask.to(beta.dtype).unsqueeze(-1)
        h0 = None if S0 is None else S0.float().contiguous()
        if L <= FUSED_RECURRENT_MAX_LEN:  # short prefill and decode: the recurrent kernel, as fla's layer does
            o, S = recurrent(q, k, v, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        else:  # the chunk kernel refuses float32: run it in bfloat16, states stay float32
            kd = torch.bfloat16 if x.dtype == torch.float32 else x.dtype
            o, S = chunk(*(t.to(kd) for t in (q, k, v, beta)), initial_state=h0, output_final_state=True,
                         use_qk_l2norm_in_kernel=True)
        o = o.to(x.dtype)
        o = layer.o_norm(o, layer.g_proj(x).reshape(b, L, H, dv)) if self.use_gate else layer.o_norm(o)
        return layer.o_proj(o.reshape(b, L, self.value_dim)), (new_conv, S.float())

    # -- forward ---------------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                state=None, return_state: bool = False, inplace: bool = False):
        check_hidden_states(hidden_states, self.hidden_size, "DeltaNetMixer")
        check_attention_mask(attention_mask, hidden_states, "DeltaNetMixer")
        in_dtype, dtype = hidden_states.dtype, self.o_proj.weight.dtype
        x = hidden_states.to(dtype)
        b, L, _ = x.shape
        conv_state, S0 = self._check_state(state, b)

        kernels = self._use_kernels(x)
        if kernels is not None:
            layer = self._library(kernels[2])
            if state is None and not return_state and dtype != torch.float32:
                # fla's layer (its chunk kernel refuses float32); it unpads a padding mask itself
                return layer(x, attention_mask=attention_mask)[0].to(in_dtype)
            out, new_state = self._library_with_state(kernels, layer, x, attention_mask, conv_state, S0, inplace)
            return (out.to(in_dtype), new_state) if return_state else out.to(in_dtype)

        H, dk, dv = self.num_heads, self.head_k_dim, self.head_v_dim
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        qkv = apply_padding_mask(qkv, attention_mask)
        weight = torch.cat([c.weight[:, 0] for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)])
        bias = (torch.cat([c.bias for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)])
                if self.q_conv1d.bias is not None else None)
        qkv, new_conv_state = causal_conv1d(qkv, weight, bias, conv_state)
        q, k, v = F.silu(qkv).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)

        scan_dtype = torch.promote_types(dtype, torch.float32)
        q = l2_normalize(q.reshape(b, L, H, dk).to(scan_dtype)) * dk ** -0.5
        k = l2_normalize(k.reshape(b, L, H, dk).to(scan_dtype))
        v = v.reshape(b, L, H, dv)
        beta = torch.sigmoid(self.b_proj(x).to(scan_dtype))
        if self.allow_neg_eigval:
            beta = beta * 2
        if attention_mask is not None:  # beta = 0 makes a padding step the identity on the state
            beta = beta * attention_mask.to(scan_dtype).unsqueeze(-1)
        S0 = None if S0 is None else S0.to(scan_dtype)
        o, S = delta_rule_torch(q, k, v.to(scan_dtype), beta, S0, chunk_size=self.chunk_size)
        o = o.to(dtype)
        o = self.o_norm(o, self.g_proj(x).reshape(b, L, H, dv)) if self.use_gate else self.o_norm(o)
        out = self.o_proj(o.reshape(b, L, self.value_dim)).to(in_dtype)
        return (out, (new_conv_state, S)) if return_state else out


def _rename_old_keys(state_dict, prefix, *args) -> None:
    """Checkpoints written before the final projection took fla's name `o_proj` call it `out_proj`."""
    for key in [k for k in state_dict if k.startswith(prefix + "out_proj.")]:
        state_dict[prefix + "o_proj." + key[len(prefix + "out_proj."):]] = state_dict.pop(key)


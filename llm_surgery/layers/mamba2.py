"""Mamba2 (SSD) sequence mixer with mamba-ssm's parameter names and layout.

On CUDA (when `mamba_ssm` imports) the layer runs mamba-ssm's own `Mamba2` module on this module's parameters:
its fused training path (`mamba_split_conv1d_scan_combined`) where causal-conv1d is installed, its conv + Triton
scan otherwise, and its `step` (causal_conv1d_update + selective_state_update) for one-token decoding. Anywhere
else a pure-torch chunked SSD scan computes the same function, so one state dict serves both: a layer trained on
a GPU is checked, decoded and trained on a CPU and back. mamba-ssm is imported lazily, on the first CUDA call.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
import types
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .common import (GatedRMSNorm, apply_padding_mask, causal_conv1d, check_attention_mask, check_hidden_states,
                     conv_update, is_right_padding, library_layer)

BACKENDS = ("auto", "torch", "kernel")
_KERNELS: dict[str, object] = {}


def _import_all(names):
    """Import `names` (mamba-ssm modules) and return them, or None.

    mamba-ssm's package `__init__` imports the compiled Mamba-1 extension (`selective_scan_cuda`), which
    Triton-only installs lack. Then the modules are loaded under a bare `mamba_ssm` package and every module
    added that way is dropped from `sys.modules` again, so that no other library (e.g. transformers' host Mamba
    layers, whose fused training path needs compiled causal_conv1d) starts to see a half-installed mamba-ssm
    because of us.
    """
    before = set(sys.modules)
    try:
        return [importlib.import_module(n) for n in names]
    except Exception:  # noqa: BLE001 - typically ModuleNotFoundError: selective_scan_cuda
        try:
            spec = importlib.util.find_spec("mamba_ssm")
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            return None
        bare = types.ModuleType("mamba_ssm")
        bare.__path__ = list(spec.submodule_search_locations)
        sys.modules["mamba_ssm"] = bare
        try:
            return [importlib.import_module(n) for n in names]
        except Exception as exc:  # noqa: BLE001 - any failure means "not available"
            warnings.warn(f"mamba_ssm unavailable ({exc!r}); using the torch path")
            return None
        finally:  # also drops what the failed full-package import left behind
            for name in set(sys.modules) - before:
                if name == "mamba_ssm" or name.startswith("mamba_ssm."):
                    del sys.modules[name]


def _import_mamba():
    """mamba-ssm's Triton kernels and its `Mamba2` module, imported once (one copy of each kernel, autotuned once):
    {"kernels": (mamba_chunk_scan_combined, selective_state_update), "module": (Mamba2, fused path usable)}, or None.
    The fused training path needs causal-conv1d's compiled functions."""
    mods = _import_all(("mamba_ssm.ops.triton.ssd_combined", "mamba_ssm.ops.triton.selective_state_update",
                        "mamba_ssm.modules.mamba2"))
    if mods is None:
        return None
    fused = getattr(mods[0], "causal_conv1d_fwd_function", None) is not None
    return {"kernels": (mods[0].mamba_chunk_scan_combined, mods[1].selective_state_update),
            "module": (mods[2].Mamba2, fused)}


def _mamba(part: str):
    if "mamba" not in _KERNELS:
        _KERNELS["mamba"] = _import_mamba()
    return None if _KERNELS["mamba"] is None else _KERNELS["mamba"][part]


def mamba_kernels():
    """(mamba_chunk_scan_combined, selective_state_update) from mamba-ssm, or None; cached.
    Call only when CUDA is in use: importing Triton kernels on a CPU-only machine is pointless."""
    return _mamba("kernels")


def mamba_module():
    """(mamba_ssm.modules.mamba2.Mamba2, fused path usable), or None; cached. CUDA only, like `mamba_kernels`."""
    return _mamba("module")


def ssd_scan_torch(x, dt, A, B, C, h0=None, chunk_size=64):
    """Chunked SSD scan in plain torch (exact, differentiable).

    x [b, l, h, p], dt [b, l, h] (after softplus), A [h] (negative), B/C [b, l, g, n], h0 [b, h, p, n].
    Recurrence: h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t. Returns (y [b, l, h, p], h_L).
    """
    b, L, H, P = x.shape
    G, N = B.shape[-2:]
    B = B.repeat_interleave(H // G, dim=2)
    C = C.repeat_interleave(H // G, dim=2)
    h = x.new_zeros(b, H, P, N) if h0 is None else h0.to(x.dtype)
    ys = []
    for s in range(0, L, chunk_size):
        xc, dtc, Bc, Cc = (t[:, s:s + chunk_size] for t in (x, dt, B, C))
        T = xc.shape[1]
        acs = (dtc * A).cumsum(1)  # [b, T, h] log decay from the chunk start
        seg = acs[:, :, None, :] - acs[:, None, :, :]  # [b, t, s, h]
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        decay = seg.masked_fill(~causal[None, :, :, None], float("-inf")).exp()
        scores = torch.einsum("bthn,bshn->btsh", Cc, Bc) * decay * dtc[:, None]
        y = torch.einsum("btsh,bshp->bthp", scores, xc)
        y = y + torch.einsum("bthn,bhpn->bthp", Cc, h) * acs.exp()[..., None]
        w = (acs[:, -1:] - acs).exp() * dtc  # weight of each input in the end-of-chunk state
        h = h * acs[:, -1].exp()[..., None, None] + torch.einsum("bsh,bshn,bshp->bhpn", w, Bc, xc)
        ys.append(y)
    return torch.cat(ys, dim=1), h


class Mamba2Mixer(nn.Module):
    """Mamba2 block: in_proj -> [z, xBC, dt], causal conv + SiLU on xBC, SSD scan, gated RMSNorm, out_proj.

    Parameter names and shapes follow `mamba_ssm.modules.mamba2.Mamba2` (with `d_ssm = d_inner`,
    `rmsnorm=True`, `norm_before_gate=False`), so its state dicts load directly.
    `backend`: "auto" (mamba-ssm on CUDA when importable, torch otherwise), "torch", or "kernel".

    On CUDA, mamba-ssm's `Mamba2` (see `library_options`) runs the forward without state or left padding and the
    one-token decode step; a prefill that continues or returns a state, or has left padding, runs this block on
    mamba-ssm's chunk-scan kernel (the module's own forward takes no start state and no padding mask).
    `inplace=True` lets the decode step write the new state into the given state's tensors, as `Mamba2.step`
    does with its own (docs/design.md, sequence mixers).
    """

    def __init__(self, hidden_size: int, num_heads: int | None = None, head_dim: int = 64,
                 state_size: int = 128, expand: int = 2, n_groups: int = 1, conv_kernel: int = 4,
                 chunk_size: int = 256, A_init_range=(1.0, 16.0), dt_min: float = 0.001, dt_max: float = 0.1,
                 dt_init_floor: float = 1e-4, dt_limit=(0.0, float("inf")), bias: bool = False,
                 conv_bias: bool = True, norm_eps: float = 1e-5, backend: str = "auto"):
        super().__init__()
        if num_heads is None:
            if (expand * hidden_size) % head_dim:
                raise ValueError(f"expand * hidden_size = {expand * hidden_size} is not a multiple of "
                                 f"head_dim = {head_dim}; pass num_heads")
            num_heads = expand * hidden_size // head_dim
        if min(hidden_size, num_heads, head_dim, state_size, n_groups, conv_kernel, chunk_size) < 1:
            raise ValueError("Mamba2Mixer sizes must be positive")
        if num_heads % n_groups:
            raise ValueError(f"num_heads = {num_heads} must be a multiple of n_groups = {n_groups}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, head_dim
        self.state_size, self.n_groups, self.conv_kernel = state_size, n_groups, conv_kernel
        self.chunk_size, self.dt_limit, self.backend = chunk_size, tuple(dt_limit), backend
        self.d_inner = num_heads * head_dim
        self.conv_dim = self.d_inner + 2 * n_groups * state_size

        self.in_proj = nn.Linear(hidden_size, self.d_inner + self.conv_dim + num_heads, bias=bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim,
                                padding=conv_kernel - 1, bias=conv_bias)
        dt = torch.exp(torch.rand(num_heads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp(min=dt_init_floor)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        self.A_log = nn.Parameter(torch.empty(num_heads).uniform_(*A_init_range).log())
        self.D = nn.Parameter(torch.ones(num_heads))
        for p in (self.dt_bias, self.A_log, self.D):
            p._no_weight_decay = True
        self.norm = GatedRMSNorm(self.d_inner, eps=norm_eps, group_size=self.d_inner // n_groups)
        self.out_proj = nn.Linear(self.d_inner, hidden_size, bias=bias)

    # -- state -----------------------------------------------------------------------------------------
    def _check_state(self, state, batch: int):
        if state is None:
            return None, None
        if not isinstance(state, (tuple, list)) or len(state) != 2:
            raise TypeError("state must be a (conv_state, recurrent_state) tuple from an earlier call")
        conv_state, ssm_state = state
        want = ((batch, self.conv_dim, self.conv_kernel - 1),
                (batch, self.num_heads, self.head_dim, self.state_size))
        for name, t, shape in zip(("conv_state", "recurrent_state"), state, want):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"Mamba2Mixer {name} must have shape {shape}, got {got}")
        return conv_state, ssm_state

    def _use_kernels(self, x: torch.Tensor):
        ok = x.is_cuda and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
        if self.backend == "torch" or (self.backend == "auto" and not ok):
            return None
        kernels = mamba_kernels() if ok else None
        if kernels is None and self.backend == "kernel":
            raise RuntimeError("backend='kernel' needs CUDA fp32/fp16/bf16 tensors and an importable mamba_ssm")
        return kernels

    # -- mamba-ssm's own module ------------------------------------------------------------------------
    def library_options(self) -> dict | None:
        """`mamba_ssm.modules.mamba2.Mamba2`'s options for this layer's shape, or None when it cannot hold it
        (mamba-ssm ties the inner width to an integer `expand` times `hidden_size`)."""
        if self.d_inner % self.hidden_size:
            return None
        return dict(d_model=self.hidden_size, d_state=self.state_size, d_conv=self.conv_kernel,
                    expand=self.d_inner // self.hidden_size, headdim=self.head_dim, ngroups=self.n_groups,
                    rmsnorm=True, norm_before_gate=False, dt_limit=self.dt_limit,
                    bias=self.in_proj.bias is not None, conv_bias=self.conv1d.bias is not None,
                    chunk_size=self.chunk_size)

    def _library(self):
        """mamba-ssm's `Mamba2` running on this module's parameters (`common.library_layer`); None where mamba-ssm
        is absent or cannot hold this shape."""
        return library_layer(self, self._build_library)

    def _build_library(self):
        found, options = mamba_module(), self.library_options()
        if found is None:
            return None
        if options is None:
            warnings.warn(f"Mamba2Mixer: num_heads * head_dim = {self.d_inner} is not a multiple of hidden_size = "
                          f"{self.hidden_size}, which mamba-ssm's Mamba2 needs; this layer runs the project's block "
                          "on mamba-ssm's kernels instead")
            return None
        cls, fused = found
        with torch.device("meta"):
            layer = cls(**options, use_mem_eff_path=fused)
        layer.norm.eps = self.norm.eps
        return layer

    def _library_step(self, layer, x, conv_state, ssm_state, inplace: bool):
        """One token through `Mamba2.step` (causal_conv1d_update + selective_state_update), which updates both
        states in place: the given ones when `inplace`, else copies, so a kept state is never changed.
        causal-conv1d's update takes our conv state as it is; mamba-ssm's torch fallback (no causal-conv1d) needs
        the libraries' conv_kernel columns (ours hold the last conv_kernel - 1 inputs): a zero column goes in
        front (the oldest, shifted out before use) and is cut off again."""
        b = x.shape[0]
        if conv_state is None:  # the start state, in fresh tensors
            conv_state = x.new_zeros(b, self.conv_dim, self.conv_kernel - 1)
            ssm_state = x.new_zeros(b, self.num_heads, self.head_dim, self.state_size, dtype=torch.float32)
            inplace = True
        h = ssm_state.to(torch.float32, copy=not inplace)
        if conv_update() is None:
            out, conv, h = layer.step(x, F.pad(conv_state.to(x.dtype), (1, 0)), h)
            return out, (conv[:, :, 1:], h)
        out, conv, h = layer.step(x, conv_state.to(x.dtype, copy=not inplace), h)
        return out, (conv, h)

    # -- forward ---------------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                state=None, return_state: bool = False, inplace: bool = False):
        check_hidden_states(hidden_states, self.hidden_size, "Mamba2Mixer")
        check_attention_mask(attention_mask, hidden_states, "Mamba2Mixer")
        in_dtype, dtype = hidden_states.dtype, self.out_proj.weight.dtype
        hidden_states = hidden_states.to(dtype)
        b, L, _ = hidden_states.shape
        conv_state, ssm_state = self._check_state(state, b)
        H, P, G, N = self.num_heads, self.head_dim, self.n_groups, self.state_size

        kernels = self._use_kernels(hidden_states)
        layer = self._library() if kernels is not None else None
        if layer is not None and state is None and not return_state and is_right_padding(attention_mask):
            return layer(hidden_states).to(in_dtype)  # right padding: no real token sees a padded one
        if layer is not None and L == 1 and attention_mask is None and not torch.is_grad_enabled():
            out, new_state = self._library_step(layer, hidden_states, conv_state, ssm_state, inplace)
            return (out.to(in_dtype), new_state) if return_state else out.to(in_dtype)

        z, xBC, dt = self.in_proj(hidden_states).split([self.d_inner, self.conv_dim, H], dim=-1)
        xBC = apply_padding_mask(xBC, attention_mask)
        xBC, new_conv_state = causal_conv1d(xBC, self.conv1d.weight[:, 0], self.conv1d.bias, conv_state)
        xBC = apply_padding_mask(F.silu(xBC), attention_mask)
        x, Bm, Cm = xBC.split([self.d_inner, G * N, G * N], dim=-1)
        x, Bm, Cm = x.reshape(b, L, H, P), Bm.reshape(b, L, G, N), Cm.reshape(b, L, G, N)

        scan_dtype = torch.promote_types(hidden_states.dtype, torch.float32)
        dt = F.softplus(dt.to(scan_dtype) + self.dt_bias.to(scan_dtype))
        if self.dt_limit != (0.0, float("inf")):
            dt = dt.clamp(*self.dt_limit)
        if attention_mask is not None:  # dt = 0 makes a padding step the identity on the state
            dt = dt * attention_mask.to(scan_dtype).unsqueeze(-1)
        A = -torch.exp(self.A_log.to(scan_dtype))
        D = self.D.to(scan_dtype)
        h0 = None if ssm_state is None else ssm_state.to(scan_dtype)

        if kernels is not None:
            y, h = self._scan_kernels(kernels, x, dt, A, Bm, Cm, D, h0, inplace)
        else:
            y, h = ssd_scan_torch(x.to(scan_dtype), dt, A, Bm.to(scan_dtype), Cm.to(scan_dtype), h0,
                                  chunk_size=min(self.chunk_size, 64))
            y = y + x.to(scan_dtype) * D[:, None]
        y = self.norm(y.reshape(b, L, self.d_inner).to(hidden_states.dtype), z)
        out = self.out_proj(y)
        if return_state:
            return out.to(in_dtype), (new_conv_state, h)
        return out.to(in_dtype)

    def _scan_kernels(self, kernels, x, dt, A, Bm, Cm, D, h0, inplace: bool):
        chunk_scan, state_update = kernels
        b, L, H, P = x.shape
        if L == 1 and not torch.is_grad_enabled():  # one-token decode: selective_state_update, in place
            h = (x.new_zeros(b, H, P, self.state_size, dtype=torch.float32) if h0 is None
                 else h0.to(torch.float32, copy=not inplace))
            # per-head values broadcast over head_dim with stride 0 (the kernel's tied-head fast path,
            # which also reads dt_bias: pass zeros, dt is already softplus-ed and masked)
            zeros = dt.new_zeros(1, 1).float().expand(H, P)
            y = state_update(h, x[:, 0], dt[:, 0, :, None].expand(b, H, P).float(),
                             A[:, None, None].expand(H, P, self.state_size).float(), Bm[:, 0], Cm[:, 0],
                             D=D[:, None].expand(H, P).float(), dt_bias=zeros, dt_softplus=False)
            return y[:, None], h
        y, h = chunk_scan(x.contiguous(), dt.float().contiguous(), A.float(), Bm.contiguous(),
                          Cm.contiguous(), self.chunk_size, D=D.float(),
                          initial_states=None if h0 is None else h0.float().contiguous(),
                          return_final_states=True)
        return y, h.float()

"""Pieces every Mamba2-style mixer needs: a causal depthwise convolution that carries its window across
calls, a gated RMSNorm, and padding-mask handling. Written once here so the three kinds agree exactly. Also the
plain RMSNorm of the blocks around a mixer (the surgery's inserted block, the state-tracking model)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ..cuda_graphs import graphed_path
from ..ops import fast_path


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  conv_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution over time.

    x: [B, L, C]; weight: [C, W]; conv_state: [B, C, W-1] (the last W-1 inputs before x, zeros if None).
    Returns (y [B, L, C], new_conv_state [B, C, W-1]). Continuing from the returned state gives the same
    outputs as one call over the concatenated sequence, which is what cached generation relies on.
    """
    B, L, C = x.shape
    W = weight.shape[-1]
    xt = x.transpose(1, 2)  # [B, C, L]
    if conv_state is None:
        conv_state = xt.new_zeros(B, C, W - 1)
    full = torch.cat([conv_state.to(xt.dtype), xt], dim=-1)  # [B, C, W-1+L]
    y = F.conv1d(full, weight.unsqueeze(1).to(xt.dtype), bias.to(xt.dtype) if bias is not None else None,
                 groups=C)
    return y.transpose(1, 2), full[:, :, -(W - 1):].contiguous() if W > 1 else full[:, :, :0]


@functools.cache
def conv_update():
    """causal-conv1d's `causal_conv1d_update`, or None where causal-conv1d does not import (the same import
    mamba-ssm's `Mamba2.step` makes to pick it); CUDA only. Its one-token step updates a conv state in place and
    takes the mixers' own (the last conv_kernel - 1 inputs, any strides; conv_kernel 2..4), so a decode step needs
    no conversion of the state to the libraries' conv_kernel-wide caches."""
    try:
        from causal_conv1d import causal_conv1d_update
    except ImportError:
        return None
    return causal_conv1d_update


def check_attention_mask(attention_mask: torch.Tensor | None, hidden_states: torch.Tensor, name: str) -> None:
    """A mixer's padding mask must be [batch, seq_len] of bool or 0/1 numbers: the mixers multiply by it, so a 2
    would double a token's input and a -1 flip it, with no error. The value check costs one host sync; it is
    skipped while a CUDA graph is captured (no sync is possible there)."""
    if attention_mask is None:
        return
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"{name}: attention_mask must be a tensor or None, got {type(attention_mask).__name__}")
    if attention_mask.dim() != 2 or attention_mask.shape != hidden_states.shape[:2]:
        raise ValueError(f"{name}: attention_mask must be [batch, seq_len] = {tuple(hidden_states.shape[:2])}, "
                         f"got {tuple(attention_mask.shape)}")
    check_mask_values(attention_mask, name)


def check_mask_values(attention_mask: torch.Tensor, name: str) -> None:
    """Raise a ValueError unless the mask is bool or holds only 0 and 1 (one host sync; skipped for bool masks and
    while a CUDA graph is captured)."""
    if attention_mask.dtype == torch.bool or (attention_mask.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    bad = (attention_mask != 0) & (attention_mask != 1)
    if bad.any():
        value = attention_mask[bad][0].item()
        raise ValueError(f"{name}: attention_mask must hold only 0 (padding) and 1 (token), or be bool; "
                         f"found {value!r}")


def _block_kernels(x: torch.Tensor):
    """The Triton kernels of `block_kernels.py` for a contiguous-rows CUDA tensor of a kernel dtype where Triton
    imports (`ops.fast_path`), else None (torch path)."""
    if x.stride(-1) != 1 or not fast_path.cuda_fast_path(x, dtypes=fast_path.FLOAT_DTYPES, triton=True):
        return None
    from . import block_kernels
    return block_kernels


class _ConvSiluFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight, bias)
        return _block_kernels(x).conv_silu_fwd(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, bias = ctx.saved_tensors
        if grad_y.stride(-1) != 1:
            grad_y = grad_y.contiguous()
        return _block_kernels(x).conv_silu_bwd(x, weight, bias, grad_y)


def causal_conv1d_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       conv_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(causal_conv1d(x, ...)), new_conv_state): on CUDA, a fresh sequence (no conv_state) with a bias and a
    power-of-two kernel runs one Triton kernel per pass that reads x in place (no transposes or concatenation)."""
    W = weight.shape[-1]
    if (conv_state is None and bias is not None and W & (W - 1) == 0 and x.shape[1] and _block_kernels(x) is not None
            and weight.dtype == x.dtype):
        y = _ConvSiluFn.apply(x, weight.contiguous(), bias)
        tail = x[:, x.shape[1] - min(x.shape[1], W - 1):].transpose(1, 2)
        return y, F.pad(tail, (W - 1 - tail.shape[-1], 0)).contiguous()
    y, state = causal_conv1d(x, weight, bias, conv_state)
    return F.silu(y), state


def is_right_padding(attention_mask: torch.Tensor | None) -> bool:
    """True without a mask or when every row is tokens then padding: a causal layer then needs no mask, since no
    token sees a later (padded) position. Costs one host sync; in a graphed body (`cuda_graphs.graphed_path`: its
    capture, where no sync is allowed, and the warm-up before it) a mask counts as not right padding, which only
    sends the call to the masked path."""
    if attention_mask is None:
        return True
    if graphed_path():
        return False
    m = attention_mask.bool()
    return not bool((m[:, 1:] & ~m[:, :-1]).any())


def bind_parameters(library: nn.Module, owner: nn.Module) -> list:
    """Make `library` (a library's layer built on the meta device, not a submodule of `owner`) run on `owner`'s
    parameters: the same Parameter objects, matched by name, so one state dict, one optimizer state and one device
    move serve both. Returns the bindings for `rebind`; ValueError when the two do not have the same parameters."""
    own, lib = dict(owner.named_parameters()), dict(library.named_parameters())
    bad = sorted(n for n in set(own) | set(lib) if n not in own or n not in lib or own[n].shape != lib[n].shape)
    if bad:
        raise ValueError(f"{type(library).__name__} and {type(owner).__name__} differ in parameters {bad[:4]}")
    binds = []
    for name in lib:
        path, _, leaf = name.rpartition(".")
        binds.append((library.get_submodule(path), leaf, owner.get_submodule(path)))
    rebind(binds)
    return binds


def rebind(binds: list) -> None:
    """Point the library layer at the owner's current parameters (run before each call: cheap, and it follows
    parameters that were replaced since, e.g. by `load_state_dict(assign=True)`)."""
    for lib_module, leaf, own_module in binds:
        lib_module._parameters[leaf] = own_module._parameters[leaf]


def library_layer(owner: nn.Module, build) -> nn.Module | None:
    """The library layer `owner` runs on CUDA, on `owner`'s own parameters: `build()` makes it (on the meta device;
    None: there is none) on the first call, it is kept out of `state_dict()` / `parameters()`, and each call points
    it at the owner's current parameters (`rebind`)."""
    built = owner.__dict__.get("_library_layer")
    if built is None:
        layer = build()
        built = owner.__dict__["_library_layer"] = False if layer is None else (layer, bind_parameters(layer, owner))
    if built is False:
        return None
    layer, binds = built
    rebind(binds)
    return layer


def apply_padding_mask(x: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Zero the positions that are padding ([B, L] mask, 1 = token) so they cannot write into the state."""
    if attention_mask is None:
        return x
    if attention_mask.dim() != 2 or attention_mask.shape != x.shape[:2]:
        raise ValueError(f"attention_mask must be [batch, seq_len] = {tuple(x.shape[:2])}, "
                         f"got {tuple(attention_mask.shape)}")
    return x * attention_mask.to(x.dtype).unsqueeze(-1)


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


class GatedRMSNorm(nn.Module):
    """RMSNorm(x * silu(z)) * weight, the output norm of Mamba2 blocks (gate before the norm),
    with optional groups so each head (or group of heads) is normalised on its own."""

    def __init__(self, dim: int, eps: float = 1e-5, group_size: int | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.group_size = group_size or dim

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        return _GatedRMSNormFn.apply(x, z, self.weight, self.group_size, self.eps)


def _gated_rms_norm(x, z, group_size, eps):
    """(normalised h, rstd, silu(z)) in at least float32; the maths of GatedRMSNorm before the weight."""
    cd = torch.promote_types(x.dtype, torch.float32)  # at least float32, float64 stays float64
    g = x.to(cd)
    sz = None
    if z is not None:
        sz = F.silu(z.to(cd))
        g = g * sz
    shape = g.shape
    g = g.reshape(*shape[:-1], shape[-1] // group_size, group_size)
    rstd = torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    h = (g * rstd).reshape(shape)
    return h, rstd, sz


class _GatedRMSNormFn(torch.autograd.Function):
    """Keeps only the inputs (in their own dtype) for backward and recomputes the float32 intermediates:
    under bf16 the plain autograd graph of this norm saved five float32 copies of the activations.

    Both passes walk the rows in slices of about ROW_SLICE_ELEMENTS elements: the norm ends the mixer, so its
    backward runs first, while every activation of the forward is still alive, and its float32 temporaries
    (about ten of the input's size when done in one piece) added directly to the layer's peak memory."""

    ROW_SLICE_ELEMENTS = 1 << 24

    @staticmethod
    def _slices(n_rows: int, dim: int):
        step = max(1, _GatedRMSNormFn.ROW_SLICE_ELEMENTS // max(1, dim))
        return [slice(i, min(i + step, n_rows)) for i in range(0, n_rows, step)]

    @staticmethod
    def forward(ctx, x, z, weight, group_size, eps):
        ctx.save_for_backward(x, z, weight)
        ctx.group_size, ctx.eps = group_size, eps
        d = x.shape[-1]
        xr, zr = x.reshape(-1, d), None if z is None else z.reshape(-1, d)
        kernels = _GatedRMSNormFn._kernels(xr, zr)
        if kernels is not None:
            return kernels.gated_norm_fwd(xr, zr, weight, group_size, eps).view(x.shape)
        out = torch.empty_like(xr)
        for r in _GatedRMSNormFn._slices(xr.shape[0], d):
            h, _, _ = _gated_rms_norm(xr[r], None if zr is None else zr[r], group_size, eps)
            out[r] = h * weight.to(h.dtype)
        return out.view(x.shape)

    @staticmethod
    def _kernels(xr, zr):
        """Triton kernels for a gated norm whose rows are unit-stride rows of one dtype (the blocks' case)."""
        if zr is None or zr.dtype != xr.dtype or zr.stride(-1) != 1:
            return None
        return _block_kernels(xr)

    @staticmethod
    def backward(ctx, grad_out):
        x, z, weight = ctx.saved_tensors
        gs, d = ctx.group_size, x.shape[-1]
        xr, zr, gr = x.reshape(-1, d), None if z is None else z.reshape(-1, d), grad_out.reshape(-1, d)
        kernels = _GatedRMSNormFn._kernels(xr, zr)
        if kernels is not None:
            dx, dz, gw = kernels.gated_norm_bwd(xr, zr, weight, gr if gr.stride(-1) == 1 else gr.contiguous(), gs,
                                                ctx.eps)
            return dx.view(x.shape), dz.view(z.shape), gw, None, None
        dx = torch.empty_like(xr)
        dz = None if z is None else torch.empty_like(zr)
        gw = None
        for r in _GatedRMSNormFn._slices(xr.shape[0], d):
            h, rstd, sz = _gated_rms_norm(xr[r], None if zr is None else zr[r], gs, ctx.eps)
            cd = h.dtype
            go = gr[r].to(cd)
            part = (go * h).sum(0)
            gw = part if gw is None else gw + part
            dh = (go * weight.to(cd)).view(-1, d // gs, gs)
            hg = h.view(dh.shape)
            dg = (rstd * (dh - hg * (dh * hg).mean(-1, keepdim=True))).view(-1, d)
            if z is None:
                dx[r] = dg
                continue
            zc = zr[r].to(cd)
            sig = torch.sigmoid(zc)
            dx[r] = dg * sz
            dz[r] = dg * xr[r].to(cd) * sig * (1 + zc * (1 - sig))
        gw = gw.to(weight.dtype) if gw is not None else torch.zeros_like(weight)
        return dx.view(x.shape), None if z is None else dz.view(z.shape), gw, None, None


def check_hidden_states(hidden_states: torch.Tensor, hidden_size: int, name: str) -> None:
    """Raise a clear error for inputs of the wrong rank, width or dtype."""
    if hidden_states.dim() != 3 or hidden_states.shape[-1] != hidden_size:
        raise ValueError(f"{name} expects hidden_states [batch, seq_len, {hidden_size}], "
                         f"got {tuple(hidden_states.shape)}")
    if not hidden_states.is_floating_point():
        raise TypeError(f"{name} expects floating-point hidden_states, got {hidden_states.dtype}")

"""The Flash PD-SSM sequence mixer: a Mamba2-style block around the hard-selected PD recurrence.

    hidden -> in_proj -> [z | u];  u -> causal depthwise conv -> SiLU
    u -> x_proj -> per head: selector logits (K), log-magnitude and phase of D_t (N each)
    b_t = B_h u_t (complex),  P_t = P_dict[h, argmax selector],  x_t = P_t D_t x_{t-1} + b_t   (pd_select_scan)
    y = Re(C_h x_t) + D_skip * u;  out = out_proj(GatedRMSNorm(y, z))
    (read_gate=True: y = Re(C_h (r_t * x_t)) + D_skip * u, r_t per token from x_proj; torch path only)
    (matrix_state=True: a state X [N, P] per head, X_t = P_t D_t X_{t-1} + b_t u_t^T, y_t = Re(X_t^T C_h^T u_t) +
     D_skip * u: b_t is a write key and C_h^T u_t a read query, as in linear attention; torch path only)

Memory is O(B*L*H*N + H*K*N*N): per token only an int16 index vector and a diagonal are built (paper, sec. 3).
"""

from __future__ import annotations

import functools
import itertools
import math
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.pd_scan import pd_scan
from ..ops.pd_select import column_argmax, gather_transitions, pd_select_scan
from ..ops.pd_transition import round_phase, snap_magnitude
from . import flash_pdssm_fused as fused
from .common import GatedRMSNorm, apply_padding_mask, causal_conv1d_silu, check_attention_mask, check_hidden_states

BACKENDS = ("auto", "torch", "kernel")


def pow2_sqrt(hidden_size: int) -> int:
    """About sqrt(D), a power of two: the paper's head count and dictionary size (sec. 3.2)."""
    return 2 ** max(0, round(math.log2(max(1.0, math.sqrt(hidden_size)))))


def default_num_heads(hidden_size: int, d_inner: int) -> int:
    """`pow2_sqrt` heads, or where those are wider than the fused op serves (`MAX_HEAD_SIZE`; at expand 1 only
    above width 4096) the fewest heads at least as many whose width divides `d_inner` and fits: Nemotron-H 9B's
    4480 takes 70 heads of 64, not 64 of 70, at the same parameters within 0.1%, and its layer's training step is
    1.4x (B=1) to 6.2x (B=8) faster on an H200 (docs/bench/layer.md)."""
    heads = pow2_sqrt(hidden_size)
    if d_inner % heads or fused.fits(d_inner // heads, d_inner // heads):
        return heads
    return next((h for h in range(heads, d_inner + 1) if d_inner % h == 0 and fused.fits(d_inner // h, d_inner // h)),
                heads)


def tau_schedule(step: int, total_steps: int, start: float = 1.0, end: float = 0.1) -> float:
    """Geometric annealing of the straight-through temperature from `start` to `end` over `total_steps`."""
    if not (start > 0 and end > 0 and math.isfinite(start) and math.isfinite(end)):
        raise ValueError(f"tau_schedule: start and end must be positive finite temperatures, got {start}, {end}")
    if total_steps <= 0:
        return end
    frac = min(1.0, max(0.0, step / total_steps))
    return float(start * (end / start) ** frac)


@functools.lru_cache(maxsize=None)
def _every_permutation(N: int) -> torch.Tensor:
    return torch.tensor(list(itertools.permutations(range(N))))


def distinct_permutations(K: int, N: int) -> torch.Tensor:
    """[K, N] random permutations of N entries, all distinct while K <= N! (then every one of them, in random order,
    repeated). A duplicate adds no transition a token can select, and a member that no token selects gets no
    gradient, so it never becomes the transition a head still lacks (an S3 head of K = 8 members drawn with repeats
    lacks one of the 6 permutations 89% of the time). Beyond N = 8, independent draws, which collide with
    probability below K^2 / (2 N!)."""
    if N > 8:
        return torch.stack([torch.randperm(N) for _ in range(K)])
    every = _every_permutation(N)
    order = torch.cat([torch.randperm(len(every)) for _ in range(-(-K // len(every)))])[:K]
    return every[order]


class FlashPDSSM(nn.Module):
    """Flash PD-SSM mixer (see module docstring). Follows the Mixer contract of docs/design.md.

    Defaults scale with the width as the paper suggests (sec. 3.2): about sqrt(D) heads (more where those would be
    wider than the fused op serves: `default_num_heads`) and sqrt(D) dictionary members, head state size = head
    width.
    `backend`: "auto" (a complex layer on CUDA runs its middle as one fused op, `flash_pdssm_fused.py`, when the
    kernels can run; the torch path otherwise), "torch" (the torch path, the fused op's reference; its scan still
    uses the pd_scan CUDA kernels on CUDA tensors), or "kernel" (the fused op, an error where it cannot run).
    A decode step (one token, no autograd) runs the middle as one Triton kernel where
    `ops.pd_select.triton_middle.CONFIG["decode"]` is on (the default), the torch path otherwise.
    """

    def __init__(self, hidden_size: int, num_heads: int | None = None, head_dim: int | None = None,
                 state_size: int | None = None, dict_size: int | None = None, expand: int = 1,
                 conv_kernel: int = 4, complex: bool = True, tau: float = 1.0, norm_eps: float = 1e-5,
                 dict_init: str = "normal", decay_range: tuple[float, float] = (1e-3, 1e-1),
                 layer_idx: int | None = None, b_gate: str | bool | None = None, x_init_std: float = 0.0,
                 unit_snap: float = 0.0, phase_levels: int = 0, read_gate: bool = False, matrix_state: bool = False,
                 backend: str = "auto"):
        super().__init__()
        sizes = dict(hidden_size=hidden_size, expand=expand, conv_kernel=conv_kernel, num_heads=num_heads,
                     head_dim=head_dim, state_size=state_size, dict_size=dict_size)
        for name, v in sizes.items():   # None: the default, for those that have one
            if (v is not None or name in ("hidden_size", "expand", "conv_kernel")) and \
                    (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"FlashPDSSM: {name} must be a positive int, got {v!r}")
        d_inner = expand * hidden_size
        if head_dim is not None and (d_inner % head_dim or num_heads not in (None, d_inner // head_dim)):
            raise ValueError(f"FlashPDSSM: num_heads * head_dim must equal expand*hidden_size={d_inner}, got "
                             f"num_heads={num_heads}, head_dim={head_dim}")
        if num_heads is None:
            num_heads = default_num_heads(hidden_size, d_inner) if head_dim is None else d_inner // head_dim
        if d_inner % num_heads:
            raise ValueError(f"FlashPDSSM: expand*hidden_size={d_inner} must be divisible by num_heads={num_heads}")
        head_dim = d_inner // num_heads
        state_size = state_size or head_dim
        dict_size = dict_size or pow2_sqrt(hidden_size)
        if state_size > 1024:
            raise ValueError(f"FlashPDSSM: state_size must be <= 1024 (int16 kernels), got {state_size}")
        if backend not in BACKENDS:
            raise ValueError(f"FlashPDSSM: backend must be one of {BACKENDS}, got {backend!r}")
        if dict_init not in self.DICT_INITS:
            raise ValueError(f"FlashPDSSM: dict_init must be one of {self.DICT_INITS}, got {dict_init!r}")
        self.hidden_size, self.d_inner, self.num_heads, self.head_dim = hidden_size, d_inner, num_heads, head_dim
        self.state_size, self.dict_size, self.conv_kernel = state_size, dict_size, conv_kernel
        self.complex, self.tau, self.layer_idx, self.backend = complex, tau, layer_idx, backend
        # read_gate: the readout takes the state through a per-token gate r_t (N values per head, complex for a
        # complex layer) made from u_t: y_t = Re(C_h (r_t * x_t)). Beyond the paper, whose C is time-invariant: a
        # query token can pick (and, complex, rotate) the entries it reads, as Mamba2's C_t and DeltaNet's queries
        # do. Its x_proj rows start at zero, so r_t = 1 and the layer starts as a plain one. Torch path only.
        if not isinstance(read_gate, bool):
            raise ValueError(f"FlashPDSSM: read_gate must be True or False, got {read_gate!r}")
        self.read_gate = read_gate
        # matrix_state: each head keeps N x P numbers instead of N. The paper's b_t = B_h u_t becomes a write key for
        # the token's P values, X_t = P_t D_t X_{t-1} + b_t u_t^T, and C_h^T u_t a read query, y_t = Re(X_t^T C_h^T
        # u_t): an associative memory (Box asks what one box holds) whose slots the PD transitions move, with the
        # parameters of the plain layer. Beyond the paper; torch path only (the scan runs once per value column).
        if not isinstance(matrix_state, bool):
            raise ValueError(f"FlashPDSSM: matrix_state must be True or False, got {matrix_state!r}")
        if matrix_state and (read_gate or b_gate == "off"):
            raise ValueError("FlashPDSSM: matrix_state writes through b_t and reads through its own query; it takes "
                             "neither read_gate nor b_gate='off'")
        self.matrix_state = matrix_state
        self._check_kernel_backend()
        if isinstance(b_gate, bool):  # the first form of this option: True = a sigmoid gate
            b_gate = "sigmoid" if b_gate else None
        if b_gate not in self.B_GATES:
            raise ValueError(f"FlashPDSSM: b_gate must be one of {self.B_GATES}, got {b_gate!r}")
        if x_init_std < 0:
            raise ValueError(f"FlashPDSSM: x_init_std must be >= 0, got {x_init_std}")
        if b_gate == "off" and not x_init_std:
            raise ValueError("FlashPDSSM: b_gate='off' needs x_init_std > 0, else the state stays zero")
        if unit_snap < 0:
            raise ValueError(f"FlashPDSSM: unit_snap must be >= 0, got {unit_snap}")
        # unit_snap s > 0: |D| = min(1, (1 + s) sigmoid(-a)), so a magnitude reaches exactly 1 (a state entry that
        # keeps forever, and takes no input under b_gate="decay") once its decay is below ~s, instead of only
        # approaching 1; trained on short words, a decay of 1e-2 looks as good as none (state tracking).
        self.unit_snap = float(unit_snap)
        if phase_levels < 0 or (phase_levels and not complex):
            raise ValueError(f"FlashPDSSM: phase_levels must be >= 0 and needs complex=True, got {phase_levels}")
        # phase_levels Q > 0: phases rounded to multiples of 2 pi / Q in the forward pass (straight-through in the
        # backward), so a rotation that tracks a cyclic count (parity: pi, a 5-cycle: 2 pi / 5) is exact; a
        # learned continuous phase is off by a little, and the error grows with the length of the word.
        self.phase_levels = int(phase_levels)
        self.b_gate = b_gate
        H, P, N, K = num_heads, head_dim, state_size, dict_size

        self.in_proj = nn.Linear(hidden_size, 2 * d_inner, bias=False)
        self.conv1d = nn.Conv1d(d_inner, d_inner, conv_kernel, groups=d_inner, bias=True)
        n_phase = N if complex else 0
        # b_gate (docs/bench/state_tracking.md): an always-on b_t = B u_t makes the state a sum of permuted
        # injections, a random walk that breaks length generalisation of state tracking. "sigmoid"/"hard": one
        # gate per head and token scales b_t ("hard" reaches exactly 0); "decay": b_t scaled by 1 - |D_t|, so
        # a head that keeps its state (|D| -> 1) takes nothing in; "off": no injection at all, the state
        # is the learned x_init moved by P_t D_t (Proposition 1's automaton emulation; give x_init_std > 0).
        n_gate = int(b_gate in ("sigmoid", "hard"))
        n_read = (2 if complex else 1) * N if read_gate else 0   # the read gate's columns come last, per head
        self.x_proj = nn.Linear(d_inner, H * (K + N + n_phase + n_gate + n_read), bias=False)
        # log|D_t| = -softplus(a_t + decay_bias): decays start in decay_range, like Mamba2's dt init.
        lo, hi = decay_range
        decay = torch.exp(torch.rand(H * N) * (math.log(hi) - math.log(lo)) + math.log(lo))
        self.decay_bias = nn.Parameter(decay + torch.log(-torch.expm1(-decay)))  # inverse softplus
        self.dictionary = nn.Parameter(self._init_dictionary(H, K, N, dict_init))
        scale_b = 1.0 / math.sqrt(P)
        self.B = nn.Parameter(torch.randn(H, N, P, 2 if complex else 1) * scale_b)
        self.C = nn.Parameter(torch.randn(H, P, N, 2 if complex else 1) / math.sqrt(N))
        self.D_skip = nn.Parameter(torch.ones(H, P))
        # Learned initial state (PD-SSM starts automata from a one-hot state); padding steps keep it intact.
        shape = (H, N, 2 if complex else 1)
        self.x_init = nn.Parameter(torch.randn(shape) * x_init_std if x_init_std else torch.zeros(shape))
        self.norm = GatedRMSNorm(d_inner, eps=norm_eps, group_size=head_dim)  # per head: one head per automaton
        self.out_proj = nn.Linear(d_inner, hidden_size, bias=False)
        self._watchers = []   # watching_inputs
        with torch.no_grad():
            self.x_proj.weight.mul_(0.5)
            if n_read:
                self.x_proj.weight.view(H, -1, d_inner)[:, -n_read:].zero_()

    @property
    def tau(self) -> float:
        """The straight-through softmax temperature (`set_tau`, `tau_schedule`); checked wherever it is set."""
        return self._tau

    @tau.setter
    def tau(self, value) -> None:
        try:
            tau = float(value)
        except (TypeError, ValueError):
            tau = math.nan
        if isinstance(value, (bool, str)) or not math.isfinite(tau) or tau <= 0:
            raise ValueError(f"FlashPDSSM: tau must be a positive finite number, got {value!r}")
        self._tau = tau
        held = self.__dict__.get("_tau_held")
        if held is not None:
            held.fill_(tau)

    def tau_held(self, device: torch.device) -> torch.Tensor:
        """tau as a float32 scalar tensor on `device`, rewritten in place whenever tau is set: the straight-through
        backward reads the temperature from memory, so a captured CUDA graph replays with the current one
        (annealed every step) instead of the one it was captured with. Not a buffer: a dtype cast of the model
        must not round it."""
        held = self.__dict__.get("_tau_held")
        if held is None or held.device != device:
            held = self._tau_held = torch.tensor(self._tau, dtype=torch.float32, device=device)
        return held

    DICT_INITS = ("normal", "permutation", "noisy_permutation", "distinct", "identity")
    B_GATES = fused.B_GATES   # (None, "sigmoid", "hard", "decay", "off"), one list for the layer and its fused op

    @staticmethod
    def _init_dictionary(H: int, K: int, N: int, how: str) -> torch.Tensor:
        """normal: random maps (PD-SSM's init); permutation: random permutations with a margin; distinct: the same,
        all different within a head (`distinct_permutations`); identity: every member starts as the identity with a
        margin, so the layer begins as a diagonal SSM.

        The margin is over each column's largest random logit, so the hard members are exactly these maps at any N.
        noisy_permutation puts the margin on the chosen logit alone, so the largest of the other N - 1 beats it in
        some columns (1.6% at N = 2-3, 5.6% at N = 5) and a few members start as merging maps: the one-layer
        recipe's init, because those strays help a layer leave the start on A5 by generators (exact permutations:
        2 of 5 CPU seeds; docs/bench/state_tracking.md)."""
        M = torch.randn(H, K, N, N) / math.sqrt(N)
        if how == "normal":
            return M
        if how in ("permutation", "noisy_permutation"):
            dest = torch.stack([torch.randperm(N) for _ in range(H * K)]).view(H, K, 1, N)
        elif how == "distinct":
            dest = torch.stack([distinct_permutations(K, N) for _ in range(H)]).view(H, K, 1, N)
        else:
            dest = torch.arange(N).expand(H, K, 1, N)
        margin = 3.0 / math.sqrt(N)
        if how == "noisy_permutation":
            return M.scatter_add_(-2, dest, torch.full((H, K, 1, N), margin))
        return M.scatter_(-2, dest, M.amax(-2, keepdim=True) + margin)

    # ---- pieces -------------------------------------------------------------------------------------------
    def transitions(self) -> torch.Tensor:
        """The hard dictionary: [H, K, N] int16 destinations, computed once per forward."""
        return column_argmax(self.dictionary)

    def _ssm_inputs(self, u: torch.Tensor):
        """u [B,L,d_inner] -> selector logits [B,H,L,K], D and b [B,H,L,N] (float32 / complex64), and the read gate
        r [B,H,L,N] (None without `read_gate`).

        The two projections run in u's dtype (bf16 in mixed precision: tensor cores, as Mamba2's dt/B/C
        projections do); everything after them is float32 at least (float64 when asked)."""
        Bsz, L, _ = u.shape
        H, P, N, K = self.num_heads, self.head_dim, self.state_size, self.dict_size
        cd = torch.promote_types(u.dtype, torch.float32)
        proj = F.linear(u, self.x_proj.weight.to(u.dtype)).to(cd)
        proj = proj.view(Bsz, L, H, -1).transpose(1, 2)  # [B,H,L,K+N(+N)]
        # Memory: what autograd keeps should be the scan's own tensors. A slice of proj saved for backward
        # would keep all of proj alive (hence the copy of the selector logits), torch.complex would keep both
        # planes of b (view_as_complex keeps nothing), and |D| = exp(-softplus(a)) = sigmoid(-a) saves one
        # tensor instead of two.
        sel = proj[..., :K].contiguous()
        a = proj[..., K:K + N] + self.decay_bias.to(cd).view(H, 1, N)
        mag = snap_magnitude(torch.sigmoid(-a), self.unit_snap)
        b_parts = torch.einsum("blhp,hnpc->bhlnc", u.view(Bsz, L, H, P), self.B.to(u.dtype)).to(cd)
        if self.complex:
            D = torch.polar(mag, round_phase(proj[..., K + N:K + 2 * N], self.phase_levels))
            b = torch.view_as_complex(b_parts if b_parts.stride(-1) == 1 else b_parts.contiguous())
        else:
            D, b = mag, b_parts[..., 0]
        g = K + N + (N if self.complex else 0)   # the b-gate's column (the read gate's come after it)
        if self.b_gate == "off":
            b = torch.zeros_like(b)
        elif self.b_gate == "sigmoid":
            b = b * torch.sigmoid(proj[..., g:g + 1])
        elif self.b_gate == "hard":  # exactly 0 for gate logits <= -0.5: ordinary tokens can inject nothing
            b = b * (0.5 + proj[..., g:g + 1]).clamp(0, 1)
        elif self.b_gate == "decay":  # b scaled by 1 - |D| (Mamba-style): a state that keeps, takes nothing in
            b = b * (1 - mag if self.unit_snap else torch.sigmoid(a))  # 1 - |D_t|
        r = None
        if self.read_gate:
            cols = proj[..., -(2 if self.complex else 1) * N:]
            r = 1 + (torch.complex(cols[..., :N], cols[..., N:]) if self.complex else cols)
        return sel, D, b, r

    def _readout(self, x: torch.Tensor, u: torch.Tensor, r: torch.Tensor | None = None) -> torch.Tensor:
        """Re(C_h (r_t x_t)) + D_skip * u -> [B, L, d_inner], in u's dtype (one real matmul over [Re, Im]); r the
        read gate (None: 1)."""
        Bsz, H, L, N = x.shape
        dt = u.dtype
        if r is not None:
            x = x * r
        if self.complex:
            xs = torch.cat([x.real, x.imag], dim=-1).to(dt)                        # [B,H,L,2N]
            Cw = torch.cat([self.C[..., 0], -self.C[..., 1]], dim=-1).to(dt)       # [H,P,2N]
        else:
            xs, Cw = x.to(dt), self.C[..., 0].to(dt)
        y = torch.einsum("bhln,hpn->blhp", xs, Cw)
        y = y + self.D_skip.to(dt) * u.view(Bsz, L, H, self.head_dim)
        return y.reshape(Bsz, L, self.d_inner)

    def _values(self, planes: torch.Tensor) -> torch.Tensor:
        """A parameter stored with a trailing (re, im) axis (a single real plane for a real layer) as its values."""
        return torch.complex(planes[..., 0], planes[..., 1]) if self.complex else planes[..., 0]

    def initial_state(self, batch_size: int) -> torch.Tensor:
        """The learned state before the first token, [B, H, N] ([B, H, P, N] with `matrix_state`, x_init in every
        column; complex for the complex variant)."""
        x = self._values(self.x_init.float())
        if self.matrix_state:
            return x[None, :, None].expand(batch_size, -1, self.head_dim, -1)
        return x.unsqueeze(0).expand(batch_size, -1, -1)

    def state_shape(self, batch_size: int) -> tuple[int, ...]:
        """The recurrent state's shape: [B, H, N], or [B, H, P, N] with `matrix_state`."""
        H, P, N = self.num_heads, self.head_dim, self.state_size
        return (batch_size, H, P, N) if self.matrix_state else (batch_size, H, N)

    # ---- Mixer contract -----------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, state=None,
                return_state: bool = False, inplace: bool = False):
        # `inplace` (the mixer contract) is a permission this layer does not use: its step makes new tensors
        check_hidden_states(hidden_states, self.hidden_size, "FlashPDSSM")
        check_attention_mask(attention_mask, hidden_states, "FlashPDSSM")
        Bsz, L, _ = hidden_states.shape
        conv_state, x0 = state if state is not None else (None, None)
        z, u = self.in_proj(hidden_states).chunk(2, dim=-1)
        u = apply_padding_mask(u, attention_mask)
        u, new_conv = causal_conv1d_silu(u, self.conv1d.weight.squeeze(1), self.conv1d.bias, conv_state)
        u = apply_padding_mask(u, attention_mask)
        # The scan and its inputs run in float32 (float64 if asked) even under bf16 autocast: the complex
        # inputs, the hard argmaxes and the long recurrence need it; the big projections stay in autocast.
        device = u.device.type
        no_autocast = torch.autocast(device, enabled=False) if torch.amp.is_autocast_available(device) else nullcontext()
        with no_autocast:
            y, x_last = self._scan_and_read(u, attention_mask, x0)
        out = self.out_proj(self.norm(y.to(z.dtype), z))
        if return_state:
            return out, (new_conv, x_last)
        return out

    @contextmanager
    def watching_inputs(self, watch):
        """Within it, every forward first calls `watch(u, attention_mask)` with the scan's input u [B, L, d_inner]
        (probes read the selections from it through `_ssm_inputs`); the layer computes as before. Removed on exit,
        also after an error."""
        self._watchers.append(watch)
        try:
            yield self
        finally:
            self._watchers.remove(watch)

    def _scan_and_read(self, u: torch.Tensor, attention_mask: torch.Tensor | None, x0: torch.Tensor | None):
        """u [B, L, d_inner] -> (readout y [B, L, d_inner], last state [B, H, N])."""
        for watch in self._watchers:
            watch(u, attention_mask)
        Bsz = u.shape[0]
        if x0 is None:
            x0 = self.initial_state(Bsz)
        elif x0.shape != self.state_shape(Bsz):
            raise ValueError(f"FlashPDSSM: recurrent state must be [B, H, {'P, ' if self.matrix_state else ''}N] = "
                             f"{self.state_shape(Bsz)}, got {tuple(x0.shape)}")
        # a decode step (one token, no autograd) takes the torch path unless the one-kernel middle runs it
        # (triton_middle.CONFIG["decode"]): the separate kernels' per-call setup serves long sequences
        decode = u.shape[1] == 1 and not torch.is_grad_enabled()
        if self._use_kernels(u, decode):
            return self._fused_scan_and_read(u, attention_mask, x0)
        sel, D, b, r = self._ssm_inputs(u)
        x0 = x0.to(b.dtype)
        if attention_mask is not None:  # padding steps are the identity: D = 1, P = id (below), b = 0
            keep = attention_mask.to(torch.bool)[:, None, :, None]
            D = torch.where(keep, D, torch.ones_like(D))
        if self.matrix_state:
            return self._matrix_scan_and_read(u, sel, D, b, x0, attention_mask)
        x = self._scan(sel, D, b, x0, attention_mask)
        return self._readout(x, u, r), x[:, :, -1]

    def _scan(self, sel, D, b, x0, mask):
        """The hard-selected scan of `_ssm_inputs`' outputs, with straight-through gradients when training."""
        if torch.is_grad_enabled() and (self.dictionary.requires_grad or sel.requires_grad):
            return pd_select_scan(self.dictionary, sel, D, b, x0, tau=self.tau_held(b.device), mask=mask)
        # inference: the same hard forward without the straight-through bookkeeping
        return pd_scan(gather_transitions(self.transitions(), sel.argmax(-1), mask), D, b, x0,
                       check_values=False)   # argmaxes: in range by construction, no host sync

    def _matrix_scan_and_read(self, u, sel, D, key, x0, mask):
        """`matrix_state`: each of a head's P value columns is its own PD scan (the same selections and diagonals,
        written b_t u_t[p]), run as P times the batch; the readout takes Re(query . column) per column."""
        Bsz, L, _ = u.shape
        H, P, N = self.num_heads, self.head_dim, self.state_size
        v = u.view(Bsz, L, H, P).permute(0, 3, 2, 1).to(key.dtype)                  # [B, P, H, L]
        writes = (key.unsqueeze(1) * v.unsqueeze(-1)).reshape(Bsz * P, H, L, N)

        def per_column(t):   # [B, ...] -> [B * P, ...], sequence b's rows at b * P .. b * P + P - 1
            return t.unsqueeze(1).expand(Bsz, P, *t.shape[1:]).reshape(Bsz * P, *t.shape[1:])

        m = None if mask is None else per_column(mask)
        x0 = x0.transpose(1, 2).reshape(Bsz * P, H, N)
        X = self._scan(per_column(sel), per_column(D), writes, x0, m).view(Bsz, P, H, L, N)
        query = torch.einsum("blhp,hpn->bhln", u.view(Bsz, L, H, P).to(X.dtype), self._values(self.C).to(X.dtype))
        y = torch.einsum("bphln,bhln->blhp", X, query)
        y = (y.real if y.is_complex() else y).to(u.dtype) + self.D_skip.to(u.dtype) * u.view(Bsz, L, H, P)
        return y.reshape(Bsz, L, self.d_inner), X[:, :, :, -1].transpose(1, 2)

    def _fused_refusal(self) -> str | None:
        """Why the fused op cannot serve this layer (None: it can, where CUDA and its kernels are there)."""
        if not fused.fits(self.state_size, self.head_dim):
            return (f"serves heads up to state_size and head_dim {fused.MAX_HEAD_SIZE}, got {self.state_size} and "
                    f"{self.head_dim}; use backend='auto' (the torch path for such heads) or more, smaller heads")
        if self.read_gate:
            return "has no read gate; use backend='auto' (the torch path) with read_gate=True"
        if self.matrix_state:
            return "has no matrix state; use backend='auto' (the torch path) with matrix_state=True"
        return None

    def _check_kernel_backend(self) -> None:
        """backend='kernel' on a layer the fused op does not serve: an error, never a silent torch path."""
        why = self._fused_refusal()
        if self.backend == "kernel" and why:
            raise ValueError(f"FlashPDSSM: backend='kernel' {why}")

    def _use_kernels(self, u: torch.Tensor, decode: bool = False) -> bool:
        """Whether this call runs the fused op (see `backend`)."""
        if self.backend == "torch":
            return False
        # where the middle runs as one Triton kernel per (sequence, head) (triton_middle.py) it needs no pd_scan
        # extension
        if self._fused_refusal():
            self._check_kernel_backend()
            return False
        one_kernel = u.is_cuda and fused.one_kernel_pays(u.shape[0], self.num_heads, self.state_size, u.shape[1],
                                                         u.device)
        if decode and not one_kernel:
            return False
        ok = self.complex and fused.usable(u, triton_only=one_kernel)
        if not ok and self.backend == "kernel":
            raise RuntimeError("FlashPDSSM: backend='kernel' needs a complex layer and CUDA float32/bfloat16/float16 "
                               "inputs with the pd_scan kernels built and Triton importable; use backend='auto'")
        return ok

    def _fused_scan_and_read(self, u: torch.Tensor, attention_mask: torch.Tensor | None, x0: torch.Tensor):
        """The CUDA path of `_scan_and_read` for complex layers: the same maths as `_ssm_inputs` + scan +
        `_readout`, with complex values kept as float32 planes end to end. From u on (x_proj, injection, scan,
        readout) it is one op that walks the batch in slices, so nothing state-sized (projection, b, D, dL/dx)
        exists for the whole batch, and x needs no re/im concatenation or bf16 copy."""
        y, last_re, last_im = fused.fused_middle(
            u, self.x_proj.weight, self.decay_bias, self.dictionary, self.B, x0.to(torch.complex64), self.C,
            self.D_skip, self.tau_held(u.device), attention_mask, self.b_gate, self.unit_snap, self.phase_levels)
        return y, torch.complex(last_re, last_im)

    def step(self, hidden_state: torch.Tensor, state=None):
        """One token [B, D] -> (y [B, D], state): the recurrent form used in generation. Equal to forward on
        a length-1 sequence from the same state (the scan of one step is b + scatter(P, D * x0))."""
        y, state = self.forward(hidden_state.unsqueeze(1), state=state, return_state=True)
        return y.squeeze(1), state

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, heads={self.num_heads}, head_dim={self.head_dim}, "
                f"state_size={self.state_size}, dict_size={self.dict_size}, complex={self.complex}, tau={self.tau}, "
                f"b_gate={self.b_gate}" + (f", unit_snap={self.unit_snap}" if self.unit_snap else "")
                + (f", phase_levels={self.phase_levels}" if self.phase_levels else "")
                + (", read_gate=True" if self.read_gate else "")
                + (", matrix_state=True" if self.matrix_state else "")
                + (f", backend={self.backend!r}" if self.backend != "auto" else ""))

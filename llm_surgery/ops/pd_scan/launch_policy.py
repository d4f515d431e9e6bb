"""How a `pd_scan` CUDA launch is configured: which forward kernel, the chunk length, the warp forward's chunk table
and repair-log capacity, and the buffer sizes that mirror the kernels' constants.

Pure Python: nothing here touches a GPU. What must come from the built extension (`ext.smem_bytes`,
`ext.warp_blocks_per_sm`) is passed in, so the choices can be checked on CPU with a stand-in. Each rule was kept
because it measured fastest on the H100 and H200; the measurements are in docs/kernels.md, "Launch policy".
`cuda.py` builds, checks and launches; it asks this module what to launch.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["REAL", "SPLIT", "CPLX", "FLOAT32", "BF16", "MIXED", "ALGOS", "WARP_MAX_N", "algo_code", "warp_slots",
           "SM90_SMEM", "smem_limit", "default_chunk", "REPAIR_MIN_T", "REPAIR_MAX_T", "REPAIR_MIN_T_BF16",
           "repair_capacity", "PROBES", "link_words", "RAMP", "chunk_ramp", "chunk_starts_on", "chunk_starts",
           "CHUNK_TABLES"]

# The kernels' constants mirrored here (tests/test_pd_scan.py reads each from its kernel file and compares)
REAL, SPLIT, CPLX = 0, 1, 2         # data layouts: kernels/pd_scan_common.cuh, enum Layout
# plane types ("forms", kernels/pd_scan.cuh): all float32, all bfloat16, or float32 D with bfloat16 b, x and gradients
# (split layout only). The rules below that name bf16 were measured on the all-bfloat16 forms; Mixed reads D rows of
# float32's size and takes float32's rules, but logs y as bfloat16 outputs do. (A bool passes as FLOAT32 / BF16.)
FLOAT32, BF16, MIXED = 0, 1, 2
ALGOS = {"block": 1, "warp": 2}     # forward kernels: kernels/pd_scan_launch.cu, ALGO_BLOCK and ALGO_WARP
WARP_MAX_N = 256                    # kernels/pd_scan_launch.cu, WARP_MAX_N (E = N / 32 <= 8 entries a lane)
REPAIR_MIN_T, REPAIR_MAX_T = 24, 512   # kernels/pd_fwd_warp.cu: the chunk lengths the repair log serves
PROBES = 10                         # clock64 probes per chunk of the forward: kernels/pd_scan_common.cuh, PROBES


def algo_code(algo: str, N: int, bwd: bool) -> int:
    """The forward kernel to launch (1 block, 2 warp), chosen here only: the kernels take the code as given. "auto"
    is the warp kernel up to N = 256, where it measured fastest at every shape, the block kernel above (the warp
    kernel cannot hold more). The backward has one kernel (the code is not used)."""
    if algo != "auto" and algo not in ALGOS:
        raise ValueError(f"pd_scan CUDA: algo must be one of ['auto', 'block', 'warp'], got {algo!r}")
    if algo == "warp" and N > WARP_MAX_N and not bwd:
        raise ValueError(f"pd_scan CUDA: the warp forward kernel takes N <= {WARP_MAX_N}, got N={N}")
    if algo == "auto":
        return ALGOS["block"] if N > WARP_MAX_N else ALGOS["warp"]
    return ALGOS[algo]


@functools.lru_cache(maxsize=None)
def warp_slots(ext, layout: int, form: int, N: int, sms: int) -> int:
    """Warps of the warp forward the GPU holds at once: `sms` times what one SM holds (`ext.warp_blocks_per_sm`, the
    CUDA occupancy API), asked once per kernel variant rather than on every call. The chunk length and the
    one-wave decisions (ramp, repair log) count against it."""
    return sms * ext.warp_blocks_per_sm(layout, int(form), N)


SM90_SMEM = 227 * 1024   # shared memory a block may have on sm_90 (H100, H200)


def smem_limit(props) -> int:
    """Shared memory a block may ask for on the device of `props` (the opt-in maximum; sm_90's where torch lacks
    the field)."""
    return getattr(props, "shared_memory_per_block_optin", None) or SM90_SMEM


def default_chunk(ext, layout: int, form: int, bwd: bool, S: int, L: int, N: int, sms: int, algo: int,
                  smem_limit: int = SM90_SMEM) -> int:
    """The chunk length (steps per block or warp) when the caller gives none; `algo` is `algo_code`'s code.

    Warp forward (shared memory independent of the chunk): about L/32 steps in [8, 128] (fewer, longer chunks
    shorten the look-back, shorter ones put more warps on an SM); past one wave of warp slots the shortest chunk of
    <= 256 steps that fits one, else the fewest whole waves of chunks <= 512 steps (the log's cap) spread evenly
    (bf16 at N <= 32 and sequences that fill a wave alone keep ~L/32); with fewer than 3.5 warps an SM halved
    down to 64 steps while a sequence keeps <= 128 chunks; doubled up to 256 steps while it has more than 256;
    raised to 32 steps (a repair log) while 3.5 warps an SM remain.
    Staged kernels (block forward, backward; `ext.smem_bytes` sizes a block): the largest chunk <= 16 steps
    within 64 KiB and >= 4 blocks an SM, not below 4 steps unless over 200 KiB; the backward's look-back chains
    set its pace for few sequences, so at N <= 64 it doubles up to 2048 / N steps (<= 64) for <= 16 sequences
    and real bf16, at N = 65-128 up to 32 steps for <= 8 sequences and real bf16, while >= 4 blocks an SM remain
    and the block fits `smem_limit`. Measurements and the shapes each rule lost at: docs/kernels.md."""
    bf16 = form == BF16
    if not bwd and algo == ALGOS["warp"]:
        slots = warp_slots(ext, layout, form, N, sms)
        chunks = lambda t: S * -(-L // t)
        T = 1 << max(3, min(7, (max(L, 1) // 32).bit_length() - 1))
        if chunks(T) > slots:
            fit = [t for t in (16, 32, 64, 128, 256) if t > T and chunks(t) <= slots]
            if fit:
                return fit[0]
            if (bf16 and N <= 32) or (S >= slots and L > REPAIR_MAX_T):
                return T
            per_seq = -(-L // REPAIR_MAX_T)   # chunks a sequence needs at least
            waves = -(-per_seq * S // slots)
            return -(-L // (waves * slots // S))
        while T > 64 and 2 * chunks(T) < 7 * sms and -(-L // (T // 2)) <= 128:
            T //= 2
        while T < 256 and -(-L // T) > 256:
            T *= 2
        while T < 32 and 2 * chunks(2 * T) >= 7 * sms:
            T *= 2
        return T
    T = 16
    while T > 4 and (ext.smem_bytes(layout, form, N, T, bwd, algo) > 64 * 1024 or S * -(-L // T) < 4 * sms):
        T //= 2
    while T > 1 and ext.smem_bytes(layout, form, N, T, bwd, algo) > 200 * 1024:
        T //= 2
    if bwd and N <= 128 and (S <= (16 if N <= 64 else 8) or (layout == REAL and bf16)):
        cap = min(64, 2048 // N) if N <= 64 else 32
        while 2 * T <= cap and S * -(-L // (2 * T)) >= 4 * sms and \
                ext.smem_bytes(layout, form, N, 2 * T, bwd, algo) <= smem_limit:
            T *= 2
    return T


REPAIR_MIN_T_BF16 = 128   # bf16 replays cost half as much: over many waves a log under 128 steps was slower


def repair_capacity(code: int, bwd: bool, form: int, T: int, N: int, one_wave: bool = False) -> int:
    """Entries per chunk of the warp forward's repair log (0: no log, every chunk replays in full) for chunks of at
    most T steps; `one_wave`: the launch's chunks all fit on the GPU at once (bf16 chunks are then logged from 24
    steps, else from 128). Random maps keep ~2N ln(T/kc) entries in all from the collapse step kc on, so T N / 8
    leaves ~2x room at T = 64 (T N / 16 lost time to full-replay fallbacks; docs/kernels.md)."""
    min_t = REPAIR_MIN_T_BF16 if form == BF16 and not one_wave else REPAIR_MIN_T
    if bwd or code != ALGOS["warp"] or not min_t <= T <= REPAIR_MAX_T:
        return 0
    return T * N // 8


def link_words(comps: int) -> int:
    """4-byte words of one chunk's record of the warp forward's look-back links (kernels/pd_fwd_warp.cu, link_words:
    k, 32 positions, 32 link words, then 32 factors and 32 sums of `comps` floats each). Every warp forward gets
    the buffer; the kernel writes it only where it compiles the links in."""
    return 68 + 64 * comps


RAMP = 0.1   # the warp forward's chunk-length ramp in one wave (swept 0-0.3: 0.1 best or within 0.5%; docs/kernels.md)


def chunk_ramp(chunk, C: int, T: int, one_wave: bool) -> float:
    """The warp forward's ramp (`RAMP`, read at each call) for a launch in C chunks a sequence of T steps, or 0.
    In one wave all chunks stream side by side, then look back and replay, the last ones furthest: chunks growing
    along the sequence let the early ones finish while later ones still stream. Only for default chunks (`chunk`
    None) of >= 32 steps in one wave, which all keep a repair log: a chunk replayed in full would replay its longer
    steps too."""
    if chunk or T < 32 or C < 2 or not one_wave or T * (1 + RAMP) > REPAIR_MAX_T:
        return 0.0
    return RAMP


def chunk_starts_on(L: int, C: int, T: int, r: float, device) -> torch.Tensor:
    """First step of each of C chunks, and L. r = 0: chunks of T steps. r > 0: lengths growing linearly along the
    sequence, chunk c's share of L proportional to 1 + r (2 u - 1) at u = (c + 1/2) / C (float64 elementwise ops,
    each correctly rounded on any device, so a table built on the GPU equals the host's)."""
    if not r:
        return torch.clamp(torch.arange(C + 1, dtype=torch.int32, device=device) * T, max=L)
    u = torch.arange(C + 1, dtype=torch.float64, device=device) / C
    return torch.round(L * (u + r * (u * u - u))).to(torch.int32)


CHUNK_TABLES: dict = {}   # (L, C, T, r, device) -> (table on device, longest chunk); at most 256 kept


def chunk_starts(L: int, C: int, T: int, r: float, device) -> tuple[torch.Tensor, int]:
    """The warp forward's chunk table on `device` and its longest chunk (which sizes the repair log). Kept per shape:
    a copy per call would cost a host round trip at every launch; inside a CUDA-graph capture (no host copies) it is
    built on the device, uncached."""
    key = (L, C, T, r, device)
    hit = CHUNK_TABLES.get(key)
    if hit is None:
        host = chunk_starts_on(L, C, T, r, "cpu")
        longest = int((host[1:] - host[:-1]).max())
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return chunk_starts_on(L, C, T, r, device), longest
        if len(CHUNK_TABLES) >= 256:
            CHUNK_TABLES.clear()
        hit = CHUNK_TABLES[key] = (host.to(device), longest)
    return hit

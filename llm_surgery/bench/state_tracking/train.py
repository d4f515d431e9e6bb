"""Train a StateTracker on one task and measure length generalisation (train on lengths <= 40, test 40..256).

Adam(W), linear warm-up then cosine decay (paper, appendix B.1); optional annealing of the straight-through
temperature for Flash PD-SSM layers. Returns a plain dict (one JSON line of results.jsonl).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from ...layers.flash_pdssm import tau_schedule
from .model import StateTracker
from .tasks import get_task

# Options that make Flash PD-SSM learn state tracking reliably (docs/bench/state_tracking.md, issue 9).
ROBUST_PDSSM = dict(b_gate="decay", x_init_std=1.0, conv_kernel=1, dict_init="permutation", decay_range=(1e-4, 1e-3))


@dataclass
class TrainConfig:
    task: str = "parity"
    kind: str = "pdssm"
    n_layers: int = 2
    d_model: int = 128
    steps: int = 100_000
    batch_size: int = 256
    lr: float = 2e-3
    weight_decay: float = 0.0
    warmup_frac: float = 0.1
    min_len: int = 1
    max_len: int = 40
    curriculum_frac: float = 0.0  # ramp the longest training length from min_len+1 to max_len over this fraction
    eval_lengths: tuple[int, ...] = tuple(range(40, 257, 24))  # 40, 64, ..., 256
    eval_batch: int = 256
    tau_start: float = 1.0  # pdssm: straight-through temperature, annealed geometrically to tau_end
    tau_end: float = 1.0
    grad_clip: float = 1.0
    seed: int = 0
    device: str = "cpu"
    eval_every: int = 0  # 0: only at the end; else also stop early once every eval length is >= stop_acc
    stop_acc: float = 1.0
    time_limit_s: float = 0.0  # > 0: stop training after this many seconds (steps_run says where)
    mixer: dict = field(default_factory=dict)  # options for the mixer (build_mixer / FlashPDSSM)

    def __post_init__(self):
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError(f"steps and batch_size must be >= 1, got {self.steps}, {self.batch_size}")
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got {self.min_len}, {self.max_len}")


def default_mixer_options(kind: str, d_model: int) -> dict:
    """Paper setup (appendix B.1): 4 heads, total state size = width; complex Flash PD-SSM."""
    if kind == "pdssm":
        return dict(num_heads=4, state_size=d_model // 4, complex=True)
    if kind == "mamba2":
        return dict(num_heads=4, head_dim=2 * d_model // 4, state_size=d_model // 4)
    if kind == "deltanet":
        return dict(num_heads=4, head_dim=d_model // 4)
    raise ValueError(f"unknown kind {kind!r}; choose from pdssm, mamba2, deltanet")


def lr_at(step: int, cfg: TrainConfig) -> float:
    warm = max(1, int(cfg.warmup_frac * cfg.steps))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    frac = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))


def max_train_len(step: int, cfg: TrainConfig) -> int:
    """Curriculum: short words carry the learning signal for products of many symbols (the gradient through
    a product of L random choices shrinks with L), so the longest length grows linearly at first."""
    if cfg.curriculum_frac <= 0:
        return cfg.max_len
    frac = min(1.0, step / (cfg.curriculum_frac * cfg.steps))
    return max(cfg.min_len + 1, min(cfg.max_len, round(cfg.min_len + 1 + frac * (cfg.max_len - cfg.min_len - 1))))


@torch.no_grad()
def evaluate(model: StateTracker, task, lengths, batch: int, generator: torch.Generator, device) -> dict[int, float]:
    """Accuracy of the final-state prediction at each length."""
    model.eval()
    out = {}
    for L in lengths:
        if task.odd_lengths and L % 2 == 0:
            L = L + 1 if L < max(lengths) else L - 1
        tokens, labels = task.batch(batch, L, L, generator)
        pred = model(tokens.to(device)).argmax(-1).cpu()
        out[L] = (pred == labels).float().mean().item()
    model.train()
    return out


def build_model(cfg: TrainConfig) -> StateTracker:
    task = get_task(cfg.task)
    opts = {**default_mixer_options(cfg.kind, cfg.d_model), **cfg.mixer}
    return StateTracker(task.vocab_size, task.num_classes, d_model=cfg.d_model, n_layers=cfg.n_layers,
                        kind=cfg.kind, **opts)


def train(cfg: TrainConfig, log=None) -> dict:
    """Train from `cfg.seed` and return a results dict (config, final loss, accuracy per eval length)."""
    task = get_task(cfg.task)
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    device = torch.device(cfg.device)
    model = build_model(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    t0, losses, stopped = time.time(), [], cfg.steps
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        if cfg.tau_start != cfg.tau_end:
            model.set_tau(tau_schedule(step, cfg.steps, cfg.tau_start, cfg.tau_end))
        tokens, labels = task.batch(cfg.batch_size, cfg.min_len, max_train_len(step, cfg), gen)
        loss = F.cross_entropy(model(tokens.to(device)), labels.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        losses.append(loss.item())
        if cfg.time_limit_s and time.time() - t0 > cfg.time_limit_s:
            stopped = step + 1
            break
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0:
            acc = evaluate(model, task, cfg.eval_lengths, cfg.eval_batch, gen, device)
            if log:
                log(f"{cfg.task} {cfg.kind} seed {cfg.seed} step {step + 1} loss {sum(losses[-50:]) / len(losses[-50:]):.4f} "
                    f"acc {min(acc.values()):.3f}..{max(acc.values()):.3f} ({time.time() - t0:.0f}s)")
            if min(acc.values()) >= cfg.stop_acc:
                stopped = step + 1
                break
    eval_gen = torch.Generator().manual_seed(10_000 + cfg.seed)  # held-out stream
    acc = evaluate(model, task, cfg.eval_lengths, cfg.eval_batch, eval_gen, device)
    return {
        "task": cfg.task, "kind": cfg.kind, "seed": cfg.seed, "steps_run": stopped,
        "train_loss": sum(losses[-50:]) / len(losses[-50:]), "acc_mean": sum(acc.values()) / len(acc),
        "acc_max_len": acc[max(acc)], "acc": {str(k): v for k, v in acc.items()},
        "seconds": round(time.time() - t0, 1), "params": sum(p.numel() for p in model.parameters()),
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()},
    }


def train_one_thread(cfg: TrainConfig) -> dict:
    """`train` with one torch thread: the worker of parallel sweeps (`--jobs`)."""
    torch.set_num_threads(1)
    return train(cfg)

"""Train a StateTracker on one task and measure length generalisation (train on lengths <= 40, test 40..256).

Adam(W), linear warm-up then cosine decay (paper, appendix B.1); optional annealing of the straight-through
temperature for Flash PD-SSM layers. Returns a plain dict (one JSON line of results.jsonl).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from ...layers.flash_pdssm import tau_schedule
from . import group_image
from .graphed_step import GraphedTrainStep, optimizer_step
from .model import StateTracker
from .resume import config_dict, load_result, load_run, save_result, save_run
from .tasks import get_task

# Options that make Flash PD-SSM learn state tracking reliably (docs/bench/state_tracking.md).
ROBUST_PDSSM = dict(b_gate="decay", x_init_std=1.0, conv_kernel=1, dict_init="noisy_permutation",
                    decay_range=(1e-4, 1e-3))
# Two or more complex layers (Table 1): magnitudes that can reach exactly 1, phases on a grid of
# 2 pi / 60 (exact rotations for cycles of 2, 3, 4, 5, 6), no convolution. What broke length generalisation was
# drift: a decay of 1e-2 or a phase off by 0.02 rad costs nothing at length 40 and everything at 256.
TRACKING_PDSSM = dict(unit_snap=0.01, phase_levels=60, conv_kernel=1)
# The tracking options plus what Proposition 1's automaton needs, a learned start state and entries
# that keep their value (|D| = 1) taking no input (b_gate="decay"), trained with Adam's epsilon at 1e-6
# (PRESET_TRAINING). Table 1, H200, 10 seeds: 93.4% validation-selected (87.6% final weights) against the
# tracking options' 91.5% (84.0%); parity 98.2% against 88.6%.
AUTOMATON_PDSSM = dict(TRACKING_PDSSM, b_gate="decay", x_init_std=1.0)
PDSSM_PRESETS = {"layer": {}, "robust": ROBUST_PDSSM, "tracking": TRACKING_PDSSM, "automaton": AUTOMATON_PDSSM}
# Training options that belong to a preset (TrainConfig fields); explicit arguments override them.
PRESET_TRAINING = {"automaton": dict(adam_eps=1e-6)}
# The CLI's default for pdssm: "robust" for one layer, "automaton" for deeper models. Measured
# (docs/bench/state_tracking.md): one layer learns and length-generalises state tracking only with the robust
# options; with two complex layers (Table 1) see AUTOMATON_PDSSM.
DEFAULT_PRESET = "auto"


def preset_for(n_layers: int, preset: str | None = None) -> str:
    """Resolve the pdssm preset name ("auto" or None -> by depth, see DEFAULT_PRESET)."""
    preset = preset or DEFAULT_PRESET
    if preset == "auto":
        return "robust" if n_layers == 1 else "automaton"
    if preset not in PDSSM_PRESETS:
        raise ValueError(f"unknown pdssm preset {preset!r}; choose from auto, {', '.join(PDSSM_PRESETS)}")
    return preset


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
    # Adam's epsilon: the gradient size below which its steps shrink. With the loss at ~1e-6 for most of a run,
    # PyTorch's 1e-8 keeps Adam stepping at the full learning rate on gradient noise. In Table 1, parity reached
    # 97.8-98.7% in all four 5-seed sweeps with 1e-6 or 1e-5, 88.6% (10 seeds) with 1e-8
    # (docs/bench/state_tracking.md).
    adam_eps: float = 1e-8
    warmup_frac: float = 0.1
    min_len: int = 1
    max_len: int = 40
    curriculum_frac: float = 0.0  # ramp the longest training length from min_len+1 to max_len over this fraction
    curriculum_mode: str = "linear"  # "adaptive": grow the longest length only while the model keeps up
    curriculum_threshold: float = 0.3  # adaptive: raise when the loss at the longest length is below this (nats)
    curriculum_step: int = 2  # adaptive: raise by this much per check (every ADAPT_EVERY steps)
    eval_lengths: tuple[int, ...] = tuple(range(40, 257, 24))  # 40, 64, ..., 256
    eval_batch: int = 256
    tau_start: float = 1.0  # pdssm: straight-through temperature, annealed geometrically to tau_end
    tau_end: float = 1.0
    grad_clip: float = 1.0
    seed: int = 0
    device: str = "cpu"
    eval_every: int = 0  # > 0: TrainRun.validate every K steps (keeps the best weights); stop once all >= stop_acc
    stop_acc: float = 1.0
    time_limit_s: float = 0.0  # > 0: stop after this many seconds of training; schedules then run on time
    ema_decay: float = 0.0  # > 0: keep an exponential moving average of the weights; validation judges (and keeps) it
    restarts: int = 1  # > 1: train this many candidates briefly, continue the best by training loss
    restart_frac: float = 0.1  # fraction of the run (steps or time) each candidate trains before selection
    # A run that ends unfit (needs_retry: training loss above retry_loss after its whole budget) is trained again
    # from a new seed, up to `retries` times; `attempt` numbers the tries (its seed: candidate_seed).
    retries: int = 0
    retry_loss: float = 1e-3
    attempt: int = 0
    mixer: dict = field(default_factory=dict)  # options for the mixer (build_mixer / FlashPDSSM)
    name: str = ""  # a label for reports (e.g. a named variant of the options)
    cuda_graphs: bool = True  # CUDA: replay each step as a graph (graphed_step.py); not while tau anneals

    def __post_init__(self):
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError(f"steps and batch_size must be >= 1, got {self.steps}, {self.batch_size}")
        if self.restarts < 1 or not 0 < self.restart_frac < 1:
            raise ValueError(f"need restarts >= 1 and 0 < restart_frac < 1, got {self.restarts}, {self.restart_frac}")
        if self.retries < 0 or self.attempt < 0 or not self.retry_loss > 0.0:
            raise ValueError(f"need retries >= 0, attempt >= 0 and retry_loss > 0, got {self.retries}, "
                             f"{self.attempt}, {self.retry_loss}")
        if not self.adam_eps > 0.0:
            raise ValueError(f"adam_eps must be > 0, got {self.adam_eps}")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1), got {self.ema_decay}")
        if self.ema_decay and not self.eval_every:
            raise ValueError("ema_decay needs eval_every > 0: the averaged weights are judged and kept by validation")
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got {self.min_len}, {self.max_len}")
        if self.curriculum_mode not in ("linear", "adaptive") or self.curriculum_step < 1:
            raise ValueError(f"curriculum_mode must be linear or adaptive and curriculum_step >= 1, got "
                             f"{self.curriculum_mode!r}, {self.curriculum_step}")


def default_mixer_options(kind: str, d_model: int) -> dict:
    """Paper setup (appendix B.1): 4 heads, total state size = width; complex Flash PD-SSM."""
    if kind == "pdssm":
        return dict(num_heads=4, state_size=d_model // 4, complex=True)
    if kind == "mamba2":
        return dict(num_heads=4, head_dim=2 * d_model // 4, state_size=d_model // 4)
    if kind == "deltanet":
        return dict(num_heads=4, head_dim=d_model // 4)
    raise ValueError(f"unknown kind {kind!r}; choose from pdssm, mamba2, deltanet")


# The CLI's defaults per kind beyond the paper setup (pdssm: preset, curriculum, one retry of a run that ends
# unfit: Table 1, 29 seeds, 4 of 116 runs retried, 96.1% -> 97.2%); measurements in docs/bench/state_tracking.md.
# The other kinds train exactly as in appendix B.1.
KIND_DEFAULTS = {"pdssm": dict(curriculum_frac=0.3, retries=1)}

# One-layer sizes for the group word problems: real Flash PD-SSM, 16 heads whose state size is the
# number of points the group permutes; the options not named here are the CLI defaults above.
ONE_LAYER_RECIPES = {
    "s3_gen": dict(n_layers=1, d_model=64, mixer=dict(num_heads=16, state_size=3, dict_size=8, complex=False)),
    # element tokens: a head needs every one of the group's permutations among its members, and a member no token
    # selects gets no gradient, so the members start all different ("distinct"; random ones with repeats left S3
    # one permutation short in 3 of 5 seeds: docs/bench/state_tracking.md)
    "s3": dict(n_layers=1, d_model=64, mixer=dict(num_heads=16, state_size=3, dict_size=8, complex=False,
                                                  dict_init="distinct")),
    "a5_gen": dict(n_layers=1, d_model=80, mixer=dict(num_heads=16, state_size=5, dict_size=4, complex=False)),
    # A5 is simple, so a head tracks all 60 elements or none, and each token selects one member: K >= 60 (the
    # paper's K = |alphabet|; with K = 8 no head can: group_image.py, BENCHMARKS.md). Its natural action needs all
    # 60 even permutations of 5 entries among the members: K = 120 distinct members are every permutation.
    "a5": dict(n_layers=1, d_model=80, mixer=dict(num_heads=4, state_size=5, dict_size=120, complex=False,
                                                  dict_init="distinct")),
}


def cli_defaults(kind: str = "pdssm", preset: str | None = None, **overrides) -> TrainConfig:
    """A TrainConfig with the CLI's defaults for `kind` (pdssm: the preset's options under `overrides["mixer"]`,
    plus KIND_DEFAULTS); any other field from `overrides` (None = default)."""
    fields = dict(KIND_DEFAULTS.get(kind, {}))
    fields.update({k: v for k, v in overrides.items() if v is not None and k != "mixer"})
    mixer = dict(overrides.get("mixer") or {})
    if kind == "pdssm":
        name = preset_for(fields.get("n_layers", TrainConfig.n_layers), preset)
        mixer = {**PDSSM_PRESETS[name], **mixer}
        fields = {**PRESET_TRAINING.get(name, {}), **fields}
    return TrainConfig(kind=kind, mixer=mixer, **fields)


def lr_at(frac: float, cfg: TrainConfig) -> float:
    """Learning rate at `frac` (0..1) of the run: linear warm-up, then cosine decay to 0."""
    if frac < cfg.warmup_frac:
        return cfg.lr * min(1.0, (frac + 1.0 / cfg.steps) / cfg.warmup_frac)
    rest = (frac - cfg.warmup_frac) / max(1e-9, 1.0 - cfg.warmup_frac)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, rest)))


def max_train_len(frac: float, cfg: TrainConfig) -> int:
    """Curriculum: short words carry the learning signal for products of many symbols (the gradient through
    a product of L random choices shrinks with L), so the longest length grows linearly at first."""
    if cfg.curriculum_frac <= 0:
        return cfg.max_len
    ramp = min(1.0, frac / cfg.curriculum_frac)
    return max(cfg.min_len + 1, min(cfg.max_len, round(cfg.min_len + 1 + ramp * (cfg.max_len - cfg.min_len - 1))))


ADAPT_EVERY = 25  # steps between checks of the adaptive curriculum (the loss read-back cadence)


def adapt_len(cur: int, loss: float, cfg: TrainConfig) -> int:
    """Adaptive curriculum: raise the longest training length by `curriculum_step` (up to max_len) when the loss
    on words of the current longest length is below `curriculum_threshold`, else hold it. A fixed ramp can
    outrun a model that is half-way to a group (A5 collapsed to chance when the words grew)."""
    return min(cfg.max_len, cur + cfg.curriculum_step) if loss < cfg.curriculum_threshold else cur


def progress(step: int, seconds: float, cfg: TrainConfig) -> float:
    """Fraction of the run done: by steps, or by training time under a time limit, whichever is further. The
    schedules (lr, curriculum, tau) are functions of it, so a time-limited run still warms up, decays and
    finishes its curriculum instead of being cut off at a high learning rate."""
    frac = step / cfg.steps
    if cfg.time_limit_s:
        frac = max(frac, seconds / cfg.time_limit_s)
    return min(1.0, frac)


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


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on the weights of linear maps only: not on the embedding, norms, biases or the recurrence's
    own parameters (a decay bias pulled to 0 would pull every |D| to 1/2)."""
    linear = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    params = list(model.parameters())
    return [{"params": [p for p in params if id(p) in linear], "weight_decay": weight_decay},
            {"params": [p for p in params if id(p) not in linear], "weight_decay": 0.0}]


class TrainRun:
    """One model with its optimizer, data stream and clock; `advance` trains it up to a fraction of the run."""

    def __init__(self, cfg: TrainConfig, seed: int, task, device):
        self.cfg, self.seed, self.task, self.device = cfg, seed, task, device
        torch.manual_seed(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.model = build_model(cfg).to(device)
        # a step depends on tau only through kernel arguments, which a captured graph freezes
        self.graphed = cfg.cuda_graphs and device.type == "cuda" and cfg.tau_start == cfg.tau_end
        # graphed: optimizer state and learning rate on the GPU, so the graph reads them at each replay
        lr = torch.tensor(cfg.lr, device=device) if self.graphed else cfg.lr
        self.opt = torch.optim.AdamW(param_groups(self.model, cfg.weight_decay), lr=lr, eps=cfg.adam_eps,
                                     capturable=self.graphed)
        if self.graphed:
            self.graphed_step = GraphedTrainStep(self.model, self.opt, cfg.grad_clip)
        self.step, self.seconds, self.losses, self.done = 0, 0.0, [], False
        self.solved = False  # validation reached stop_acc at every length (the run stopped early)
        self.paused = False  # advance stopped at its deadline (resume.py continues the run)
        self.run_dir = None  # set: a checkpoint after every validation (resume.save_run)
        self.pending: list[torch.Tensor] = []  # losses of recent steps not read back yet
        self.adaptive = cfg.curriculum_mode == "adaptive"
        self.cur_len = min(cfg.max_len, cfg.min_len + 1)  # adaptive curriculum: the longest training length now
        self.probe_gen = torch.Generator().manual_seed(seed + 12_345)  # its checks do not shift the data stream
        self.val_curve: list[tuple[int, float]] = []  # (step, mean validation accuracy)
        self.best_state, self.best_val, self.best_step = None, -1.0, 0
        self.params = [p for p in self.model.parameters()]
        self.ema = [p.detach().clone() for p in self.params] if cfg.ema_decay else None

    def frac(self) -> float:
        return progress(self.step, self.seconds, self.cfg)

    def max_len(self) -> int:
        return self.cur_len if self.adaptive else max_train_len(self.frac(), self.cfg)

    @torch.no_grad()
    def adapt(self) -> None:
        """One check of the adaptive curriculum on a fresh batch of words of exactly the current longest length."""
        tokens, labels = self.task.batch(self.cfg.batch_size, self.cur_len, self.cur_len, self.probe_gen)
        loss = F.cross_entropy(self.model(tokens.to(self.device)), labels.to(self.device)).item()
        self.cur_len = adapt_len(self.cur_len, loss, self.cfg)

    def train_step(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One optimizer step on a batch at the current learning rate; the loss as a device tensor."""
        tokens, labels = tokens.to(self.device), labels.to(self.device)
        if self.graphed:
            return self.graphed_step(tokens, labels).clone()
        return optimizer_step(self.model, self.opt, self.cfg.grad_clip, tokens, labels)

    def set_lr(self, lr: float) -> None:
        for group in self.opt.param_groups:
            if torch.is_tensor(group["lr"]):
                group["lr"].fill_(lr)  # in place: captured graphs read this tensor
            else:
                group["lr"] = lr

    def read_losses(self) -> None:
        if self.pending:
            self.losses = (self.losses + torch.stack(self.pending).tolist())[-50:]
            self.pending.clear()

    def advance(self, until: float, log=None, deadline: float | None = None) -> None:
        """Train until progress >= `until` (or early stop), or pause once past the wall-clock `deadline` (after one
        step at least). Losses are read back every 25 steps only: one device sync per step would serialise the many
        small runs that share a GPU."""
        cfg, model = self.cfg, self.model
        t0 = time.time() - self.seconds
        self.paused = False
        while not self.done and self.frac() < until:
            frac = self.frac()
            self.set_lr(lr_at(frac, cfg))
            if cfg.tau_start != cfg.tau_end:
                model.set_tau(tau_schedule(frac, 1.0, cfg.tau_start, cfg.tau_end))
            tokens, labels = self.task.batch(cfg.batch_size, cfg.min_len, self.max_len(), self.gen)
            self.pending.append(self.train_step(tokens, labels))
            if self.ema is not None:  # outside the captured graph: one fused update of all averages
                with torch.no_grad():
                    torch._foreach_lerp_(self.ema, self.params, 1.0 - cfg.ema_decay)
            self.step += 1
            self.seconds = time.time() - t0
            if len(self.pending) == 25:
                self.read_losses()
            if self.adaptive and self.step % ADAPT_EVERY == 0:
                self.adapt()
            if cfg.eval_every and self.step % cfg.eval_every == 0:
                acc = self.validate()
                if log:
                    log(f"{cfg.task} {cfg.kind} seed {self.seed} step {self.step} loss {self.train_loss():.4f} "
                        f"len {self.max_len()} val {min(acc.values()):.3f}..{max(acc.values()):.3f} "
                        f"({self.seconds:.0f}s)")
                self.solved = self.done = min(acc.values()) >= cfg.stop_acc
            self.done = self.done or self.step >= cfg.steps or (cfg.time_limit_s and self.seconds >= cfg.time_limit_s)
            if self.run_dir and cfg.eval_every and self.step % cfg.eval_every == 0:
                self.read_losses()
                save_run(self, self.run_dir)
            if deadline is not None and not self.done and time.time() >= deadline:
                self.paused = True  # (after a step: every call makes progress)
                break
        self.read_losses()

    @torch.no_grad()
    def validate(self) -> dict[int, float]:
        """Accuracy per eval length on a validation set: the same sequences at every call, drawn from a stream
        apart from the training data and the final test set. The weights with the best mean so far are kept,
        as the baselines' training code (Walker et al. 2025, the paper's Table 1 protocol) validates on lengths
        40..256 during training; `train` reports the kept weights on the test set beside the final ones."""
        gen = torch.Generator().manual_seed(VAL_SEED + self.seed)
        live = None
        if self.ema is not None:  # judge the averaged weights: copied in place (captured graphs keep addresses)
            live = [p.detach().clone() for p in self.params]
            torch._foreach_copy_(self.params, self.ema)
        acc = evaluate(self.model, self.task, self.cfg.eval_lengths, self.cfg.eval_batch, gen, self.device)
        mean = sum(acc.values()) / len(acc)
        self.val_curve.append((self.step, round(mean, 5)))
        if mean > self.best_val:
            self.best_val, self.best_step = mean, self.step
            self.best_state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        if live is not None:
            torch._foreach_copy_(self.params, live)
        return acc

    def train_loss(self) -> float:
        return sum(self.losses) / len(self.losses) if self.losses else float("nan")

    @torch.no_grad()
    def selection_loss(self, batches: int = 4) -> float:
        """Loss on fresh batches from the current training distribution (lengths <= the curriculum's current
        maximum), the same batches for every candidate: model selection on training data, not test lengths."""
        gen = torch.Generator().manual_seed(1)
        self.model.eval()
        max_len = self.max_len()
        total = 0.0
        for _ in range(batches):
            tokens, labels = self.task.batch(self.cfg.batch_size, self.cfg.min_len, max_len, gen)
            total += F.cross_entropy(self.model(tokens.to(self.device)), labels.to(self.device)).item()
        self.model.train()
        return total / batches


VAL_SEED = 20_000  # validation sequences: generator seed VAL_SEED + run seed (test: held_out_generator)


def held_out_generator(seed: int) -> torch.Generator:
    """The held-out test sequences of a run (the same for its final and its validation-selected weights)."""
    return torch.Generator().manual_seed(10_000 + seed)


def candidate_seed(seed: int, r: int, attempt: int = 0) -> int:
    """Seed of restart candidate r of try `attempt`; candidate 0 of try 0 is the run's own seed (restarts=1 and
    retries=0 is the plain run)."""
    return seed + 1_000_003 * r + 7_000_003 * attempt


def needs_retry(result: dict, retry_loss: float) -> bool:
    """A finished run is unfit when it used its whole budget without solving validation and its training loss
    (mean of the last 50 steps) is still above `retry_loss`: it never fitted its own training lengths. Decided
    on training data alone; results of older runs without "solved" count as solved when validation was perfect."""
    solved = result.get("solved", result.get("val_best", 0.0) >= result["config"]["stop_acc"])
    return not solved and not result["train_loss"] <= retry_loss   # a NaN loss is unfit too


def train(cfg: TrainConfig, log=None, run_dir: str | None = None, deadline: float | None = None) -> dict:
    """`train_once`, then, while the result needs_retry and tries remain (`cfg.retries`), again from the next
    attempt's seed (with `run_dir`: in `<run_dir>-attempt<k>`). The returned result is the last try's, with
    the earlier tries summarised under "earlier_attempts"."""
    result = train_once(cfg, log, run_dir, deadline)
    if result.get("paused") or cfg.attempt >= cfg.retries or not needs_retry(result, cfg.retry_loss):
        return result
    retry = replace(cfg, attempt=cfg.attempt + 1)
    if log:
        log(f"{cfg.task} {cfg.kind} seed {cfg.seed}: unfit (loss {result['train_loss']:.3g}); try {retry.attempt} "
            f"from seed {candidate_seed(cfg.seed, 0, retry.attempt)}")
    if run_dir is not None:   # the first try's folder, then <it>-attempt<k> (resume.run_dir_name's form)
        base = str(run_dir).removesuffix(f"-attempt{cfg.attempt}") if cfg.attempt else str(run_dir)
        run_dir = f"{base}-attempt{retry.attempt}"
    nxt = train(retry, log, run_dir, deadline)
    if not nxt.get("paused"):
        brief = {k: result.get(k) for k in ("chosen_seed", "train_loss", "acc_mean", "acc_selected_mean", "steps_run")}
        nxt["earlier_attempts"] = [brief] + nxt.get("earlier_attempts", [])
    return nxt


def train_once(cfg: TrainConfig, log=None, run_dir: str | None = None, deadline: float | None = None) -> dict:
    """Train from `cfg.seed` (try `cfg.attempt`) and return a results dict (config, final loss, accuracy per eval
    length).

    With `cfg.restarts = R > 1`, R candidates (seeds `candidate_seed(seed, r)`) each train the first
    `restart_frac` of the run; the one with the lowest training-distribution loss continues to the end.
    Under a time limit every candidate has its own clock, so the training time is at most
    time_limit_s * (1 + (R - 1) * restart_frac).

    With `run_dir` the run is resumable (resume.py): it continues from the checkpoint there, writes one after
    every validation, and at the wall-clock `deadline` (time.time() seconds) it saves and returns
    {"paused": True, ...} instead of results; a finished run's results are kept there and returned again."""
    if run_dir is not None:
        if cfg.restarts > 1:
            raise ValueError("a resumable run (run_dir) needs restarts == 1")
        if not cfg.eval_every:
            raise ValueError("a resumable run (run_dir) needs eval_every > 0: it checkpoints at each validation")
        done = load_result(cfg, run_dir)
        if done is not None:
            return done
    task = get_task(cfg.task)
    device = torch.device(cfg.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # the graphs' stream (graphed_step.py) and kernels on the run's own GPU
    t_start = time.time()
    best, sel_losses = None, []
    for r in range(cfg.restarts):
        run = TrainRun(cfg, candidate_seed(cfg.seed, r, cfg.attempt), task, device)
        if cfg.restarts > 1:
            run.advance(cfg.restart_frac, log)
            sel_losses.append(run.selection_loss())
            if log:
                log(f"{cfg.task} {cfg.kind} seed {cfg.seed} candidate {r}: loss {sel_losses[-1]:.4f} "
                    f"at step {run.step}")
        if best is None or sel_losses[-1] < min(sel_losses[:-1]):
            best = run  # only the best candidate so far is kept
        del run
    run = best
    if run_dir is not None:
        run.run_dir = run_dir
        if load_run(run, run_dir) and log:
            log(f"{cfg.task} {cfg.kind} seed {cfg.seed}: resumed at step {run.step} from {run_dir}")
    run.advance(1.0, log, deadline)
    if run_dir is not None:
        save_run(run, run_dir)  # paused, or the final weights (the evaluation below loads the selected ones)
    if run.paused:
        return {"paused": True, "task": cfg.task, "kind": cfg.kind, "seed": cfg.seed, "steps_run": run.step,
                "train_seconds": round(run.seconds, 1), "run_dir": str(run_dir)}
    acc = evaluate(run.model, task, cfg.eval_lengths, cfg.eval_batch, held_out_generator(cfg.seed), device)
    selected = {}
    if run.best_state is not None:  # validation-selected weights, on the same test sequences
        if run.val_curve[-1][0] != run.step:
            run.validate()  # the final weights compete too
        sel = acc  # the final weights won: already evaluated
        if run.best_step != run.step or run.ema is not None:
            run.model.load_state_dict(run.best_state)
            sel = evaluate(run.model, task, cfg.eval_lengths, cfg.eval_batch, held_out_generator(cfg.seed), device)
        selected = {"acc_selected_mean": sum(sel.values()) / len(sel),
                    "acc_selected": {str(k): v for k, v in sel.items()},
                    "val_best": run.best_val, "val_best_step": run.best_step, "val_curve": run.val_curve}
    result = {
        "task": cfg.task, "kind": cfg.kind, "seed": cfg.seed, "steps_run": run.step,
        "train_loss": run.train_loss(), "train_max_len": run.max_len(), "acc_mean": sum(acc.values()) / len(acc),
        "acc_max_len": acc[max(acc)], "acc": {str(k): v for k, v in acc.items()},
        "chosen_seed": run.seed, "restart_losses": sel_losses, "solved": run.solved,
        "graphed": run.graphed and run.graphed_step.failed is None,
        "seconds": round(time.time() - t_start, 1), "train_seconds": round(run.seconds, 1),
        "params": sum(p.numel() for p in run.model.parameters()), **selected, "config": config_dict(cfg),
    }
    if group_image.readable(run.model, task):  # what the (selected) dictionary does on a group word problem
        result["group_image"] = group_image.summary(run.model, task)
    if run_dir is not None:
        save_result(result, run_dir)
    return result


def quick_triton_autotune() -> bool:
    """Triton autotuners (mamba-ssm, fla) keep the leanest config that runs: full autotuning of Mamba2's ~20 SSD
    kernels took the whole budget of parallel GPU runs. False where Triton is missing."""
    from llm_surgery.triton_autotune import quick_autotune
    return quick_autotune()


def train_one_thread(cfg: TrainConfig, run_dir: str | None = None, deadline: float | None = None) -> dict:
    """`train` with one torch thread: the worker of parallel sweeps (`--jobs`)."""
    torch.set_num_threads(1)
    return train(cfg, run_dir=run_dir, deadline=deadline)

"""One MAD training run and its evaluation, by MAD's protocol.

MAD (its train.py and MADConfig): a fixed training set (12,800 sequences; memorize 256), batches of 128 in a
fresh random order each epoch, 200 epochs, AdamW (torch's defaults but the learning rate and weight decay),
cosine decay of the learning rate to 1e-6, no warm-up, no gradient clipping, cross-entropy over the scored
targets; the final weights are evaluated on a separate test set of 1,280 sequences. Here the cosine runs per
step (MAD steps it per epoch), and `max_steps` can cut a run short (a reduced protocol: the schedule then
decays over the shorter run). A held-out validation set (1,280 more sequences, never trained on) serves the
choice of the learning rate, which MAD makes on the test set.

Accuracy is reported twice: `acc` is MAD's metric (torchmetrics' MulticlassAccuracy as MAD configures it: per
class of target token the share of its positions predicted right, averaged over the classes that occur as a
target or a prediction), `acc_token` the share of scored positions predicted right.
"""

from __future__ import annotations

import math
import platform
import time
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache

import torch
import torch.nn.functional as F

from .model import MADModel, check_kind
from .tasks import IGNORE, NUM_TEST, TASKS, Task

MAD_EPOCHS = 200
SPLITS = {"train": 0, "validation": 1, "test": 2}  # the data streams (SeedSequence(data_seed, index))


@dataclass
class RunConfig:
    task: str
    kind: str
    seed: int = 0
    lr: float = 5e-4
    weight_decay: float = 0.0
    max_steps: int | None = None  # None: MAD's full protocol (MAD_EPOCHS epochs)
    batch_size: int = 128
    min_lr: float = 1e-6
    d_model: int = 128
    n_layers: int = 2
    device: str = "cpu"
    data_seed: int = 12345  # MADConfig's seed: the data are the same for every model seed
    eval_examples: int = NUM_TEST  # capped at the sequences a run trains on (a smoke run of a few steps)
    validate: bool = True  # evaluate on the validation set too (needed only to choose among learning rates)
    cuda_graphs: bool = True  # CUDA: replay each training step as one graph (llm_surgery.cuda_graphs)
    settings: dict = field(default_factory=dict)  # task settings other than MAD's baseline (vocab_size, seq_len...)
    num_train: int | None = None  # training set size other than MAD's

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}; choose from {', '.join(TASKS)}")
        check_kind(self.kind)
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")
        if not (self.lr > 0 and math.isfinite(self.lr)) or not self.weight_decay >= 0:
            raise ValueError(f"need lr > 0 and weight_decay >= 0, got {self.lr}, {self.weight_decay}")
        if self.batch_size < 1 or self.eval_examples < 1:
            raise ValueError(f"batch_size and eval_examples must be >= 1, got {self.batch_size}, "
                             f"{self.eval_examples}")

    @property
    def task_spec(self) -> Task:
        """The task at MAD's baseline setting, with this run's `settings` and `num_train` in place of MAD's."""
        base = TASKS[self.task]
        return replace(base, settings={**base.settings, **self.settings}, num_train=self.num_train or base.num_train)

    @property
    def full_steps(self) -> int:
        """MAD's number of optimizer steps for this task: 200 epochs of the whole training set."""
        return MAD_EPOCHS * math.ceil(self.task_spec.num_train / self.batch_size)

    @property
    def steps(self) -> int:
        return min(self.full_steps, self.max_steps or self.full_steps)


def dataset(task: Task, split: str, n: int, data_seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of one split, CPU int64; training targets are MAD's training ones (every next token for
    the recall tasks), validation and test targets the scored positions only. Cached: every run of a process
    that shares a task's setting shares its data."""
    return _dataset(task.name, tuple(sorted(task.settings.items())), split, n, data_seed)


@lru_cache(maxsize=32)
def _dataset(name: str, settings: tuple, split: str, n: int, data_seed: int):
    task = replace(TASKS[name], settings=dict(settings))
    x, y = task.sample(n, split == "train", (data_seed, SPLITS[split]))
    return torch.from_numpy(x).long(), torch.from_numpy(y).long()


def build_model(cfg: RunConfig) -> MADModel:
    task = cfg.task_spec
    return MADModel(cfg.kind, task.vocab_size, task.settings["seq_len"], cfg.d_model, cfg.n_layers,
                    autoencoder=task.autoencoder)


def lr_at(step: int, cfg: RunConfig) -> float:
    """Cosine decay from cfg.lr at step 0 to cfg.min_lr at the last step (MAD's CosineAnnealingLR)."""
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))


def loss_fn(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE)


@torch.no_grad()
def evaluate(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, vocab_size: int,
             batch: int = 256) -> dict:
    """{"acc": MAD's class-averaged accuracy, "acc_token": share of scored positions right, "scored": count}."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    tp, fn, fp = (torch.zeros(vocab_size, dtype=torch.long, device=device) for _ in range(3))
    for i in range(0, len(inputs), batch):
        y = targets[i:i + batch].to(device)
        pred = model(inputs[i:i + batch].to(device)).argmax(-1)
        scored = y != IGNORE
        p, t = pred[scored], y[scored]
        hit = p == t
        tp += torch.bincount(t[hit], minlength=vocab_size)
        fn += torch.bincount(t[~hit], minlength=vocab_size)
        fp += torch.bincount(p[~hit], minlength=vocab_size)
    model.train(was_training)
    occurs = (tp + fp + fn) > 0
    per_class = tp.double() / (tp + fn).clamp(min=1).double()
    total = int((tp + fn).sum())
    return {"acc": float(per_class[occurs].mean()) if occurs.any() else 0.0,
            "acc_token": float(tp.sum()) / total if total else 0.0, "scored": total}


def train(cfg: RunConfig, log=None) -> dict:
    """Train one model by MAD's protocol (`max_steps` may cut it short) and evaluate its final weights on the
    test set (and the validation set: `validate`); one JSON-able row."""
    t0 = time.time()
    task = cfg.task_spec
    device = torch.device(cfg.device)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg).to(device)
    steps = cfg.steps
    # a run of fewer steps than one epoch sees each sequence once: so many fresh ones are the same draw
    n_train = min(task.num_train, steps * cfg.batch_size)
    x_train, y_train = (t.to(device) for t in dataset(task, "train", n_train, cfg.data_seed))
    graphed = cfg.cuda_graphs and device.type == "cuda"
    lr = torch.tensor(cfg.lr, device=device) if graphed else cfg.lr  # a graph reads its lr from device memory
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg.weight_decay, capturable=graphed)

    def step_body(tokens, targets):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, tokens, targets)
        loss.backward()
        opt.step()
        return loss.detach()

    if graphed:
        from ...cuda_graphs import GraphedByShape
        step_fn = GraphedByShape(step_body, name="MAD step")
    else:
        step_fn = step_body
    gen = torch.Generator().manual_seed(cfg.seed)
    losses, step = [], 0
    while step < steps:
        order = torch.randperm(n_train, generator=gen).to(device)
        for start in range(0, n_train, cfg.batch_size):
            if step >= steps:
                break
            for group in opt.param_groups:
                if graphed:
                    group["lr"].fill_(lr_at(step, cfg))
                else:
                    group["lr"] = lr_at(step, cfg)
            idx = order[start:start + cfg.batch_size]
            losses.append(step_fn(x_train[idx], y_train[idx]).clone())
            step += 1
            losses = losses[-20:]
            if log and step % 500 == 0:
                log(f"{cfg.kind} {cfg.task} seed {cfg.seed} lr {cfg.lr:g}: step {step}/{steps} "
                    f"loss {torch.stack(losses).mean().item():.4f}")
    train_seconds = time.time() - t0
    row = {"task": cfg.task, "mad_task": task.mad_name, "kind": cfg.kind, "seed": cfg.seed, "lr": cfg.lr,
           "weight_decay": cfg.weight_decay, "steps": steps, "full_steps": cfg.full_steps,
           "epochs": round(steps * cfg.batch_size / n_train, 2), "train_examples": n_train,
           "params": sum(p.numel() for p in model.parameters()),
           "train_loss": float(torch.stack(losses).mean()) if losses else None}
    for split in ("validation", "test") if cfg.validate else ("test",):
        x, y = dataset(task, split, min(cfg.eval_examples, steps * cfg.batch_size), cfg.data_seed)
        res = evaluate(model, x, y, task.vocab_size)
        row.update({f"{split}_acc": res["acc"], f"{split}_acc_token": res["acc_token"],
                    f"{split}_scored": res["scored"]})
    if graphed and step_fn.failed:
        row["cuda_graph_failed"] = step_fn.failed
    row.update(train_seconds=round(train_seconds, 2), seconds=round(time.time() - t0, 2),
               device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
               torch=torch.__version__, config=asdict(cfg))
    return row


def train_one_thread(cfg: RunConfig) -> dict:
    """`train` with one torch thread: the worker of parallel runs (`--jobs`)."""
    torch.set_num_threads(1)
    return train(cfg)

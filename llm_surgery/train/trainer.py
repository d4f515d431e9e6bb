"""The training run: host -> surgery (+ optional LoRA) -> Box data -> AdamW + schedule -> Accelerate loop with
evaluation, resumable checkpoints and logging -> `save_inserted` artifact, results.json, table and plot.

Before any work (`preflight`, on every process; a failure anywhere stops all of them with one message): the
output directory's lock, a fresh run's refusal of another run's outputs (or `--overwrite`), a resume's settings
against the checkpoint's, non-empty data splits, the host's source and size. A non-finite loss or gradient norm
stops the run at the next log record, evaluation or checkpoint with nothing of that step or later saved, so the
checkpoints and `final/` stay finite (tracked on the device: no step waits for the host). `final/` is saved before
the evaluation, so a failing evaluation loses no training.

The same code runs on 1 CPU, N CPU processes (gloo), 1 GPU and N GPUs (DDP, or FSDP2 with `--fsdp`); only the
launcher changes. On CUDA each micro-batch's forward and backward is replayed from a CUDA graph (`graphs.py`;
with several GPUs the gradients are then averaged by its all-reduce, not DDP's) unless `--no-cuda-graphs` or the
run rules it out. The loss is computed on the completion tokens only (left
padding puts them at the end of every row, so the LM head runs on those positions alone).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from llm_surgery.insert.ablation import host_alone

from .artifact import save_final
from .checkpoint import (CheckpointError, checkpoint_run_id, list_checkpoints, load_checkpoint, read_state,
                         resolve_checkpoint, save_checkpoint)
from .config import TrainConfig, UsageError
from .data import ShardedBatchSampler, TokenizedBox, cap_records, check_splits
from .evaluate import EvalSet, completion_loss_inputs, completion_span, evaluate
from .messages import logger
from .metrics import MetricsLog, Throughput, print_results, truncate_after
from .profile import StepProfile, profile_table
from .schedule import build_scheduler, tau_at
from .setup import add_lora, load_host, make_accelerator, mark_trainable, upcast_trainable, use_cuda_kernels


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm is not finite: the run stops before applying that update."""


# ---------------------------------------------------------------- optimizer

def build_optimizer(model, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices (and complex weights), none on vectors (norms, biases, per-head scalars);
    Flash PD-SSM's dictionary logits in a group of their own at `dictionary_lr_scale` x lr. Real tensors take the
    fused kernel (one launch for all of them instead of a few per tensor group); complex ones, which it does not
    take, the multi-tensor one."""
    groups: dict[tuple[bool, bool, bool], list] = {}   # (dictionary, vector, complex) -> tensors, in model order
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups.setdefault((name.endswith(".dictionary"), p.dim() < 2, p.is_complex()), []).append(p)
    return torch.optim.AdamW(
        [{"params": params, "weight_decay": 0.0 if vector else cfg.weight_decay,
          "lr": cfg.lr * (cfg.dictionary_lr_scale if dictionary else 1.0),
          **({"foreach": True} if complex_ else {"fused": True})}
         for (dictionary, vector, complex_), params in sorted(groups.items(), key=lambda kv: kv[0])],
        lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)


# ---------------------------------------------------------------- checks before work

def _checks(cfg: TrainConfig, accelerator, log) -> dict:
    from .host import check_memory, check_surgery, host_parameters, meta_host, resolve_dtype
    from .outputs import check_fresh, check_resume

    out_dir, world = Path(cfg.output_dir), accelerator.num_processes
    ckpt_root = out_dir / "checkpoints"
    dtype = resolve_dtype(cfg.host_dtype, accelerator.device.type == "cuda")
    found = {"resume_path": None, "run_id": None, "splits": None, "own": None}
    if cfg.resume:
        path = resolve_checkpoint(cfg.resume, ckpt_root)
        run_id = check_resume(read_state(path), cfg, world, accelerator.mixed_precision, path)
        others = sorted({str(checkpoint_run_id(p)) for p in list_checkpoints(ckpt_root)} - {run_id})
        if others:
            raise CheckpointError(f"{ckpt_root} holds checkpoints of other runs ({', '.join(others)}) than the one "
                                  f"resumed ({run_id}); resume into that run's own --output-dir")
        found.update(resume_path=path, run_id=run_id)
    else:
        check_fresh(out_dir, cfg.overwrite)
    if cfg.dataset == "box":
        found["splits"] = check_splits(cfg, world)
    else:
        found["own"] = _own_data(cfg, world, log)
    meta = meta_host(cfg)  # built once (the --model source checked on the way): the surgery plan and the size
    check_surgery(cfg, meta)
    host = host_parameters(cfg, meta) if cfg.memory_check else None
    if host is not None:
        check_memory(*host, dtype, accelerator.device, shards=world if cfg.fsdp else 1,
                     processes_here=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return found


def _own_data(cfg: TrainConfig, world: int, log):
    """The user's data (`--dataset`), read, checked and tokenized with the host's tokenizer before any work."""
    from .host import load_tokenizer, model_source
    from .own_data import load_own_data

    if cfg.model and not cfg.random_init_config:
        from transformers import AutoConfig

        source = model_source(cfg.model)
        tokenizer = load_tokenizer(source, AutoConfig.from_pretrained(source).vocab_size, log)
    else:  # the embedded host and random-init hosts use the Box word tokenizer
        from llm_surgery.box_data import build_box_tokenizer

        source, tokenizer = "the embedded host" if not cfg.random_init_config else cfg.random_init_config, \
            build_box_tokenizer()
    return load_own_data(cfg, tokenizer, source, world, log)


def preflight(cfg: TrainConfig, accelerator, log) -> dict:
    """Every check that can refuse the run, before any work or file. The main process takes the output
    directory's lock (before the checks where the directory exists, after them where the run makes it); a failure
    on any process is raised on every process (so no rank waits for the others). Returns the
    run id (new, or the resumed run's), the checkpoint to resume, the data splits and the lock."""
    from accelerate.utils import gather_object

    from .outputs import acquire_lock, check_fresh, release_lock

    out_dir = Path(cfg.output_dir)
    lock, error, found = None, None, {}
    # an existing directory is locked before it is checked; a new one is made only once this process's checks
    # passed (and checked again: another run may have made it meanwhile), and removed if another process refuses
    created = not out_dir.exists()
    try:
        if accelerator.is_main_process and not created:
            lock = acquire_lock(out_dir, log)
        found = _checks(cfg, accelerator, log)
        if accelerator.is_main_process and created:
            lock = acquire_lock(out_dir, log)
            if not cfg.resume:
                check_fresh(out_dir, cfg.overwrite)
    except (UsageError, CheckpointError) as e:
        error = e
    except BaseException:
        release_lock(lock)
        raise
    report = (type(error).__name__, str(error)) if error else None
    reports = gather_object([report]) if accelerator.num_processes > 1 else [report]
    first = next((r for r in reports if r), None)
    if first:
        release_lock(lock)
        if created and accelerator.is_main_process:
            with contextlib.suppress(OSError):
                Path(cfg.output_dir).rmdir()  # only if empty
        if error is not None:
            raise error
        raise (CheckpointError if first[0] == "CheckpointError" else UsageError)(first[1])
    if found["run_id"] is None:
        found["run_id"] = _fresh_run(cfg, accelerator, log)
    found["lock"] = lock
    return found


def _fresh_run(cfg: TrainConfig, accelerator, log) -> str:
    """A fresh run's id (one for every process), once its checks passed; `--overwrite` clears the earlier run's
    outputs only now."""
    from accelerate.utils import gather_object

    from .outputs import clear_outputs

    run_id = gather_object([uuid.uuid4().hex[:12]])[0] if accelerator.num_processes > 1 else uuid.uuid4().hex[:12]
    if accelerator.is_main_process and cfg.overwrite:
        gone = clear_outputs(Path(cfg.output_dir))
        if gone:
            log(f"--overwrite: deleted the earlier run's {', '.join(gone)} in {cfg.output_dir}")
    accelerator.wait_for_everyone()
    return run_id


# ---------------------------------------------------------------- run

def train(cfg: TrainConfig) -> dict:
    """Run one configuration end to end; returns the results dict (also written to results.json).

    Accelerate fixes the device and mixed precision once per process: calling `train` again in the same
    process must use the same `cpu` / `mixed_precision` settings.
    """
    from .outputs import release_lock, write_json

    accelerator = make_accelerator(cfg)
    main = accelerator.is_main_process

    def log(msg: str) -> None:
        if main:
            logger.info(msg)

    try:
        run = preflight(cfg, accelerator, log)
    except (UsageError, CheckpointError):
        # every process refuses together: end the process group now, not in interpreter exit (where gloo's
        # destructor could meet a live store thread: "terminate called without an active exception", SIGABRT)
        accelerator.end_training()
        raise
    try:
        if main:
            # after the checks: never a wrong one; with the mixed precision in effect (flag or Accelerate's config)
            write_json(Path(cfg.output_dir) / "config.json",
                       {**cfg.to_dict(), "mixed_precision": accelerator.mixed_precision})
        return _train(cfg, accelerator, run, log)
    finally:
        if main:
            release_lock(run["lock"])


def launch_line(accelerator) -> str:
    """The run's first log line: processes (and Accelerate's distributed type when there are several), device and
    mixed precision, with where the precision came from."""
    n, kind = accelerator.num_processes, accelerator.distributed_type.value
    precision = "no mixed precision (fp32)" if accelerator.mixed_precision == "no" else \
        f"mixed precision {accelerator.mixed_precision}"
    return (f"llm-surgery train: {n} process{'es' if n > 1 else ''}{f' ({kind})' if kind != 'NO' else ''}, device "
            f"{accelerator.device}, {precision} (from {getattr(accelerator, 'precision_source', 'the launcher')})")


def _train(cfg: TrainConfig, accelerator, run: dict, log) -> dict:
    """Set up, train for the run's steps, save and evaluate (nanoGPT's one loop, in `_loop`)."""
    use_cuda_kernels(cfg, accelerator, log)
    log(launch_line(accelerator))
    r = _set_up(cfg, accelerator, run, log)
    _loop(r)
    return _finish(r)


# ---------------------------------------------------------------- set-up

@dataclass
class _Run:
    """One run's pieces and running state: what the loop reads (prepared model, optimizer, data) and updates
    (meters, the device-side divergence record, the logging window)."""
    cfg: TrainConfig
    accelerator: Any
    log: Callable[[str], None]
    run_id: str
    model: Any
    tokenizer: Any
    host_desc: str
    sizes: dict  # parameter counts: inserted, total, trainable
    train_data: TokenizedBox
    sampler: ShardedBatchSampler
    collate: Any
    val_set: EvalSet
    test_set: EvalSet
    total_steps: int
    optimizer: Any
    scheduler: Any
    graphed: Any = None  # graphs.GraphedLoss when steps replay from CUDA graphs, else None
    host_alone: dict | None = None
    own: Any = None  # own_data.OwnData with `--dataset PATH_OR_ID` (then val_set is its first eval split)
    own_sets: dict = field(default_factory=dict)  # its eval splits: name -> own_data.OwnEvalSet
    start_step: int = 0
    metrics: MetricsLog | None = None  # the main process's alone
    batches: Any = None  # the loader's iterator
    bar: Any = None
    params: list = field(default_factory=list)  # the trainable tensors, as prepared
    meter: Throughput | None = None
    profile: StepProfile | None = None
    health: Divergence | None = None
    window_t: float = 0.0  # start of the current log window and its tokens (the logged tokens/s)
    window_tokens: int = 0

    @property
    def out_dir(self) -> Path:
        return Path(self.cfg.output_dir)

    @property
    def ckpt_root(self) -> Path:
        return self.out_dir / "checkpoints"


def _set_up(cfg: TrainConfig, accelerator, run: dict, log) -> _Run:
    """Model, data and optimisation, prepared by Accelerate; then the start (fresh or resumed) and the meters."""
    from . import graphs

    model, tokenizer, host_desc, sizes = _build_model(cfg, accelerator, log)
    own = run["own"]
    if own is not None:
        tokenizer = own.tokenizer  # the host's, as the data was checked and tokenized with it (pad token set)
    why_not = graphs.refusal(cfg, accelerator, model)
    log(f"CUDA graphs: {'on' if why_not is None else f'off ({why_not})'}")
    train_data, sampler, collate, total_steps, val_set, test_set = _build_data(
        cfg, accelerator, tokenizer, run["splits"] or own, log, 8 if why_not else graphs.LENGTH_MULTIPLE)
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, total_steps, cfg.warmup_ratio, cfg.schedule, cfg.min_lr_ratio)
    if why_not is None:  # the model stays unprepared: no DDP, no autocast wrapper (graphs.py)
        optimizer = accelerator.prepare(optimizer)
    else:
        model, optimizer = accelerator.prepare(model, optimizer)
    params = [p for p in model.parameters() if p.requires_grad]  # as prepared (FSDP2: sharded)
    graphed = None
    if why_not is None:
        if accelerator.num_processes > 1:
            graphs.broadcast_trainable(params)
        graphed = graphs.GraphedLoss(model, params, cfg.grad_accum, accelerator.mixed_precision)
    scheduler.optimizer = getattr(optimizer, "optimizer", optimizer)  # FSDP2 may rebuild the param groups
    r = _Run(cfg, accelerator, log, run["run_id"], model, tokenizer, host_desc, sizes, train_data, sampler, collate,
             val_set, test_set, total_steps, optimizer, scheduler, graphed, params=params, own=own,
             own_sets=test_set if own is not None else {})
    _start(r, run["resume_path"])
    _start_meters(r)
    if graphed is not None:  # after the meters: the peak memory counts the captures' working memory
        done = r.start_step * cfg.grad_accum
        shapes = graphs.run_shapes(r.sampler, r.train_data, done, r.total_steps * cfg.grad_accum - done)
        log(f"CUDA graphs: {graphed.prepare(shapes, accelerator.device)}")
    return r


def _build_model(cfg: TrainConfig, accelerator, log):
    """(model, tokenizer, host description, parameter counts): the host, the surgery, LoRA, what trains. The seed
    is set before the host and again before the surgery, so the inserted layers do not depend on the host's
    source."""
    from accelerate.utils import set_seed

    from llm_surgery.insert import count_parameters, insert_layers, set_tau

    set_seed(cfg.seed)
    model, tokenizer, host_desc = load_host(cfg, accelerator, log)
    set_seed(cfg.seed)
    try:
        insert_layers(model, cfg.inserted_kinds(), cfg.n, positions=cfg.positions, **cfg.mixer_kwargs())
    except (ValueError, TypeError) as e:  # n, positions or mixer option values this host cannot take
        raise UsageError(f"the surgery refused these settings on {host_desc}: {e}") from e
    if cfg.lora_r:
        add_lora(model, cfg)
    trainable = mark_trainable(model)
    upcast_trainable(model, accelerator)
    if cfg.tau is not None:
        set_tau(model, cfg.tau)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    n_inserted, n_total = count_parameters(model)
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_lora = sum(p.numel() for name, p in model.named_parameters() if "lora_" in name)
    n_host = n_total - n_inserted - n_lora
    log(f"host {host_desc}: {n_host:,} params; inserted {cfg.n} x {cfg.kind}: {n_inserted:,} params"
        + (f"; LoRA: {n_lora:,} params" if n_lora else "") + f"; all together {n_total:,}; trainable "
        f"{n_trainable:,} ({len(trainable)} tensors)")
    return model, tokenizer, host_desc, {"host": n_host, "inserted": n_inserted, "total": n_total,
                                         "trainable": n_trainable}


def _build_data(cfg: TrainConfig, accelerator, tokenizer, splits: dict, log, pad_to_multiple_of: int):
    """The training data with its sharded, resumable sampler (batches padded to a multiple of
    `pad_to_multiple_of` tokens); the run's length in optimizer steps; the evaluation sets (sharded loaders): Box
    validation and test, or for own data (`splits` an `OwnData`) its first eval split and {name: every one}."""
    from llm_surgery.box_data import BoxCollator

    own = splits if not isinstance(splits, dict) else None
    train_data = TokenizedBox(tokenizer, splits["train"]) if own is None else own.train
    sampler = ShardedBatchSampler(len(train_data), cfg.batch_size, accelerator.process_index,
                                  accelerator.num_processes, cfg.seed)
    collate = BoxCollator(tokenizer, padding_side="left", pad_to_multiple_of=pad_to_multiple_of)
    steps_per_epoch = max(1, sampler.batches_per_epoch // cfg.grad_accum)
    total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * steps_per_epoch))
    if own is not None:  # every eval split; the first is the one validated during training
        from .own_data import OwnEvalSet

        test_set = {name: OwnEvalSet(accelerator, name, data, cfg.eval_batch_size) for name, data in own.evals.items()}
        val_set = next(iter(test_set.values()))
        evals = "eval splits " + ", ".join(f"{k} {len(v.data):,}" for k, v in test_set.items())
    else:
        val_set = EvalSet(accelerator, tokenizer, "validation",
                          cap_records(splits["validation"], cfg.max_eval_examples), cfg.eval_batch_size)
        test_set = EvalSet(accelerator, tokenizer, "test", cap_records(splits["test"], cfg.max_eval_examples),
                           cfg.eval_batch_size)
        evals = f"{len(val_set.records):,} validation, {len(test_set.records):,} test"
    log(f"data: {len(train_data):,} train examples ({sampler.batches_per_epoch} global batches of "
        f"{sampler.global_batch} per epoch), {evals}; {total_steps} optimizer steps x {cfg.grad_accum} accumulation")
    return train_data, sampler, collate, total_steps, val_set, test_set


def _start(r: _Run, resume_path) -> None:
    """Where the run starts. Resumed: the checkpoint's weights, optimizer and scheduler, the metrics log cut back to
    its step, and the data from the same position. Nothing is evaluated before the first step: the host alone is
    evaluated at the end (`_host_alone`)."""
    cfg, acc = r.cfg, r.accelerator
    if resume_path is not None:
        state = load_checkpoint(acc, resume_path, r.model, r.optimizer, r.scheduler)
        r.start_step = int(state["step"])
        r.log(f"resumed from {resume_path} at step {r.start_step}")
    if acc.is_main_process:
        if resume_path is not None:
            truncate_after(r.out_dir / "metrics.jsonl", r.start_step)
        r.metrics = MetricsLog(r.out_dir, tensorboard=cfg.tensorboard, append=resume_path is not None)
    r.sampler.set_position(r.start_step * cfg.grad_accum)
    # workers collate the next batches while the device trains (the sampler, which fixes the order, runs here);
    # pinned host memory lets the copies in `_micro_step` run asynchronously
    loader = torch.utils.data.DataLoader(r.train_data, batch_sampler=r.sampler, collate_fn=r.collate,
                                         num_workers=cfg.num_workers, pin_memory=acc.device.type == "cuda")
    r.batches = iter(loader)


def _start_meters(r: _Run) -> None:
    """Progress bar, throughput (after a warm-up), the optional step profile (the last steps) and the divergence
    record, all started from the run's first step."""
    cfg, acc = r.cfg, r.accelerator
    if acc.is_main_process and cfg.progress:
        from tqdm.auto import tqdm  # noqa: I001 - a dependency of transformers, always present
        r.bar = tqdm(total=r.total_steps, initial=r.start_step, desc=f"train {cfg.kind}", unit="step",
                     dynamic_ncols=True)
    r.model.train()
    if acc.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(acc.device)
    r.meter = Throughput(acc.device, skip=min(5, (r.total_steps - r.start_step) // 5))
    r.profile = StepProfile(acc.device, max(r.start_step + r.meter.skip, r.total_steps - cfg.profile_steps),
                            cfg.profile_steps)
    r.health = Divergence(acc, r.start_step, check_grad_norm=acc.mixed_precision != "fp16")
    r.meter.start()
    r.window_t, r.window_tokens = time.perf_counter(), 0


# ---------------------------------------------------------------- the loop

def _loop(r: _Run) -> None:
    """Optimizer steps from the start step to the last; at their intervals the host reads the device's numbers
    (divergence check, log record), evaluates and checkpoints. The last step is always logged, so checked."""
    cfg = r.cfg
    for step in range(r.start_step, r.total_steps):
        if r.profile.begin_step(step):
            r.meter.freeze()  # synchronised steps are not throughput
        tau, grad_norm = _step(r, step)
        done = step + 1
        logging = done % cfg.log_every == 0 or done == r.total_steps
        evaluating = bool(cfg.eval_every) and done % cfg.eval_every == 0 and done != r.total_steps
        saving = bool(cfg.save_every) and done % cfg.save_every == 0
        if logging or evaluating or saving:  # the host looks at the device's numbers only here
            with r.profile.phase("check_and_log"):
                loss_mean = r.health.check(done, r.ckpt_root, r.run_id)
                if logging:
                    _log_step(r, done, loss_mean, grad_norm, tau)
        if r.bar is not None:
            r.bar.update(1)
        r.profile.end_step()
        if evaluating:
            _validate(r, done)
        if saving:
            _checkpoint(r, done)
    r.meter.pause()
    r.batches = None  # stops the loader's workers
    if r.bar is not None:
        r.bar.close()


def _step(r: _Run, step: int):
    """One optimizer step: `grad_accum` micro-batches (DDP synchronises gradients on the last one only), clipping,
    the device-side non-finite record, the update. Returns (tau, gradient norm); nothing here waits for the
    device."""
    cfg, acc = r.cfg, r.accelerator
    tau = None if cfg.tau_end is None else tau_at(step, r.total_steps, cfg.tau, cfg.tau_end)
    if tau is not None:  # a function of the step: a resumed run continues the same schedule
        from llm_surgery.insert import set_tau

        set_tau(acc.unwrap_model(r.model), tau)
    loss_sum, step_tokens = torch.zeros((), device=acc.device), 0
    if r.graphed is not None:
        r.graphed.zero_grad()
    for micro in range(cfg.grad_accum):
        last = micro == cfg.grad_accum - 1
        with contextlib.nullcontext() if last else acc.no_sync(r.model):
            loss, n_tok = _micro_step(r)
        loss_sum += loss.detach() / cfg.grad_accum
        step_tokens += n_tok
    if r.graphed is not None and acc.num_processes > 1:
        with r.profile.phase("backward"):  # where DDP's wait for its all-reduce is counted too
            r.graphed.all_reduce(acc.num_processes)
    r.window_tokens += step_tokens
    with r.profile.phase("optimizer"):
        grad_norm = acc.clip_grad_norm_(r.params, math.inf if cfg.max_grad_norm is None else cfg.max_grad_norm)
        r.health.record(loss_sum, grad_norm)  # on the device: no wait here
        r.optimizer.step()
        r.scheduler.step()
        if r.graphed is None:  # the graphs' gradients stay in their buffers, cleared before the next step
            r.optimizer.zero_grad(set_to_none=True)
    r.meter.step_done(step_tokens)
    return tau, grad_norm


def _micro_step(r: _Run):
    """Forward and backward of one micro-batch, the loss on its completion tokens alone. Returns (loss, tokens)."""
    acc = r.accelerator
    with r.profile.phase("data"):
        cpu = next(r.batches)
        span, n_tok = completion_span(cpu["labels"]), int(cpu["attention_mask"].sum())  # no GPU sync
        batch = {k: v.to(acc.device, non_blocking=True) for k, v in cpu.items()}
        # 0/1 by construction: as bool the surgery skips its value check (a host sync every forward)
        batch["attention_mask"] = batch["attention_mask"].bool()
    if r.graphed is not None:
        with r.profile.phase("forward"):  # forward and backward: one graph
            return r.graphed(batch, span), n_tok
    with r.profile.phase("forward"), acc.autocast():
        logits, labels = completion_loss_inputs(r.model, batch, span)
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
    with r.profile.phase("backward"):
        acc.backward(loss / r.cfg.grad_accum)
    return loss, n_tok


def _log_step(r: _Run, done: int, loss_mean: float, grad_norm, tau) -> None:
    """One metrics record (main process) and the progress bar; tokens/s over the window since the last record."""
    acc = r.accelerator
    now = time.perf_counter()
    tok_s = r.window_tokens / max(now - r.window_t, 1e-9)
    r.window_t, r.window_tokens = now, 0
    record = {"step": done, "loss": loss_mean, "lr": r.scheduler.get_last_lr()[0],
              "grad_norm": float(_full(grad_norm)), "tokens_per_s_per_process": tok_s,
              "epoch": done * r.cfg.grad_accum / r.sampler.batches_per_epoch,
              **({"tau": tau} if tau is not None else {})}
    if acc.device.type == "cuda":  # rank 0's peak so far (the final record has every rank's)
        record["peak_memory_gib"] = torch.cuda.max_memory_allocated(acc.device) / 2**30
    if acc.is_main_process:
        r.metrics.log(record)
        if r.bar is not None:
            r.bar.set_postfix(loss=f"{loss_mean:.4f}", tok_s=f"{tok_s * acc.num_processes:,.0f}")


def _validate(r: _Run, done: int) -> None:
    """A validation evaluation during training (outside the throughput)."""
    r.meter.pause()
    with r.profile.evaluation("validation"):
        if r.own is not None:
            val = _evaluate_own(r, [r.val_set.name])
        else:
            val = evaluate(r.accelerator, r.model, r.tokenizer, r.val_set, r.cfg.train_max_ops, r.cfg.eval_mode)
    if r.accelerator.is_main_process:
        r.metrics.log({"step": done, **(_own_record(val) if r.own is not None else {"val_accuracy": val["accuracy"]})})
    r.meter.resume()


def _host_alone(r: _Run) -> None:
    """The host alone (`--eval-host`) on the test split, or on every eval split of own data: the trained layers'
    outputs zeroed as at insertion, which gives exactly the host's function. At the end rather than before the
    first step, so a run starts training at once (on a recipe's whole Box test split this evaluation took longer
    than the start-up itself)."""
    cfg, acc = r.cfg, r.accelerator
    if not cfg.eval_host:
        return
    with r.profile.evaluation("host alone"), host_alone(acc.unwrap_model(r.model)):
        r.host_alone = _evaluate_own(r) if r.own is not None else evaluate(
            acc, r.model, r.tokenizer, r.test_set, cfg.train_max_ops, cfg.eval_mode)


def _evaluate_own(r: _Run, names=None) -> dict:
    """Own data: loss, perplexity, token accuracy (and with --eval-generate greedy exact match) per eval split."""
    from .own_data import evaluate_own

    return {name: evaluate_own(r.accelerator, r.model, r.tokenizer, s, r.cfg.eval_generate)
            for name, s in r.own_sets.items() if names is None or name in names}


def _own_record(evals: dict) -> dict:
    """A metrics record (and TensorBoard scalars) of own-data evaluations: `<split>_<metric>`."""
    return {f"{split}_{k}": v for split, part in evals.items() for k, v in part.items()
            if k in ("loss", "perplexity", "token_accuracy", "exact_match")}


def _checkpoint(r: _Run, done: int) -> None:
    """An atomic checkpoint after step `done`: weights, optimizer, scheduler, RNG and the data position, with what
    a resume checks its settings against (outside the throughput)."""
    cfg, acc = r.cfg, r.accelerator
    r.meter.pause()
    position = {"micro_batches": done * cfg.grad_accum, **_position(r.sampler, done * cfg.grad_accum)}
    save_checkpoint(acc, r.ckpt_root, done, r.model, r.optimizer, r.scheduler, position, cfg.keep_last,
                    extra={"kind": cfg.kind, "total_steps": r.total_steps, "run_id": r.run_id,
                           "settings": cfg.resume_settings(acc.num_processes, acc.mixed_precision)})
    r.meter.resume()


# ---------------------------------------------------------------- the end

def _finish(r: _Run) -> dict:
    """Throughput, `final/` (saved before the evaluation: a failing one loses no training), the last evaluations
    (Box: validation and test; own data: every eval split), the host alone, and the results on every process
    (written by the main one)."""
    cfg, acc = r.cfg, r.accelerator
    throughput = _throughput(r)
    save_final(acc, r.model, r.out_dir / "final", cfg)
    if r.own is not None:
        with r.profile.evaluation("test"):
            own = _evaluate_own(r)
        evals = {"dataset": {"source": r.own.source, "format": r.own.format, "splits": r.own.report}, "eval": own}
    else:
        with r.profile.evaluation("validation"):
            val = evaluate(acc, r.model, r.tokenizer, r.val_set, cfg.train_max_ops, cfg.eval_mode)
        with r.profile.evaluation("test"):
            test = evaluate(acc, r.model, r.tokenizer, r.test_set, cfg.train_max_ops, cfg.eval_mode)
        evals = {"validation": val, "test": test}
    _host_alone(r)
    results = {"kind": cfg.kind, "n": cfg.n, "host": r.host_desc, "steps": r.total_steps, "params": r.sizes,
               "throughput": throughput, "num_processes": acc.num_processes,
               "distributed_type": acc.distributed_type.value, "run_id": r.run_id, **evals,
               "host_alone": r.host_alone, "step_profile": r.profile.result(),
               "config": {**cfg.to_dict(), "mixed_precision": acc.mixed_precision}}
    if acc.is_main_process:
        _write_results(r, results)
    acc.wait_for_everyone()
    _release_model(r)
    acc.end_training()
    return results


def _release_model(r: _Run) -> None:
    """Drop the prepared (DDP / FSDP) model while the process group is still registered. DDP's C++ reducer holds a
    reference to the group: freed after `end_training`, it would drop the group's last reference under the GIL,
    and the gloo group's destructor then joins a worker thread that waits for the GIL to free the tensors of its
    last collectives (a 2-process CPU run hung so at exit, after writing its results)."""
    acc = r.accelerator
    r.model = acc.unwrap_model(r.model)
    r.graphed = r.optimizer = r.scheduler = None
    acc.free_memory()   # the accelerator's own references to what it prepared, then a garbage collection


def _throughput(r: _Run) -> dict:
    """Timed tokens/s and peak memory of every process (one gather), logged."""
    acc, meter = r.accelerator, r.meter
    on_cuda = acc.device.type == "cuda"
    rate = meter.tokens_per_s()
    peak = torch.cuda.max_memory_allocated(acc.device) / 2**30 if on_cuda else float("nan")
    per_rank = acc.gather(torch.tensor([rate, peak], dtype=torch.float64, device=acc.device))
    per_rank = per_rank.view(-1, 2).cpu()
    throughput = {
        "timed_seconds": meter.seconds, "timed_steps": meter.steps - meter.skip, "warmup_steps": meter.skip,
        "tokens_per_s_per_process": rate,
        "tokens_per_s_total": float(per_rank[:, 0].sum()),
        "tokens_per_s_by_process": per_rank[:, 0].tolist(),
        "peak_memory_gib": peak if on_cuda else None,
        "peak_memory_gib_by_process": per_rank[:, 1].tolist() if on_cuda else None,
        "num_processes": acc.num_processes,
    }
    unit = "GPU" if on_cuda else "process"
    r.log(f"throughput: {throughput['tokens_per_s_per_process']:,.0f} tokens/s per {unit}, "
          f"{throughput['tokens_per_s_total']:,.0f} total" + (
              ", peak memory " + ", ".join(f"{g:.2f}" for g in throughput["peak_memory_gib_by_process"])
              + " GiB per GPU" if throughput["peak_memory_gib"] is not None else ""))
    return throughput


def _write_results(r: _Run, results: dict) -> None:
    """The main process's outputs: results.json, the step profile, the last metrics records and the results table
    (Box: with the optional plot; own data: a row per eval split)."""
    from .outputs import write_json

    out_dir, log = r.out_dir, r.log
    write_json(out_dir / "results.json", results)
    if results["step_profile"] is not None:
        write_json(out_dir / "step_profile.json", results["step_profile"])
        log(profile_table(results["step_profile"]))
    r.metrics.log({"step": r.total_steps, "throughput": results["throughput"]})
    if r.own is not None:
        r.metrics.log({"step": r.total_steps, **_own_record(results["eval"])})
    else:
        test = results["test"]
        r.metrics.log({"step": r.total_steps, "val_accuracy": results["validation"]["accuracy"],
                       "test_iid_accuracy": test["iid"]["accuracy"], "test_ood_accuracy": test["ood"]["accuracy"]})
    r.metrics.close()
    if r.own is not None:
        from rich.console import Console

        from .own_data import results_table

        console = Console()
        console.width = max(console.width, 110)
        console.print(results_table(results["eval"], r.host_alone, f"{r.own.source}: host + {r.cfg.n} x "
                                                                    f"{r.cfg.kind} inserted layers"))
    else:
        print_results(results)
        if r.cfg.plot:
            try:
                from .plot import plot_run
                png = plot_run(results, out_dir / "accuracy.png")
                log(f"plot: {png}")
            except ImportError as e:  # matplotlib is optional on bare GPU images
                log(f"no plot ({e})")
    log(f"inserted layers: {out_dir / 'final'}; results: {out_dir / 'results.json'}")


def _full(t):
    """FSDP2 returns the gradient norm as a DTensor: its value, on every process."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class Divergence:
    """The first step whose loss (on any process) or gradient norm is not finite, tracked on the device so that no
    step waits for the host. `check`, called wherever the host reads the run (a log record, before an evaluation
    or a checkpoint, the last step), raises TrainingDiverged on every process if such a step happened. The steps
    after it still run on the device until that check, but nothing of them is logged, evaluated or saved: every
    checkpoint and `final/` hold weights from before that step. Under fp16 the gradient scaler skips updates with
    non-finite gradients itself, so only the loss is checked there."""

    def __init__(self, accelerator, start_step: int, check_grad_norm: bool):
        self.accelerator, self.check_grad_norm = accelerator, check_grad_norm
        dev = accelerator.device
        self.step = torch.full((), start_step, dtype=torch.float32, device=dev)  # steps done, counted on the device
        self.first = torch.zeros(3, dtype=torch.float32, device=dev)  # (step, loss, grad norm); step 0 = none yet
        self.loss = torch.zeros((), dtype=torch.float32, device=dev)

    def record(self, loss_sum: torch.Tensor, grad_norm) -> None:
        self.step += 1
        self.loss = loss_sum.detach().float()
        health = torch.stack([self.loss, torch.as_tensor(_full(grad_norm), device=self.loss.device).float()])
        bad = ~torch.isfinite(health if self.check_grad_norm else health[:1]).all()
        self.first = torch.where(bad & (self.first[0] == 0), torch.cat([self.step.view(1), health]), self.first)

    def check(self, step: int, ckpt_root: Path, run_id: str) -> float:
        """The last step's loss averaged over the processes, or TrainingDiverged (one gather)."""
        acc = self.accelerator
        mine = torch.cat([self.loss.view(1), self.first])
        every = (acc.gather(mine) if acc.num_processes > 1 else mine).view(-1, 4).cpu()
        bad = every[every[:, 1] > 0]
        if not len(bad):
            return float(every[:, 0].mean())
        first, loss, grad_norm = bad[bad[:, 1].argmin(), 1:].tolist()
        mine = [p for p in list_checkpoints(ckpt_root) if checkpoint_run_id(p) == run_id]
        last = f"the last good checkpoint is {mine[-1]}" if mine else "no checkpoint was saved (--save-every)"
        raise TrainingDiverged(
            f"step {int(first)}: the loss ({loss:.4g} on a process) or the gradient norm ({grad_norm:.4g}) is not "
            f"finite; the run stopped at step {step}, the next check, and saved nothing from step {int(first)} on; "
            f"{last}. Lower --lr, clip with --max-grad-norm, or use --host-dtype float32, in a fresh run")


def _position(sampler: ShardedBatchSampler, micro_batches: int) -> dict:
    epoch, batch = divmod(micro_batches, sampler.batches_per_epoch)
    return {"epoch": epoch, "batch_in_epoch": batch}

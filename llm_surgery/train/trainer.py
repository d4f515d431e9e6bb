"""The training run: host -> surgery (+ optional LoRA) -> Box data -> AdamW + schedule -> Accelerate loop with
evaluation, resumable checkpoints and logging -> `save_inserted` artifact, results.json, table and plot.

Before any work (`preflight`, on every process; a failure anywhere stops all of them with one message): the
output directory's lock, a fresh run's refusal of another run's outputs (or `--overwrite`), a resume's settings
against the checkpoint's, non-empty data splits, the host's source and size. A non-finite loss or gradient norm
stops the run before that update, so the weights and checkpoints stay finite. `final/` is saved before the
evaluation, so a failing evaluation loses no training.

The same code runs on 1 CPU, N CPU processes (gloo), 1 GPU and N GPUs (DDP, or FSDP2 with `--fsdp`); only the
launcher changes. The loss is computed on the completion tokens only (left padding puts them at the end of
every row, so the LM head runs on those positions alone).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import uuid
from pathlib import Path

import torch
import torch.nn.functional as F

from .artifact import lora_config, save_final
from .checkpoint import (CheckpointError, checkpoint_run_id, list_checkpoints, load_checkpoint, read_state,
                         resolve_checkpoint, save_checkpoint)
from .config import TrainConfig, UsageError
from .data import ShardedBatchSampler, TokenizedBox, cap_records, check_splits
from .evaluate import EvalSet, completion_loss_inputs, completion_span, evaluate
from .messages import logger
from .metrics import MetricsLog, Throughput, print_results, truncate_after
from .schedule import build_scheduler, tau_at

class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm is not finite: the run stops before applying that update."""


# ---------------------------------------------------------------- setup

def make_accelerator(cfg: TrainConfig):
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    on_cuda = torch.cuda.is_available() and not cfg.cpu and os.environ.get("ACCELERATE_USE_CPU", "").lower() \
        not in ("1", "true", "yes")
    precision = cfg.mixed_precision
    if precision == "auto":
        precision = "bf16" if on_cuda else "no"
    kwargs = dict(cpu=cfg.cpu or not on_cuda, mixed_precision=precision)
    if cfg.fsdp:
        from accelerate.utils import FullyShardedDataParallelPlugin

        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap", reshard_after_forward=True,
            state_dict_type="FULL_STATE_DICT", cpu_ram_efficient_loading=False)
    else:
        kwargs["kwargs_handlers"] = [DistributedDataParallelKwargs(find_unused_parameters=False)]
    accelerator = Accelerator(**kwargs)
    if cfg.fsdp and accelerator.distributed_type.value != "FSDP":
        raise UsageError(f"--fsdp needs 2 or more GPU processes (Accelerate shards only on accelerators); this "
                         f"launch gives {accelerator.num_processes} process(es) of type "
                         f"{accelerator.distributed_type.value}. Launch with accelerate launch --num_processes N.")
    return accelerator


def use_cuda_kernels(cfg: TrainConfig, accelerator, log) -> None:
    """Process-wide kernel choices of a run on CUDA (idempotent): quick Triton autotuning, mamba-ssm kernels for
    the host's Mamba2 layers."""
    if accelerator.device.type != "cuda":
        return
    if cfg.quick_autotune:
        from llm_surgery.triton_autotune import quick_autotune
        log(f"quick Triton autotuning: {'on' if quick_autotune() else 'unavailable'}")
    if cfg.host_kernels:
        from llm_surgery.host_kernels import use_mamba_kernels_for_hosts
        log(use_mamba_kernels_for_hosts())


def load_host(cfg: TrainConfig, accelerator, log):
    """(model, tokenizer, description) on this process's device."""
    from .host import load_pretrained, random_init_host, resolve_dtype

    dtype = resolve_dtype(cfg.host_dtype, accelerator.device.type == "cuda")
    if cfg.random_init_config:
        model, tok = random_init_host(cfg.random_init_config, dtype, accelerator.device, cfg.seed)
        return model, tok, f"random-init {cfg.random_init_config}"
    path = cfg.model
    if path is None:  # the shipped host if intact, else one pretrained here (main process first, then cached)
        from .host import embedded_host
        if accelerator.is_main_process:
            embedded_host(cfg, log=log)
        accelerator.wait_for_everyone()
        path = str(embedded_host(cfg, log=lambda msg: None))
    model, tok = load_pretrained(path, dtype, accelerator.device, log=log)
    return model, tok, path


def add_lora(model, cfg: TrainConfig):
    """LoRA adapters on the host's attention projections (peft), trained with the inserted layers."""
    from peft import inject_adapter_in_model

    targets = [t.strip() for t in cfg.lora_targets.split(",") if t.strip()]
    lcfg = lora_config(cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, targets)
    inject_adapter_in_model(lcfg, model)
    if not any("lora_" in n for n, _ in model.named_parameters()):
        raise UsageError(f"--lora-targets {targets} matched no module of this host")
    return lcfg


def mark_trainable(model) -> list[str]:
    """Only inserted layers and LoRA weights train; everything else is frozen. Returns the trainable names."""
    from llm_surgery.insert import inserted_layers

    inserted = {id(p) for block in inserted_layers(model).values() for p in block.parameters()}
    names = []
    for n, p in model.named_parameters():
        p.requires_grad_(id(p) in inserted or "lora_" in n)
        if p.requires_grad:
            names.append(n)
    if not names:
        raise RuntimeError("no trainable parameters after the surgery")
    return names


def upcast_trainable(model, accelerator) -> None:
    """Under bf16/fp16 mixed precision the trainable tensors are kept in float32 (master weights); autocast does
    the compute in low precision. Training and a re-evaluation of its artifact run the same way."""
    if accelerator.mixed_precision in ("bf16", "fp16"):
        for p in model.parameters():
            if p.requires_grad and p.is_floating_point():
                p.data = p.data.float()


def build_optimizer(model, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices (and complex weights), none on vectors (norms, biases, per-head scalars)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                             eps=cfg.adam_eps)


# ---------------------------------------------------------------- checks before work

def _checks(cfg: TrainConfig, accelerator, log) -> dict:
    from .host import check_memory, host_parameters, model_source, resolve_dtype
    from .outputs import check_fresh, check_resume

    out_dir, world = Path(cfg.output_dir), accelerator.num_processes
    ckpt_root = out_dir / "checkpoints"
    dtype = resolve_dtype(cfg.host_dtype, accelerator.device.type == "cuda")
    found = {"resume_path": None, "run_id": None}
    if cfg.resume:
        path = resolve_checkpoint(cfg.resume, ckpt_root)
        run_id = check_resume(read_state(path), cfg, world, path)
        others = sorted({str(checkpoint_run_id(p)) for p in list_checkpoints(ckpt_root)} - {run_id})
        if others:
            raise CheckpointError(f"{ckpt_root} holds checkpoints of other runs ({', '.join(others)}) than the one "
                                  f"resumed ({run_id}); resume into that run's own --output-dir")
        found.update(resume_path=path, run_id=run_id)
    else:
        check_fresh(out_dir, cfg.overwrite)
    found["splits"] = check_splits(cfg, world)
    if cfg.model and not cfg.random_init_config:
        model_source(cfg.model)
    host = host_parameters(cfg) if cfg.memory_check else None
    if host is not None:
        check_memory(*host, dtype, accelerator.device, shards=world if cfg.fsdp else 1,
                     processes_here=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return found


def preflight(cfg: TrainConfig, accelerator, log) -> dict:
    """Every check that can refuse the run, before any work. The main process first takes the output directory's
    lock; a failure on any process is raised on every process (so no rank waits for the others). Returns the
    run id (new, or the resumed run's), the checkpoint to resume, the data splits and the lock."""
    from accelerate.utils import gather_object

    from .outputs import acquire_lock, clear_outputs, release_lock

    lock, error, found = None, None, {}
    try:
        if accelerator.is_main_process:
            lock = acquire_lock(Path(cfg.output_dir), log)
        found = _checks(cfg, accelerator, log)
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
        if error is not None:
            raise error
        raise (CheckpointError if first[0] == "CheckpointError" else UsageError)(first[1])
    if found["run_id"] is None:  # a fresh run: one id for every process
        found["run_id"] = gather_object([uuid.uuid4().hex[:12]])[0] if accelerator.num_processes > 1 \
            else uuid.uuid4().hex[:12]
        if accelerator.is_main_process and cfg.overwrite:
            gone = clear_outputs(Path(cfg.output_dir))
            if gone:
                log(f"--overwrite: deleted the earlier run's {', '.join(gone)} in {cfg.output_dir}")
        accelerator.wait_for_everyone()
    found["lock"] = lock
    return found


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

    run = preflight(cfg, accelerator, log)
    try:
        if main:
            write_json(Path(cfg.output_dir) / "config.json", cfg.to_dict())  # after the checks: never a wrong one
        return _train(cfg, accelerator, run, log)
    finally:
        if main:
            release_lock(run["lock"])


def _train(cfg: TrainConfig, accelerator, run: dict, log) -> dict:
    from accelerate.utils import set_seed

    from llm_surgery.box_data import BoxCollator
    from llm_surgery.insert import count_parameters, insert_layers, set_tau

    from .outputs import write_json

    main = accelerator.is_main_process
    use_cuda_kernels(cfg, accelerator, log)
    out_dir = Path(cfg.output_dir)
    ckpt_root = out_dir / "checkpoints"
    resume_path, splits = run["resume_path"], run["splits"]
    log(f"llm-surgery train: {accelerator.num_processes} process(es), {accelerator.distributed_type.value}, "
        f"device {accelerator.device}, mixed precision {accelerator.mixed_precision}")

    # host, surgery, LoRA
    set_seed(cfg.seed)
    model, tokenizer, host_desc = load_host(cfg, accelerator, log)
    set_seed(cfg.seed)
    try:
        insert_layers(model, cfg.kind, cfg.n, positions=cfg.positions, **cfg.mixer_kwargs())
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
    log(f"host {host_desc}: {n_total:,} params; inserted {cfg.n} x {cfg.kind}: {n_inserted:,}; "
        f"trainable {n_trainable:,} ({len(trainable)} tensors)")

    # data
    train_data = TokenizedBox(tokenizer, splits["train"])
    sampler = ShardedBatchSampler(len(train_data), cfg.batch_size, accelerator.process_index,
                                  accelerator.num_processes, cfg.seed)
    collate = BoxCollator(tokenizer, padding_side="left", pad_to_multiple_of=8)
    steps_per_epoch = max(1, sampler.batches_per_epoch // cfg.grad_accum)
    total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * steps_per_epoch))
    val_set = EvalSet(accelerator, tokenizer, "validation", cap_records(splits["validation"], cfg.max_eval_examples),
                      cfg.eval_batch_size)
    test_set = EvalSet(accelerator, tokenizer, "test", cap_records(splits["test"], cfg.max_eval_examples),
                       cfg.eval_batch_size)
    log(f"data: {len(train_data):,} train examples ({sampler.batches_per_epoch} global batches of "
        f"{sampler.global_batch} per epoch), {len(val_set.records):,} validation, {len(test_set.records):,} test; "
        f"{total_steps} optimizer steps x {cfg.grad_accum} accumulation")

    # optimisation
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, total_steps, cfg.warmup_ratio, cfg.schedule, cfg.min_lr_ratio)
    model, optimizer = accelerator.prepare(model, optimizer)
    scheduler.optimizer = getattr(optimizer, "optimizer", optimizer)  # FSDP2 may rebuild the param groups

    # inserted layers start as the identity (out_proj = 0): evaluated now, the model is the host alone (a resumed
    # run takes the figures its checkpoint carries: under FSDP a forward before loading would break the load)
    host_alone = evaluate(accelerator, model, tokenizer, test_set, cfg.train_max_ops, cfg.eval_mode) \
        if cfg.eval_host and resume_path is None else None
    start_step = 0
    if resume_path is not None:
        state = load_checkpoint(accelerator, resume_path, model, optimizer, scheduler)
        start_step = int(state["step"])
        host_alone = state.get("host_alone")
        log(f"resumed from {resume_path} at step {start_step}")
    if main:
        if resume_path is not None:
            truncate_after(out_dir / "metrics.jsonl", start_step)
        metrics = MetricsLog(out_dir, tensorboard=cfg.tensorboard, append=resume_path is not None)
    sampler.set_position(start_step * cfg.grad_accum)
    batches = iter(torch.utils.data.DataLoader(train_data, batch_sampler=sampler, collate_fn=collate))

    bar = None
    if main and cfg.progress:
        from tqdm.auto import tqdm  # noqa: I001 - a dependency of transformers, always present
        bar = tqdm(total=total_steps, initial=start_step, desc=f"train {cfg.kind}", unit="step", dynamic_ncols=True)
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()
    if accelerator.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(accelerator.device)
    meter = Throughput(accelerator.device, skip=min(5, (total_steps - start_step) // 5))
    meter.start()
    window_t, window_tokens = time.perf_counter(), 0
    for step in range(start_step, total_steps):
        tau = None if cfg.tau_end is None else tau_at(step, total_steps, cfg.tau, cfg.tau_end)
        if tau is not None:  # a function of the step: a resumed run continues the same schedule
            set_tau(accelerator.unwrap_model(model), tau)
        loss_sum, step_tokens = torch.zeros((), device=accelerator.device), 0
        for micro in range(cfg.grad_accum):
            cpu = next(batches)
            span, n_tok = completion_span(cpu["labels"]), int(cpu["attention_mask"].sum())  # no GPU sync
            batch = {k: v.to(accelerator.device, non_blocking=True) for k, v in cpu.items()}
            ctx = accelerator.no_sync(model) if micro < cfg.grad_accum - 1 else contextlib.nullcontext()
            with ctx:
                with accelerator.autocast():
                    logits, labels = completion_loss_inputs(model, batch, span)
                    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                                           ignore_index=-100)
                accelerator.backward(loss / cfg.grad_accum)
            loss_sum += loss.detach() / cfg.grad_accum
            step_tokens += n_tok
            window_tokens += n_tok
        done = step + 1
        grad_norm = accelerator.clip_grad_norm_(params, math.inf if cfg.max_grad_norm is None else cfg.max_grad_norm)
        loss_total = _check_finite(accelerator, loss_sum, grad_norm, done, ckpt_root, run["run_id"])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        meter.step_done(step_tokens)
        if done % cfg.log_every == 0 or done == total_steps:
            loss_mean = (loss_total / accelerator.num_processes).item()
            now = time.perf_counter()
            tok_s = window_tokens / max(now - window_t, 1e-9)
            window_t, window_tokens = now, 0
            record = {"step": done, "loss": loss_mean, "lr": scheduler.get_last_lr()[0],
                      "grad_norm": float(grad_norm), "tokens_per_s_per_process": tok_s,
                      "epoch": done * cfg.grad_accum / sampler.batches_per_epoch,
                      **({"tau": tau} if tau is not None else {})}
            if accelerator.device.type == "cuda":  # rank 0's peak so far (the final record has every rank's)
                record["peak_memory_gib"] = torch.cuda.max_memory_allocated(accelerator.device) / 2**30
            if main:
                metrics.log(record)
                if bar is not None:
                    bar.set_postfix(loss=f"{loss_mean:.4f}", tok_s=f"{tok_s * accelerator.num_processes:,.0f}")
        if bar is not None:
            bar.update(1)
        if cfg.eval_every and done % cfg.eval_every == 0 and done != total_steps:
            meter.pause()
            val = evaluate(accelerator, model, tokenizer, val_set, cfg.train_max_ops, cfg.eval_mode)
            if main:
                metrics.log({"step": done, "val_accuracy": val["accuracy"]})
            meter.resume()
        if cfg.save_every and done % cfg.save_every == 0:
            meter.pause()
            position = {"micro_batches": done * cfg.grad_accum, **_position(sampler, done * cfg.grad_accum)}
            save_checkpoint(accelerator, ckpt_root, done, model, optimizer, scheduler, position, cfg.keep_last,
                            extra={"kind": cfg.kind, "total_steps": total_steps, "run_id": run["run_id"],
                                   "settings": cfg.resume_settings(accelerator.num_processes),
                                   "host_alone": host_alone})
            meter.resume()
    meter.pause()
    if bar is not None:
        bar.close()

    # throughput, evaluation, artifact
    rate = meter.tokens_per_s()
    peak = (torch.cuda.max_memory_allocated(accelerator.device) / 2**30 if accelerator.device.type == "cuda"
            else float("nan"))
    per_rank = accelerator.gather(torch.tensor([rate, peak], dtype=torch.float64, device=accelerator.device))
    per_rank = per_rank.view(-1, 2).cpu()
    throughput = {
        "timed_seconds": meter.seconds, "timed_steps": meter.steps - meter.skip, "warmup_steps": meter.skip,
        "tokens_per_s_per_process": rate,
        "tokens_per_s_total": float(per_rank[:, 0].sum()),
        "tokens_per_s_by_process": per_rank[:, 0].tolist(),
        "peak_memory_gib": peak if accelerator.device.type == "cuda" else None,
        "peak_memory_gib_by_process": per_rank[:, 1].tolist() if accelerator.device.type == "cuda" else None,
        "num_processes": accelerator.num_processes,
    }
    unit = "GPU" if accelerator.device.type == "cuda" else "process"
    log(f"throughput: {throughput['tokens_per_s_per_process']:,.0f} tokens/s per {unit}, "
        f"{throughput['tokens_per_s_total']:,.0f} total" + (
            ", peak memory " + ", ".join(f"{g:.2f}" for g in throughput["peak_memory_gib_by_process"]) + " GiB per GPU"
            if throughput["peak_memory_gib"] is not None else ""))
    final_dir = out_dir / "final"
    save_final(accelerator, model, final_dir, cfg)  # before the evaluation: a failing one loses no training
    val = evaluate(accelerator, model, tokenizer, val_set, cfg.train_max_ops, cfg.eval_mode)
    test = evaluate(accelerator, model, tokenizer, test_set, cfg.train_max_ops, cfg.eval_mode)
    results = {"kind": cfg.kind, "n": cfg.n, "host": host_desc, "steps": total_steps,
               "params": {"inserted": n_inserted, "total": n_total, "trainable": n_trainable},
               "throughput": throughput, "num_processes": accelerator.num_processes,
               "distributed_type": accelerator.distributed_type.value,
               "run_id": run["run_id"], "validation": val, "test": test, "host_alone": host_alone,
               "config": cfg.to_dict()}
    if main:
        write_json(out_dir / "results.json", results)
        metrics.log({"step": total_steps, "throughput": throughput})
        metrics.log({"step": total_steps, "val_accuracy": val["accuracy"], "test_iid_accuracy": test["iid"]["accuracy"],
                     "test_ood_accuracy": test["ood"]["accuracy"]})
        metrics.close()
        print_results(results)
        if cfg.plot:
            try:
                from .plot import plot_run
                png = plot_run(results, out_dir / "accuracy.png")
                log(f"plot: {png}")
            except ImportError as e:  # matplotlib is optional on bare GPU images
                log(f"no plot ({e})")
        log(f"inserted layers: {final_dir}; results: {out_dir / 'results.json'}")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return results


def _check_finite(accelerator, loss_sum: torch.Tensor, grad_norm, step: int, ckpt_root: Path,
                  run_id: str) -> torch.Tensor:
    """Stop before an update whose loss or gradient norm is not finite on any process (one sync per step). Under
    fp16 mixed precision the gradient scaler skips non-finite gradients itself, so only the loss is checked.
    Returns the loss summed over the processes (the step's log reuses it instead of reducing again)."""
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # FSDP2: a DTensor
    health = torch.stack([loss_sum.float(), torch.as_tensor(grad_norm, dtype=torch.float32, device=loss_sum.device)])
    if accelerator.mixed_precision == "fp16":
        health = health[:1]
    if accelerator.num_processes > 1:
        health = accelerator.reduce(health, "sum")  # NaN or inf anywhere stays NaN or inf
    if bool(torch.isfinite(health).all()):
        return health[0]
    mine = [p for p in list_checkpoints(ckpt_root) if checkpoint_run_id(p) == run_id]
    last = f"the last good checkpoint is {mine[-1]}" if mine else "no checkpoint was saved (--save-every)"
    raise TrainingDiverged(f"step {step}: the loss ({float(loss_sum):.4g} on this process) or the gradient norm "
                           f"({float(grad_norm):.4g}) is not finite; stopped before this update, so no weights of "
                           f"it were saved; {last}. Lower --lr, clip with --max-grad-norm, or use --host-dtype "
                           "float32, in a fresh run")


def _position(sampler: ShardedBatchSampler, micro_batches: int) -> dict:
    epoch, batch = divmod(micro_batches, sampler.batches_per_epoch)
    return {"epoch": epoch, "batch_in_epoch": batch}

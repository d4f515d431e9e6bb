"""The training run: host -> surgery (+ optional LoRA) -> Box data -> AdamW + schedule -> Accelerate loop with
evaluation, resumable checkpoints and logging -> `save_inserted` artifact, results.json, table and plot.

Before any work (`preflight`, on every process; a failure anywhere stops all of them with one message): the
output directory's lock, a fresh run's refusal of another run's outputs (or `--overwrite`), a resume's settings
against the checkpoint's, non-empty data splits, the host's source and size. A non-finite loss or gradient norm
stops the run at the next log record, evaluation or checkpoint with nothing of that step or later saved, so the
checkpoints and `final/` stay finite (tracked on the device: no step waits for the host). `final/` is saved before
the evaluation, so a failing evaluation loses no training.

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
from .profile import StepProfile, profile_table
from .schedule import build_scheduler, tau_at

class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm is not finite: the run stops before applying that update."""


# ---------------------------------------------------------------- setup

def resolve_precision(flag: str | None, on_cuda: bool, env=os.environ) -> tuple[str, str]:
    """(mixed precision, where it came from): the --mixed-precision flag, else Accelerate's setting (`accelerate
    config` or `accelerate launch --mixed_precision` reach the process as ACCELERATE_MIXED_PRECISION), else auto;
    auto is bf16 on CUDA and no on the CPU."""
    source = "--mixed-precision"
    if flag is None and env.get("ACCELERATE_MIXED_PRECISION"):
        flag, source = env["ACCELERATE_MIXED_PRECISION"].lower(), "Accelerate's config (ACCELERATE_MIXED_PRECISION)"
        if flag not in ("no", "bf16", "fp16"):
            raise UsageError(f"Accelerate's config sets mixed precision {flag!r} (ACCELERATE_MIXED_PRECISION), which "
                             "this trainer does not support; use no, bf16 or fp16 (accelerate config, or "
                             "--mixed-precision)")
    elif flag is None:
        flag, source = "auto", "default"
    if flag == "auto":
        return ("bf16" if on_cuda else "no"), f"{source}: auto"
    return flag, source


def make_accelerator(cfg: TrainConfig):
    """The run's Accelerator. DDP: only the trainable tensors are in its buckets (frozen ones have requires_grad
    False); gradients are views of the buckets (no copy in and out); buffers are not broadcast before every
    forward (the host's and the inserted layers' buffers are the same on every rank); a static graph when every
    step runs the same graph with one backward."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    on_cuda = torch.cuda.is_available() and not cfg.cpu and os.environ.get("ACCELERATE_USE_CPU", "").lower() \
        not in ("1", "true", "yes")
    precision, source = resolve_precision(cfg.mixed_precision, on_cuda)
    kwargs = dict(cpu=cfg.cpu or not on_cuda, mixed_precision=precision)
    if cfg.fsdp:
        from accelerate.utils import FullyShardedDataParallelPlugin

        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap", reshard_after_forward=True,
            state_dict_type="FULL_STATE_DICT", cpu_ram_efficient_loading=False)
    else:
        kwargs["kwargs_handlers"] = [DistributedDataParallelKwargs(
            find_unused_parameters=False, gradient_as_bucket_view=True, broadcast_buffers=False,
            bucket_cap_mb=cfg.ddp_bucket_mb, static_graph=cfg.grad_accum == 1 and not cfg.gradient_checkpointing)]
    accelerator = Accelerator(**kwargs)
    accelerator.precision_source = source
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

    lcfg = lora_config(cfg)
    inject_adapter_in_model(lcfg, model)
    if not any("lora_" in n for n, _ in model.named_parameters()):
        raise UsageError(f"--lora-targets {sorted(lcfg.target_modules)} matched no module of this host")
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
    """AdamW; weight decay on matrices (and complex weights), none on vectors (norms, biases, per-head scalars).
    Real tensors take the fused kernel (one launch for all of them instead of a few per tensor group); complex
    ones, which it does not take, the multi-tensor one."""
    groups = []
    for decay in (True, False):
        for complex_ in (False, True):
            params = [p for p in model.parameters()
                      if p.requires_grad and (p.dim() >= 2) == decay and p.is_complex() == complex_]
            if params:
                groups.append({"params": params, "weight_decay": cfg.weight_decay if decay else 0.0,
                               **({"foreach": True} if complex_ else {"fused": True})})
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)


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
        run_id = check_resume(read_state(path), cfg, world, accelerator.mixed_precision, path)
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
            # after the checks: never a wrong one; with the mixed precision in effect (flag or Accelerate's config)
            write_json(Path(cfg.output_dir) / "config.json",
                       {**cfg.to_dict(), "mixed_precision": accelerator.mixed_precision})
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
        f"device {accelerator.device}, mixed precision {accelerator.mixed_precision} (from "
        f"{getattr(accelerator, 'precision_source', 'the launcher')})")

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
    # workers collate the next batches while the device trains (the sampler, which fixes the order, runs here);
    # pinned host memory lets the copies below run asynchronously
    loader = torch.utils.data.DataLoader(train_data, batch_sampler=sampler, collate_fn=collate,
                                         num_workers=cfg.num_workers, pin_memory=accelerator.device.type == "cuda")
    batches = iter(loader)

    bar = None
    if main and cfg.progress:
        from tqdm.auto import tqdm  # noqa: I001 - a dependency of transformers, always present
        bar = tqdm(total=total_steps, initial=start_step, desc=f"train {cfg.kind}", unit="step", dynamic_ncols=True)
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()
    if accelerator.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(accelerator.device)
    meter = Throughput(accelerator.device, skip=min(5, (total_steps - start_step) // 5))
    profile = StepProfile(accelerator.device, max(start_step + meter.skip, total_steps - cfg.profile_steps),
                          cfg.profile_steps)
    health = Divergence(accelerator, start_step, check_grad_norm=accelerator.mixed_precision != "fp16")
    meter.start()
    window_t, window_tokens = time.perf_counter(), 0
    for step in range(start_step, total_steps):
        if profile.begin_step(step):
            meter.freeze()  # synchronised steps are not throughput
        tau = None if cfg.tau_end is None else tau_at(step, total_steps, cfg.tau, cfg.tau_end)
        if tau is not None:  # a function of the step: a resumed run continues the same schedule
            set_tau(accelerator.unwrap_model(model), tau)
        loss_sum, step_tokens = torch.zeros((), device=accelerator.device), 0
        for micro in range(cfg.grad_accum):
            with profile.phase("data"):
                cpu = next(batches)
                span, n_tok = completion_span(cpu["labels"]), int(cpu["attention_mask"].sum())  # no GPU sync
                batch = {k: v.to(accelerator.device, non_blocking=True) for k, v in cpu.items()}
                # 0/1 by construction: as bool the surgery skips its value check (a host sync every forward)
                batch["attention_mask"] = batch["attention_mask"].bool()
            ctx = accelerator.no_sync(model) if micro < cfg.grad_accum - 1 else contextlib.nullcontext()
            with ctx:
                with profile.phase("forward"), accelerator.autocast():
                    logits, labels = completion_loss_inputs(model, batch, span)
                    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
                with profile.phase("backward"):
                    accelerator.backward(loss / cfg.grad_accum)
            loss_sum += loss.detach() / cfg.grad_accum
            step_tokens += n_tok
            window_tokens += n_tok
        done = step + 1
        with profile.phase("optimizer"):
            grad_norm = accelerator.clip_grad_norm_(params, math.inf if cfg.max_grad_norm is None
                                                    else cfg.max_grad_norm)
            health.record(loss_sum, grad_norm)  # on the device: no wait here
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        meter.step_done(step_tokens)
        logging = done % cfg.log_every == 0 or done == total_steps
        evaluating = bool(cfg.eval_every) and done % cfg.eval_every == 0 and done != total_steps
        saving = bool(cfg.save_every) and done % cfg.save_every == 0
        if logging or evaluating or saving:  # the host looks at the device's numbers only here
            with profile.phase("check_and_log"):
                loss_mean = health.check(done, ckpt_root, run["run_id"])
                if logging:
                    now = time.perf_counter()
                    tok_s = window_tokens / max(now - window_t, 1e-9)
                    window_t, window_tokens = now, 0
                    record = {"step": done, "loss": loss_mean, "lr": scheduler.get_last_lr()[0],
                              "grad_norm": float(_full(grad_norm)), "tokens_per_s_per_process": tok_s,
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
        profile.end_step()
        if evaluating:
            meter.pause()
            with profile.evaluation("validation"):
                val = evaluate(accelerator, model, tokenizer, val_set, cfg.train_max_ops, cfg.eval_mode)
            if main:
                metrics.log({"step": done, "val_accuracy": val["accuracy"]})
            meter.resume()
        if saving:
            meter.pause()
            position = {"micro_batches": done * cfg.grad_accum, **_position(sampler, done * cfg.grad_accum)}
            save_checkpoint(accelerator, ckpt_root, done, model, optimizer, scheduler, position, cfg.keep_last,
                            extra={"kind": cfg.kind, "total_steps": total_steps, "run_id": run["run_id"],
                                   "settings": cfg.resume_settings(accelerator.num_processes,
                                                                   accelerator.mixed_precision),
                                   "host_alone": host_alone})
            meter.resume()
    meter.pause()
    del batches  # stops the loader's workers
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
    with profile.evaluation("validation"):
        val = evaluate(accelerator, model, tokenizer, val_set, cfg.train_max_ops, cfg.eval_mode)
    with profile.evaluation("test"):
        test = evaluate(accelerator, model, tokenizer, test_set, cfg.train_max_ops, cfg.eval_mode)
    results = {"kind": cfg.kind, "n": cfg.n, "host": host_desc, "steps": total_steps,
               "params": {"inserted": n_inserted, "total": n_total, "trainable": n_trainable},
               "throughput": throughput, "num_processes": accelerator.num_processes,
               "distributed_type": accelerator.distributed_type.value,
               "run_id": run["run_id"], "validation": val, "test": test, "host_alone": host_alone,
               "step_profile": profile.result(),
               "config": {**cfg.to_dict(), "mixed_precision": accelerator.mixed_precision}}
    if main:
        write_json(out_dir / "results.json", results)
        if results["step_profile"] is not None:
            write_json(out_dir / "step_profile.json", results["step_profile"])
            log(profile_table(results["step_profile"]))
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

"""Getting a host model and its tokenizer: a user's checkpoint (local path, or a hub id the user passed), a
random-weight host of a real configuration (throughput runs), or the embedded tiny Granite-4.0 host.

Before anything is built, the host is checked: a hub id needs the local cache or a reachable hub (`model_source`),
and its weights (parameters x bytes, counted on the meta device from the configuration) must fit in half the memory
available to a process (`check_memory`). A host saved without a tokenizer gets the Box word tokenizer only if its
vocabulary has exactly the Box tokenizer's size, and the fallback is logged.

The embedded host exists so that `python -m llm_surgery.train` runs offline on a laptop CPU. A random frozen
host cannot learn Box through a few inserted layers. The package ships one pretrained on the Box language
(`llm_surgery/data/box_host/`, made by `python -m llm_surgery.train.make_host`; `embedded_host` checks it against
its SHA256SUMS). Where it is missing or corrupt, or for `--tiny-host nemotron`, a tiny host is pretrained briefly
on Box IID data with all weights trainable (`pretrain_host`), saved with `save_pretrained` into a cache directory
keyed by the hash of everything that determines it, and loaded back frozen like any user checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
from pathlib import Path
from urllib.parse import urlparse

import torch

from .config import UsageError
from .messages import logger

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PRETRAIN_VERSION = 2  # bump when pretrain_host changes what it produces
TINY_HOST = {"hidden_size": 64, "pattern": "M*M*M*M*", "mamba_chunk_size": 64}
MEMORY_HEADROOM = 2.0  # a host's weights may take at most 1/2 of a process's memory (the rest: activations etc.)


def resolve_dtype(host_dtype: str, on_cuda: bool) -> torch.dtype:
    if host_dtype == "auto":
        return torch.bfloat16 if on_cuda else torch.float32
    if host_dtype not in DTYPES:
        raise UsageError(f"host_dtype must be 'auto' or one of {sorted(DTYPES)}, got {host_dtype!r}")
    if DTYPES[host_dtype] == torch.float16 and not on_cuda:
        raise UsageError("--host-dtype float16 needs a CUDA device: on the CPU the float16 host overflows and "
                         "training turns to NaN; use float32 or bfloat16")
    return DTYPES[host_dtype]


def _looks_local(name: str) -> bool:
    """Paths the user clearly meant as local (a hub id is `org/name`)."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1


def model_source(name: str) -> str:
    """`--model` as transformers should load it: an existing save_pretrained directory, or a hub id that is in the
    local Hugging Face cache or can be downloaded. Without network a hub id fails here, in one line, instead of
    in transformers' retries. The probe is one TCP connection to the hub endpoint (skipped behind a proxy)."""
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise UsageError(f"{path} has no config.json; --model needs a save_pretrained directory or a hub id")
        return str(path)
    if _looks_local(name):
        raise UsageError(f"model path {name} does not exist")
    from huggingface_hub import constants, try_to_load_from_cache

    try:
        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return name
    except ValueError:  # not a valid repo id
        raise UsageError(f"--model {name!r} is neither a local directory nor a hub id (org/name)") from None
    fix = "pass --model /path/to/a/local/checkpoint (a save_pretrained directory), or run with network access"
    if constants.HF_HUB_OFFLINE:
        raise UsageError(f"--model {name} is a hub id that is not in the local cache and HF_HUB_OFFLINE is set; {fix}")
    if not any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        url = urlparse(os.environ.get("HF_ENDPOINT") or constants.ENDPOINT)
        try:
            socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                     timeout=5).close()
        except OSError as e:
            raise UsageError(f"--model {name} is a hub id that is not in the local cache, and the hub "
                             f"({url.geturl()}) cannot be reached ({e}); {fix}") from None
    return name


def meta_host(cfg):
    """(the configured host on the meta device, its description), from its configuration alone: no weights read,
    no memory taken. The checks before a run count its parameters and plan the surgery on it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if cfg.random_init_config:
        from llm_surgery.hosts import HOST_CONFIGS, build_host

        if cfg.random_init_config not in HOST_CONFIGS:
            raise UsageError(f"unknown --random-init-config {cfg.random_init_config!r}; known: "
                             f"{', '.join(sorted(HOST_CONFIGS))}")
        return build_host(cfg.random_init_config, device="meta"), cfg.random_init_config
    if cfg.model:
        source = model_source(cfg.model)
    elif cfg.tiny_host == "granite" and shipped_host_problem(SHIPPED_HOST) is None:
        source = str(SHIPPED_HOST)
    else:  # the host `pretrain_host` makes (or has cached)
        from llm_surgery.box_data import build_box_tokenizer

        return build_tiny(cfg.tiny_host, len(build_box_tokenizer()), cfg.seed, device="meta"), \
            f"the embedded tiny {cfg.tiny_host} host"
    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as e:
        raise UsageError(f"--model {source}: its config.json does not load "
                         f"({(str(e).strip().splitlines() or [type(e).__name__])[0][:200]})") from None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return model, source


def host_parameters(cfg, meta=None) -> tuple[int, str] | None:
    """(parameter count, description) of the configured host from its configuration alone (`meta_host`, or the
    `meta` it already returned); None for the embedded tiny host."""
    if not (cfg.random_init_config or cfg.model):
        return None
    model, desc = meta or meta_host(cfg)
    return sum(p.numel() for p in model.parameters()), desc


def check_surgery(cfg, meta=None) -> None:
    """Refuse, before any weights load, kinds, n and positions the configured host cannot take (`plan_insertion`
    on the host built on the meta device: `meta_host`, or the `meta` it already returned)."""
    from llm_surgery.insert.surgery import plan_insertion

    model, desc = meta or meta_host(cfg)
    try:
        plan_insertion(model, cfg.inserted_kinds(), cfg.n, positions=cfg.positions, **cfg.mixer_kwargs())
    except (ValueError, TypeError) as e:
        raise UsageError(f"the surgery refused these settings on {desc}: {e}") from None


def available_memory(device: torch.device) -> int:
    """Bytes free on the GPU, or the machine's available RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil  # an Accelerate dependency

    return psutil.virtual_memory().available


def check_memory(params: int, desc: str, dtype: torch.dtype, device: torch.device, shards: int = 1,
                 processes_here: int = 1) -> None:
    """Refuse a host whose weights (per process: `shards` under FSDP) need more than 1/MEMORY_HEADROOM of the
    memory available to one process (on the CPU, the processes of this machine share its RAM)."""
    need = params * dtype.itemsize / shards
    have = available_memory(device) / (1 if device.type == "cuda" else processes_here)
    if need * MEMORY_HEADROOM > have:
        where = f"GPU {device}" if device.type == "cuda" else "this machine's RAM" + (
            f" shared by {processes_here} processes" if processes_here > 1 else "")
        raise UsageError(f"host {desc} needs {need / 2**30:.1f} GiB per process for its weights ({params / 1e9:.2f}B "
                         f"parameters x {dtype.itemsize} bytes{f' / {shards} shards' if shards > 1 else ''}) and "
                         f"about twice that to train; {where} has {have / 2**30:.1f} GiB available. Use a smaller "
                         "host, a machine with more memory, --fsdp over more GPUs, or --no-memory-check to try "
                         "anyway")


def load_tokenizer(source: str, vocab_size: int, log=logger.info):
    """The host's own tokenizer, or the Box word tokenizer for a host built with it (same vocabulary size), said
    in the log; any other host without a loadable tokenizer is refused."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as e:
        from llm_surgery.box_data import build_box_tokenizer

        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        tokenizer = build_box_tokenizer()
        if len(tokenizer) != vocab_size:
            raise UsageError(f"{source} has no tokenizer that loads ({why}); the Box word tokenizer "
                             f"({len(tokenizer)} tokens) fits only a host with that vocabulary, and this one has "
                             f"{vocab_size}: save the host's tokenizer with it") from None
        log(f"{source} has no tokenizer that loads ({why}); using the Box word tokenizer ({len(tokenizer)} tokens, "
            "the size of this host's vocabulary)")
        return tokenizer


def load_pretrained(name: str, dtype: torch.dtype, device: torch.device, log=logger.info):
    """A local checkpoint directory or a hub id (downloaded by transformers only because the user named it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    source = model_source(name)
    tokenizer = load_tokenizer(source, AutoConfig.from_pretrained(source).vocab_size, log)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    return model.to(device), tokenizer


def random_init_host(config_name: str, dtype: torch.dtype, device: torch.device, seed: int):
    """Random weights in a real host's shapes (llm_surgery.hosts.HOST_CONFIGS), built directly on `device`,
    with the Box word tokenizer (its ids fit every real vocabulary)."""
    from llm_surgery.box_data import build_box_tokenizer
    from llm_surgery.hosts import HOST_CONFIGS, build_host

    if config_name not in HOST_CONFIGS:
        raise UsageError(f"unknown --random-init-config {config_name!r}; known: {', '.join(sorted(HOST_CONFIGS))}")
    torch.manual_seed(seed)
    model = build_host(config_name, device=device, dtype=dtype)
    return model, build_box_tokenizer()


# ---------------------------------------------------------------- embedded tiny host

SHIPPED_HOST = Path(__file__).resolve().parent.parent / "data" / "box_host"
HASHES = "SHA256SUMS"  # "<sha256>  <file name>" per line, beside the files it covers
REQUIRED = ("config.json", "model.safetensors")


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def shipped_host_problem(directory: str | Path = SHIPPED_HOST) -> str | None:
    """Why the shipped host cannot be used, in one line; None when every file its SHA256SUMS lists is there with
    that hash (and the weights and config are among them)."""
    directory = Path(directory)
    sums = directory / HASHES
    if not sums.is_file():
        return f"{sums} is missing"
    listed = {}
    for line in sums.read_text().splitlines():
        parts = line.split()
        if len(parts) != 2:
            return f"{sums} has a malformed line {line!r}"
        listed[parts[1]] = parts[0]
    for name in REQUIRED:
        if name not in listed:
            return f"{sums} does not cover {name}"
    for name, digest in listed.items():
        if not (directory / name).is_file():
            return f"{directory / name} is missing"
        if file_sha256(directory / name) != digest:
            return f"{directory / name} does not match its sha256 in {HASHES} (corrupt)"
    return None


def embedded_host(cfg, log=logger.info) -> Path:
    """The host of runs without --model: the shipped one when intact (granite), else `pretrain_host`."""
    if cfg.tiny_host == "granite":
        problem = shipped_host_problem(SHIPPED_HOST)  # read at call time (tests point it elsewhere)
        if problem is None:
            return SHIPPED_HOST
        log(f"shipped host not used: {problem}; pretraining a tiny host instead ({cfg.pretrain_steps} steps)")
    return pretrain_host(cfg, log=log)


def tiny_host_spec(cfg) -> dict:
    """Everything that determines the pretrained tiny host (its cache key)."""
    return {
        "version": PRETRAIN_VERSION, "arch": cfg.tiny_host, **TINY_HOST, "steps": cfg.pretrain_steps,
        "lr": cfg.pretrain_lr, "num_sequences": cfg.num_sequences, "train_max_ops": cfg.train_max_ops,
        "data_seed": cfg.data_seed, "seed": cfg.seed,
    }


def tiny_host_dir(cfg) -> Path:
    spec = tiny_host_spec(cfg)
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cfg.cache_dir).expanduser() / "hosts" / f"tiny-{cfg.tiny_host}-{digest}"


def build_tiny(arch: str, vocab_size: int, seed: int, device: str = "cpu"):
    from llm_surgery.hosts import build_tiny_host

    pattern = TINY_HOST["pattern"] if arch == "granite" else "M*-M*-M*-M*-"
    chunk = {"mamba_chunk_size": TINY_HOST["mamba_chunk_size"]} if arch == "granite" else {"chunk_size": 64}
    return build_tiny_host(arch, seed=seed, hidden_size=TINY_HOST["hidden_size"], vocab_size=vocab_size,
                           pattern=pattern, device=device, **chunk)


def pretrain_host(cfg, log=logger.info) -> Path:
    """Pretrain the tiny host on Box IID data (all weights trainable) unless cached; returns its directory.

    Runs in one process (the caller makes the other ranks wait); the result is written to a temporary
    directory and renamed, so an interrupted pretraining never leaves a half-written cache entry.
    """
    from llm_surgery.box_data import build_box_tokenizer

    from .data import make_splits

    out = tiny_host_dir(cfg)
    if (out / "config.json").is_file():
        return out
    tokenizer = build_box_tokenizer()
    model = build_tiny(cfg.tiny_host, len(tokenizer), cfg.seed)
    splits = make_splits(cfg.num_sequences, cfg.data_seed, cfg.train_max_ops, cfg.train_max_ops)
    log(f"pretraining the embedded tiny {cfg.tiny_host} host ({sum(p.numel() for p in model.parameters()):,} "
        f"params) for {cfg.pretrain_steps} steps on Box IID data; cached at {out}")
    loss = pretrain(model, tokenizer, splits["train"], steps=cfg.pretrain_steps, batch_size=16,
                    lr=cfg.pretrain_lr, seed=cfg.seed, log=log)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "pretrain.json").write_text(json.dumps({**tiny_host_spec(cfg), "final_loss": loss}, indent=2))
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():  # another process finished first: keep theirs
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, out)
    return out


def pretrain(model, tokenizer, records, *, steps: int, batch_size: int, lr: float, seed: int = 0,
             all_tokens: bool = False, device: torch.device | str = "cpu", **loop) -> float:
    """Train every weight of `model` on Box `records` (`train_all_weights`); returns the last loss. `all_tokens`
    puts the loss on every real token (the context too, where naming the box of a moved object is itself a
    state-tracking target) instead of on the completion only."""
    return train_all_weights(model, task_batches(tokenizer, records, batch_size, seed, all_tokens),
                             steps=steps, lr=lr, device=device, **loop)


def task_batches(tokenizer, records, batch_size: int, seed: int, all_tokens: bool = False):
    """Batches of Box `records` in the trainer's data order, labels on the completion (on every real token with
    `all_tokens`)."""
    from llm_surgery.box_data import BoxCollator

    from .data import ShardedBatchSampler, TokenizedBox

    data = TokenizedBox(tokenizer, records)
    sampler = ShardedBatchSampler(len(data), batch_size, 0, 1, seed)
    for batch in torch.utils.data.DataLoader(data, batch_sampler=sampler,
                                             collate_fn=BoxCollator(tokenizer, pad_to_multiple_of=8)):
        if all_tokens:
            batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        yield batch


def train_all_weights(model, batches, *, steps: int, lr: float, warmup_ratio: float = 0.1, min_lr_ratio: float = 0.0,
                      device: torch.device | str = "cpu", autocast_dtype: torch.dtype | None = None,
                      log=logger.info, log_every: int = 50, on_eval=None, eval_every: int = 0,
                      max_seconds: float | None = None, stop_at: int = 0) -> float:
    """The host pretraining loop (the embedded host's, the shipped host's in `make_host`, the benchmark's): every
    weight trains on `batches` (dicts with labels) with AdamW (weight decay 0.1), clipping at 1.0 and a linear
    warm-up then cosine to `min_lr_ratio` x lr over `steps`; returns the last logged loss. It ends early after
    `stop_at` steps or past `max_seconds` (a wall-clock budget; the schedule is not stretched to fit).
    `on_eval(step, loss)` is called every `eval_every` steps and at the end, with the model in eval mode."""
    from .schedule import build_scheduler

    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    device = torch.device(device)
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, fused=device.type == "cuda")
    lr_factor = build_scheduler(opt, steps, warmup_ratio, "cosine", min_lr_ratio).lr_lambdas[0]
    t0, loss = time.time(), float("nan")
    for done in range(1, steps + 1):
        for group in opt.param_groups:
            group["lr"] = lr * lr_factor(done - 1)
        batch = {k: v.to(device, non_blocking=True) for k, v in next(batches).items()}
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            out = model(**batch, use_cache=False)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        over = max_seconds is not None and time.time() - t0 > max_seconds
        last = done == steps or done == stop_at or over
        evaluating = on_eval is not None and ((eval_every and done % eval_every == 0) or last)
        if done % log_every == 0 or last or evaluating:
            loss = out.loss.item()
        if done % log_every == 0 or last:
            stop = f"over the {max_seconds:.0f} s budget" if over else f"--stop-at {stop_at}"
            log(f"  pretrain step {done}/{steps} loss {loss:.4f} ({time.time() - t0:.0f}s)"
                + ("" if done == steps else f"; stopping: {stop}" if last else ""))
        if evaluating:
            model.eval()
            on_eval(done, loss)
            model.train()
        if last:
            break
    model.eval()
    return loss

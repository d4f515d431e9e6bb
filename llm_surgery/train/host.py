"""Getting a host model and its tokenizer: a user's checkpoint (local path, or a hub id the user passed), a
random-weight host of a real configuration (throughput runs), or the embedded tiny Granite-4.0 host.

The embedded host exists so that `python -m llm_surgery.train` runs offline on a laptop CPU. A random frozen
host cannot learn Box through a few inserted layers, so it is first pretrained briefly on Box IID data with all
weights trainable (`pretrain_host`), saved with `save_pretrained` into a cache directory keyed by the hash of
everything that determines it, and loaded back frozen like any user checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PRETRAIN_VERSION = 1  # bump when pretrain_host changes what it produces
TINY_HOST = {"hidden_size": 64, "pattern": "M*M*M*M*", "mamba_chunk_size": 64}


def resolve_dtype(host_dtype: str, on_cuda: bool) -> torch.dtype:
    if host_dtype == "auto":
        return torch.bfloat16 if on_cuda else torch.float32
    if host_dtype not in DTYPES:
        raise ValueError(f"host_dtype must be 'auto' or one of {sorted(DTYPES)}, got {host_dtype!r}")
    return DTYPES[host_dtype]


def _looks_local(name: str) -> bool:
    """Paths the user clearly meant as local (a hub id is `org/name`)."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1


def load_pretrained(name: str, dtype: torch.dtype, device: torch.device):
    """A local checkpoint directory or a hub id (downloaded by transformers only because the user named it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json; --model needs a save_pretrained directory or a "
                                    "hub id")
        name = str(path)
    elif _looks_local(name):
        raise FileNotFoundError(f"model path {name} does not exist")
    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError):
        from llm_surgery.box_data import build_box_tokenizer

        tokenizer = build_box_tokenizer()
        if len(tokenizer) > model.config.vocab_size:
            raise ValueError(f"{name} has no tokenizer, and the Box word tokenizer ({len(tokenizer)} tokens) does "
                             f"not fit its vocabulary of {model.config.vocab_size}") from None
    return model.to(device), tokenizer


def random_init_host(config_name: str, dtype: torch.dtype, device: torch.device, seed: int):
    """Random weights in a real host's shapes (llm_surgery.hosts.HOST_CONFIGS), built directly on `device`,
    with the Box word tokenizer (its ids fit every real vocabulary)."""
    from llm_surgery.box_data import build_box_tokenizer
    from llm_surgery.hosts import HOST_CONFIGS, build_host

    if config_name not in HOST_CONFIGS:
        raise ValueError(f"unknown --random-init-config {config_name!r}; known: {', '.join(sorted(HOST_CONFIGS))}")
    torch.manual_seed(seed)
    model = build_host(config_name, device=device, dtype=dtype)
    return model, build_box_tokenizer()


# ---------------------------------------------------------------- embedded tiny host

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


def build_tiny(arch: str, vocab_size: int, seed: int):
    from llm_surgery.hosts import build_tiny_host

    pattern = TINY_HOST["pattern"] if arch == "granite" else "M*-M*-M*-M*-"
    chunk = {"mamba_chunk_size": TINY_HOST["mamba_chunk_size"]} if arch == "granite" else {"chunk_size": 64}
    return build_tiny_host(arch, seed=seed, hidden_size=TINY_HOST["hidden_size"], vocab_size=vocab_size,
                           pattern=pattern, **chunk)


def pretrain_host(cfg, log=print) -> Path:
    """Pretrain the tiny host on Box IID data (all weights trainable) unless cached; returns its directory.

    Runs in one process (the caller makes the other ranks wait); the result is written to a temporary
    directory and renamed, so an interrupted pretraining never leaves a half-written cache entry.
    """
    from llm_surgery.box_data import BoxCollator, build_box_tokenizer

    from .data import ShardedBatchSampler, TokenizedBox, make_splits

    out = tiny_host_dir(cfg)
    if (out / "config.json").is_file():
        return out
    tokenizer = build_box_tokenizer()
    model = build_tiny(cfg.tiny_host, len(tokenizer), cfg.seed)
    model.train()
    splits = make_splits(cfg.num_sequences, cfg.data_seed, cfg.train_max_ops, cfg.train_max_ops)
    data = TokenizedBox(tokenizer, splits["train"])
    batch_size = 16
    sampler = ShardedBatchSampler(len(data), batch_size, 0, 1, cfg.seed)
    loader = iter(torch.utils.data.DataLoader(data, batch_sampler=sampler,
                                              collate_fn=BoxCollator(tokenizer, pad_to_multiple_of=8)))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.pretrain_lr, weight_decay=0.1)
    warmup = max(1, cfg.pretrain_steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / warmup, 0.5 * (
        1 + math.cos(math.pi * min(1.0, (s - warmup) / max(1, cfg.pretrain_steps - warmup))))))
    log(f"pretraining the embedded tiny {cfg.tiny_host} host ({sum(p.numel() for p in model.parameters()):,} "
        f"params) for {cfg.pretrain_steps} steps on Box IID data; cached at {out}")
    t0, loss = time.time(), float("nan")
    for step in range(cfg.pretrain_steps):
        batch = next(loader)
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % 50 == 0 or step + 1 == cfg.pretrain_steps:
            log(f"  pretrain step {step + 1}/{cfg.pretrain_steps} loss {loss.item():.4f} "
                f"({time.time() - t0:.0f}s)")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "pretrain.json").write_text(json.dumps({**tiny_host_spec(cfg), "final_loss": loss.item()}, indent=2))
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():  # another process finished first: keep theirs
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, out)
    return out

"""The trainer's typed config: one dataclass, and a command line generated from its fields so that every
setting is overridable (`--kind mamba2 --n 2 --lr 3e-4 ...`) and recipes only change defaults."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field

from llm_surgery.cli import Parser, json_object
from llm_surgery.layers.registry import MIXER_KINDS as KINDS, constructor_options

SCHEDULES = ("constant", "cosine")
PRECISIONS = ("auto", "no", "bf16", "fp16")
HOST_DTYPES = ("auto", "float32", "bfloat16", "float16")
# Settings a resumed run may change: logging, checkpoint cadence, evaluation batching, kernels and where outputs
# go. Every other field (and the number of processes) must equal the checkpoint's, or `--resume` refuses.
MAY_CHANGE_ON_RESUME = ("output_dir", "resume", "overwrite", "progress", "tensorboard", "plot", "log_every",
                        "eval_every", "save_every", "keep_last", "eval_batch_size", "cache_dir", "quick_autotune",
                        "retune", "host_kernels", "gradient_checkpointing", "memory_check", "num_workers",
                        "profile_steps", "ddp_bucket_mb", "cuda_graphs")


class UsageError(ValueError):
    """A setting or input the user can fix. The command line prints it as one line and exits with status 2."""


@dataclass
class TrainConfig:
    """Every knob of a run. `None` model means the embedded tiny host (built, pretrained on Box and cached)."""

    # host and surgery
    model: str | None = field(default=None, metadata={"help": "local checkpoint dir or hub id (the hub is asked only "
                                                               "for an id you pass); none = the Box host shipped in "
                                                               "the package (llm_surgery/data/box_host)"})
    random_init_config: str | None = field(default=None, metadata={
        "help": "build a random-weight host of this named real configuration (throughput runs; takes "
                "precedence over --model)"})
    kind: str = field(default="pdssm", metadata={"help": f"inserted mixer: {', '.join(KINDS)}; or n of them "
                                                         "joined by '+', one per inserted layer in order "
                                                         "(mixed insertion, e.g. pdssm+mamba2+pdssm+mamba2)"})
    n: int = field(default=4, metadata={"help": "number of inserted layers"})
    positions: list[int] | None = field(default=None, metadata={
        "help": "indices into the host's attention blocks (0 = the first) to insert before; none = n blocks spread "
                "evenly over depth"})
    mixer_options: str = field(default="{}", metadata={"help": "JSON dict of mixer constructor options"})
    tau: float | None = field(default=None, metadata={"help": "PD-SSM selection temperature (set_tau); the start "
                                                            "of the annealing when --tau-end is given; none = the "
                                                            "layer's own, 1.0"})
    tau_end: float | None = field(default=None, metadata={"help": "anneal the PD-SSM temperature geometrically from "
                                                                "--tau to this at the last step; none = no annealing"})
    host_dtype: str = field(default="auto", metadata={"help": f"frozen host dtype: {', '.join(HOST_DTYPES)}"})
    lora_r: int = field(default=0, metadata={"help": "LoRA rank on the host attention projections (0 = off)"})
    lora_alpha: float = field(default=16.0, metadata={"help": "LoRA scaling numerator (scale = alpha / r)"})
    lora_dropout: float = field(default=0.0, metadata={"help": "dropout on the LoRA input, in [0, 1)"})
    lora_targets: str = field(default="q_proj,k_proj,v_proj,o_proj", metadata={
        "help": "comma list of the host's module names that get LoRA adapters"})
    gradient_checkpointing: bool = field(default=False, metadata={
        "help": "recompute the host's activations in the backward (less memory, more time; no CUDA graphs)"})

    # embedded tiny host
    tiny_host: str = field(default="granite", metadata={"help": "architecture of the embedded host: granite or "
                                                                "nemotron"})
    pretrain_steps: int = field(default=150, metadata={"help": "steps of full pretraining of the embedded host "
                                                               "on Box IID data (cached by config hash)"})
    pretrain_lr: float = field(default=3e-3, metadata={"help": "learning rate of that pretraining"})
    cache_dir: str = field(default="~/.cache/llm_surgery", metadata={
        "help": "where a pretrained embedded host is cached"})

    # data
    dataset: str = field(default="box", metadata={
        "help": "box (generated Box data), or your own: a local .jsonl/.json/.csv/.parquet file or folder, or a hub "
                "dataset id (online); columns text (language modelling), prompt + completion (loss on the "
                "completion) or messages (chat template; loss on the assistant turns)"})
    eval_ratio: float = field(default=0.1, metadata={"help": "own data without a validation or test split: this "
                                                             "share of train is held out (seeded by --data-seed)"})
    max_length: int | None = field(default=None, metadata={"help": "own data: the longest record in tokens "
                                                                   "(none = no limit); see --over-length"})
    over_length: str = field(default="drop", metadata={"help": "own data over --max-length: drop (left out) or "
                                                                "truncate (cut to its first --max-length tokens); "
                                                                "counted and reported either way"})
    eval_generate: bool = field(default=False, metadata={
        "help": "own prompt-completion or conversational data: also the exact match of the greedy completion"})
    num_sequences: int = field(default=200, metadata={"help": "Box sequences over train/validation/test"})
    train_max_ops: int = field(default=6, metadata={
        "help": "operations per train/validation sequence (contexts hold 0..this many; more is OOD)"})
    test_max_ops: int = field(default=26, metadata={"help": "operations per test sequence (contexts hold 0..this "
                                                            "many)"})
    data_seed: int = field(default=2255, metadata={"help": "seed of the generated Box splits"})
    # 1134 = 6 whole test sequences (27 prefixes x 7 boxes at --test-max-ops 26): the main job's test set
    max_eval_examples: int | None = field(default=1134, metadata={
        "help": "at most this many examples per evaluated split (Box: whole sequences while they fit, then whole "
                "states of the next at evenly spread numbers of operations, llm_surgery.train.data.cap_records; own "
                "data: the first ones); none = the whole split"})

    # optimisation
    lr: float = field(default=3e-4, metadata={"help": "peak learning rate of the inserted layers (AdamW)"})
    dictionary_lr_scale: float = field(default=1.0, metadata={
        "help": "Flash PD-SSM's dictionary logits train at this multiple of --lr (its selection of transitions can "
                "drift from where it started faster than the rest learns)"})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay on matrices (none on vectors)"})
    adam_beta1: float = field(default=0.9, metadata={"help": "AdamW beta1, in [0, 1)"})
    adam_beta2: float = field(default=0.999, metadata={"help": "AdamW beta2, in [0, 1)"})
    adam_eps: float = field(default=1e-8, metadata={"help": "AdamW epsilon"})
    schedule: str = field(default="constant", metadata={"help": f"{', '.join(SCHEDULES)} (after linear warm-up)"})
    warmup_ratio: float = field(default=0.1, metadata={"help": "linear warm-up over this fraction of the steps"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "cosine floor as a fraction of lr"})
    batch_size: int = field(default=8, metadata={"help": "per-process micro-batch"})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    epochs: float = field(default=1.0, metadata={"help": "passes over the training split when --max-steps is none"})
    max_steps: int | None = field(default=600, metadata={"help": "optimizer steps; none = run --epochs"})
    max_grad_norm: float | None = field(default=1.0, metadata={"help": "gradient clipping norm (> 0); none = "
                                                                       "no clipping"})
    seed: int = field(default=0, metadata={"help": "seed of the inserted layers' init and the data order"})

    # systems
    mixed_precision: str | None = field(default=None, metadata={
        "help": f"{', '.join(PRECISIONS)} (auto = bf16 on CUDA, no on CPU); none = Accelerate's setting "
                "(accelerate config / accelerate launch --mixed_precision, i.e. ACCELERATE_MIXED_PRECISION), else "
                "auto"})
    fsdp: bool = field(default=False, metadata={"help": "shard host and inserted layers with FSDP2"})
    cpu: bool = field(default=False, metadata={"help": "run on the CPU even where CUDA is available"})
    num_workers: int = field(default=1, metadata={"help": "DataLoader worker processes that collate the next "
                                                          "batches while the GPU trains (0 = in the loop)"})
    ddp_bucket_mb: int = field(default=25, metadata={"help": "DDP gradient bucket size in MiB (all-reduces start "
                                                             "as buckets fill during the backward)"})
    profile_steps: int = field(default=0, metadata={
        "help": "time forward, backward (with its all-reduce wait), optimizer, data and logging over the last N "
                "steps (synchronising at every phase; left out of the throughput) -> step_profile.json"})
    quick_autotune: bool = field(default=False, metadata={
        "help": "CUDA: Triton autotuners (mamba-ssm, fla) keep the leanest config that runs instead of timing all "
                "(minutes saved on a first call; kernels may be slower)"})
    retune: bool = field(default=False, metadata={
        "help": "CUDA: time every Triton autotuner config again instead of taking the choices earlier runs stored "
                "(~/.cache/llm_surgery/autotune, or LLM_SURGERY_AUTOTUNE_CACHE), and store the new choices; "
                "LLM_SURGERY_RETUNE=1 does the same"})
    host_kernels: bool = field(default=True, metadata={
        "help": "CUDA: run the host's Mamba2 layers on mamba-ssm's Triton kernels when they import (else "
                "transformers' torch reference; llm_surgery/host_kernels.py)"})
    cuda_graphs: bool = field(default=True, metadata={
        "help": "CUDA: replay each micro-batch's forward and backward from CUDA graphs (one per padded batch "
                "shape, captured before the first step; llm_surgery/train/graphs.py); off by itself with --fsdp, "
                "--gradient-checkpointing, fp16 and hosts with routed experts"})

    # evaluation, logging, checkpoints
    output_dir: str = field(default="runs/latest", metadata={
        "help": "the run's folder: config, metrics, checkpoints, final/, results.json, accuracy.png"})
    eval_batch_size: int = field(default=32, metadata={"help": "examples per evaluation batch and process"})
    eval_mode: str = field(default="teacher_forced", metadata={
        "help": "teacher_forced (one forward per batch; exact match = what greedy decoding would give) or "
                "generate (greedy_complete + the Box scorer; not with --fsdp)"})
    eval_every: int = field(default=0, metadata={"help": "validation every K steps (0 = only at the end)"})
    eval_host: bool = field(default=True, metadata={"help": "also evaluate the host alone on the test split "
                                                            "at the end (a baseline row; the inserted layers' "
                                                            "outputs zeroed, as at insertion)"})
    log_every: int = field(default=10, metadata={"help": "a metrics.jsonl record every K steps"})
    save_every: int = field(default=0, metadata={"help": "checkpoint every K steps (0 = none)"})
    keep_last: int = field(default=2, metadata={"help": "checkpoints of this run kept (older ones deleted)"})
    resume: str | None = field(default=None, metadata={"help": "checkpoint dir or 'latest'; the run's settings "
                                                                "must equal the checkpoint's"})
    overwrite: bool = field(default=False, metadata={
        "help": "delete the outputs of an earlier run in --output-dir (checkpoints, final/, results, logs) before "
                "starting; without it a fresh run refuses a directory that holds them"})
    memory_check: bool = field(default=True, metadata={
        "help": "refuse a host whose weights need more than half the memory available to a process"})
    progress: bool = field(default=True, metadata={"help": "a progress bar on the main process"})
    tensorboard: bool = field(default=True, metadata={"help": "also log to <output-dir>/tensorboard (when "
                                                              "tensorboard is installed)"})
    plot: bool = field(default=True, metadata={"help": "write <output-dir>/accuracy.png (when matplotlib is "
                                                       "installed)"})

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise UsageError on impossible settings before any work starts."""
        def choice(name, allowed, none_ok=False):
            if getattr(self, name) not in allowed and not (none_ok and getattr(self, name) is None):
                raise UsageError(f"{name} must be one of {', '.join(allowed)}{' (or none)' if none_ok else ''}, "
                                 f"got {getattr(self, name)!r}")

        def number(name, low, high=math.inf, low_open=False, high_open=True, none_ok=False, hint=""):
            v = getattr(self, name)
            if v is None and none_ok:
                return
            ok = isinstance(v, (int, float)) and math.isfinite(v) and (v > low if low_open else v >= low) and (
                v < high if high_open else v <= high)
            if not ok:
                span = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
                raise UsageError(f"{name} must be a finite number in {span}{hint}, got {v!r}")
        kinds = self.kind.split("+")
        if not set(kinds) <= set(KINDS):
            raise UsageError(f"kind must be one of {KINDS} (or n of them joined by '+'), got {self.kind!r}")
        if len(kinds) > 1 and len(kinds) != self.n:
            raise UsageError(f"kind {self.kind!r} lists {len(kinds)} kinds for n={self.n} layers")
        choice("schedule", SCHEDULES)
        choice("mixed_precision", PRECISIONS, none_ok=True)
        choice("host_dtype", HOST_DTYPES)
        choice("tiny_host", ("granite", "nemotron"))
        choice("eval_mode", ("teacher_forced", "generate"))
        if self.fsdp and self.eval_mode == "generate":
            raise UsageError("eval_mode 'generate' runs the unwrapped model on each rank, which FSDP shards; "
                             "use eval_mode 'teacher_forced' with --fsdp")
        choice("over_length", ("drop", "truncate"))
        number("eval_ratio", 0, 1, low_open=True)
        if self.max_length is not None and self.max_length < 2:
            raise UsageError(f"max_length must be >= 2 (or none), got {self.max_length}")
        if self.fsdp and self.eval_generate:
            raise UsageError("--eval-generate runs the unwrapped model on each rank, which FSDP shards; leave it "
                             "out with --fsdp")
        if self.resume and self.overwrite:
            raise UsageError("--resume continues the run in --output-dir and --overwrite deletes it; pass one")
        for name in ("n", "batch_size", "grad_accum", "eval_batch_size", "log_every", "keep_last", "num_sequences",
                     "ddp_bucket_mb"):
            if getattr(self, name) < 1:
                raise UsageError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("lora_r", "eval_every", "save_every", "pretrain_steps", "num_workers", "profile_steps"):
            if getattr(self, name) < 0:
                raise UsageError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_steps", "max_eval_examples"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise UsageError(f"{name} must be >= 1 (or none), got {getattr(self, name)}")
        for name in ("lr", "pretrain_lr", "adam_eps", "epochs", "lora_alpha", "dictionary_lr_scale"):
            number(name, 0, low_open=True)
        number("tau", 0, low_open=True, none_ok=True)
        number("tau_end", 0, low_open=True, none_ok=True)
        number("max_grad_norm", 0, low_open=True, none_ok=True, hint=" (none = no clipping)")
        number("weight_decay", 0)
        for name in ("adam_beta1", "adam_beta2", "lora_dropout", "warmup_ratio"):
            number(name, 0, 1)
        number("min_lr_ratio", 0, 1, high_open=False)
        if self.positions is not None and len(self.positions) != self.n:
            raise UsageError(f"positions {self.positions} must list n={self.n} layer indices")
        for k in sorted(set(kinds)):   # with mixed kinds the options go to every kind
            unknown = sorted(set(self.mixer_kwargs()) - constructor_options(k))
            if unknown:
                raise UsageError(f"mixer_options {unknown} are not options of the {k} mixer; known: "
                                 f"{', '.join(sorted(constructor_options(k)))}")

    def inserted_kinds(self) -> str | list[str]:
        """`insert_layers`' kind argument: one kind, or the list of n kinds of a mixed insertion."""
        return self.kind if "+" not in self.kind else self.kind.split("+")

    def mixer_kwargs(self) -> dict:
        return json_object(self.mixer_options, "mixer_options", UsageError)

    def resume_settings(self, world_size: int, mixed_precision: str) -> dict:
        """What a checkpoint records and a resume must match: every field but MAY_CHANGE_ON_RESUME, the mixer
        options parsed, the number of processes (it fixes the data order) and the mixed precision in effect
        (from the flag or from Accelerate's config)."""
        out = {k: v for k, v in self.to_dict().items() if k not in MAY_CHANGE_ON_RESUME}
        out["mixer_options"] = self.mixer_kwargs()
        out["world_size"] = world_size
        out["mixed_precision"] = mixed_precision
        return json.loads(json.dumps(out))  # the form it takes in state.json

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def settings_diff(saved: dict, now: dict) -> list[str]:
    """`name: saved -> now` for every setting that differs (a missing one shows as None)."""
    return [f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(saved) | set(now))
            if saved.get(k) != now.get(k)]


def _unwrap_optional(tp):
    """`X | None` -> (X, True); anything else -> (tp, False)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _none_or(conv):
    def parse(text: str):
        return None if text.lower() == "none" else conv(text)
    parse.__name__ = getattr(conv, "__name__", "value")
    return parse


def build_parser(defaults: dict | None = None, prog: str | None = None) -> argparse.ArgumentParser:
    """An argparse parser with one `--flag-name` per TrainConfig field (defaults may be overridden by a recipe)."""
    defaults = dict(defaults or {})
    hints = typing.get_type_hints(TrainConfig)
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = set(defaults) - names
    if unknown:
        raise ValueError(f"unknown TrainConfig fields in defaults: {sorted(unknown)}")
    parser = Parser(prog=prog, hint=" (--help lists every option)",
                    description="Train inserted sequence mixers in a frozen host (llm-surgery). Every option has a "
                                "default; none is required. A flag that takes none accepts the word none.")
    for f in dataclasses.fields(TrainConfig):
        tp, optional = _unwrap_optional(hints[f.name])
        default = defaults.get(f.name, f.default)
        flag = "--" + f.name.replace("_", "-")
        kw = dict(dest=f.name, default=default, help=f.metadata["help"])
        if tp is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        elif typing.get_origin(tp) is list:
            (item,) = typing.get_args(tp)
            parser.add_argument(flag, nargs="+", type=item, metavar=item.__name__.upper(), **kw)
        else:
            conv = _none_or(tp) if optional else tp
            parser.add_argument(flag, type=conv, metavar=tp.__name__.upper(), **kw)
    return parser


def parse_config(argv: list[str] | None = None, defaults: dict | None = None, prog: str | None = None) -> TrainConfig:
    """Command line -> validated TrainConfig. A bad value exits with status 2 and a one-line message."""
    parser = build_parser(defaults, prog)
    ns = parser.parse_args(argv)
    try:
        return TrainConfig(**vars(ns))
    except UsageError as e:
        parser.error(str(e))

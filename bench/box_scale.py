"""Box at scale in one device lease: how Flash PD-SSM's gap to Mamba2 and DeltaNet moves with the host's size.

`run` pretrains a Granite-4.0-H hybrid host (GraniteMoeHybridForCausalLM from a config: Mamba2 and NoPE attention
layers 9 : 1 with attention at layers 5, 15, 25, 35 as in granite-4.0-h-micro; 128 M parameters at `--scale 128m`)
on the Box *language* (descriptions with operations, restatements; never a query or an answer) for a wall-clock
budget, then fine-tunes 4 inserted layers of each kind on the frozen host with the granite350m recipe: a
learning-rate sweep at seed 0, then seeds 1.. at each kind's best rate by *validation* exact match, trainer
processes side by side on the GPU(s); then seed 0 at each kind's rate again with its inserted mixers seeing every
token alone (`insert.ablation.tokens_alone`: what their memory adds), and the host alone. A JSON line per evaluation
goes to <out>/rows.jsonl as it finishes. `summarize` merges the rows of several host sizes into a table and a plot.

    setsid python bench/box_scale.py run --out /tmp/box_scale > /tmp/box_scale.out 2>&1 &   # the device, polled
    python bench/box_scale.py run --scale tiny --out /tmp/box_tiny             # the whole flow on the CPU, tiny
    python bench/box_scale.py run --scale shipped --out /tmp/box_shipped       # the shipped host (CPU main job)
    python bench/box_scale.py summarize ROWS.jsonl ... --out box_scale.png         # the table, and the plot

`--scale shipped` skips pretraining: it fine-tunes the shipped 162k host with the CPU main job's settings, the same
sweep, seeds and ablation, so the smallest size's rows come from the same flow.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from versions import versions  # noqa: E402
KINDS = ("pdssm", "mamba2", "deltanet")
BASELINES = ("mamba2", "deltanet")
RECIPE = "granite350m"  # the paper's recipe of the nearest Granite 4.0 size (llm_surgery.train.paper)

#: Each kind's learning-rate grid around the best rates of the earlier sizes (docs/bench/box.md), the likeliest first.
LR_GRID = {"pdssm": (3e-4, 1e-3, 1e-4), "mamba2": (1e-3, 3e-4, 3e-3), "deltanet": (1e-3, 3e-4, 3e-3)}

SCALES = {
    # 127.6 M parameters: width 512, 40 layers "MMMMM*MMMM" x 4; Mamba2 as granite-4.0-h-micro's (heads x 64 =
    # 2 x width, state 128, one group), shared MLP 2 x width. On one H200 (2026-11-29): 0.42 s a pretraining step of
    # 256 documents, every held-out restatement right after 870 steps (6 minutes); fine-tuning runs of 600 x 64 took
    # ~90 s of the GPU each (6 side by side: 610-650 s; 9 side by side ran out of memory, ~15 GiB each), so the
    # runs here take the same 38,400 examples in 150 steps of 256, two side by side, without CUDA graphs (a step of
    # ~28k tokens keeps the GPU busy without them, and their pools would take ~4 x 15 GiB a run). A run of 256 takes
    # 52-54 GiB at its peak (pdssm 52.2, mamba2 53.5, deltanet 53.4; H200, 4-step runs alone): two fit, three do not.
    # The whole run ends within one lease of 30 device minutes: ~1.5 to start the machine, 23.5 here, and the last
    # pair of runs past the deadline (~3).
    "128m": dict(hidden=512, pattern="MMMMM*MMMM" * 4, heads=8, kv_heads=2, mamba_head=64, mamba_state=128,
                 mlp=1024, host_sequences=100_000, host_batch=256, host_lr=5e-4, host_minutes=6.5, minutes=23.5,
                 finetune_minutes=15.0, parallel=2, recipe=RECIPE, steps=150, batch=256, cuda_graphs=False,
                 sequences=1000, max_eval_examples=4000, eval_batch=256, test_max_ops=26, seeds=3),
    # The shipped host and the CPU main job's settings (llm_surgery.train's defaults), two runs side by side.
    "shipped": dict(host="shipped", minutes=0.0, finetune_minutes=0.0, parallel=2, recipe=None, steps=600, batch=8,
                    sequences=200, max_eval_examples=1134, eval_batch=32, test_max_ops=26, seeds=3),
    # The CPU check of the flow (a few minutes): nothing is expected to be learned.
    "tiny": dict(hidden=32, pattern="MMMMM*MMMM" * 4, heads=2, kv_heads=1, mamba_head=16, mamba_state=16, mlp=64,
                 host_sequences=40, host_batch=8, host_lr=3e-3, host_minutes=0.0, minutes=0.0, finetune_minutes=0.0,
                 parallel=2, recipe=RECIPE, steps=3, batch=4, sequences=40, max_eval_examples=70, eval_batch=64,
                 test_max_ops=8, seeds=2, host_steps=6),
}


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S ") + msg, flush=True)


# ---------------------------------------------------------------- the host

def build_host(spec: dict, seed: int = 0):
    """The Granite-4.0-H host of `spec` (random weights) and the Box word tokenizer."""
    from llm_surgery.box_data import build_box_tokenizer
    from llm_surgery.hosts import build_tiny_host

    tok = build_box_tokenizer()
    head_dim = spec["hidden"] // spec["heads"]
    model = build_tiny_host(
        "granite", seed=seed, hidden_size=spec["hidden"], vocab_size=len(tok), pattern=spec["pattern"],
        num_attention_heads=spec["heads"], num_key_value_heads=spec["kv_heads"], attention_multiplier=head_dim ** -0.5,
        mamba_n_heads=2 * spec["hidden"] // spec["mamba_head"], mamba_d_head=spec["mamba_head"],
        mamba_d_state=spec["mamba_state"], mamba_chunk_size=64, shared_intermediate_size=spec["mlp"],
        intermediate_size=spec["mlp"], position_embedding_type="nope", embedding_multiplier=1.0,
        residual_multiplier=1.0, logits_scaling=1.0)
    return model, tok


def documents(sequences: int, workers: int) -> tuple[list[str], list[str]]:
    """The shipped host's kind of documents (`make_host.language_documents`) from `sequences` Box sequences, drawn
    in chunks by a process pool (chunk k from document stream 1 + k); the held-out restatements of chunk 0."""
    from concurrent.futures import ProcessPoolExecutor

    from llm_surgery.train.make_host import language_documents

    chunks = max(1, min(workers, sequences // 1000))
    sizes = [sequences // chunks + (k < sequences % chunks) for k in range(chunks)]
    with ProcessPoolExecutor(chunks) as pool:
        parts = list(pool.map(language_documents, sizes, [1 + k for k in range(chunks)], range(chunks)))
    return [d for docs, _ in parts for d in docs], parts[0][1]


def seconds_per_step(model, batches, device, amp, steps: int = 8) -> float:
    """A pretraining step's time (forward and backward, no update: the weights stay as they are), after four steps
    that compile and tune the kernels (timed after two, the H200 gave 0.60 s; the run that followed took 0.42 s)."""
    model.to(device).train()
    for k in range(4 + steps):
        if k == 4:
            torch.cuda.synchronize() if device.type == "cuda" else None
            t0 = time.time()
        batch = {key: v.to(device) for key, v in next(batches).items()}
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            model(**batch, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)
    torch.cuda.synchronize() if device.type == "cuda" else None
    return (time.time() - t0) / steps


def pretrain_host(args, spec: dict, work: Path, deadline: float) -> dict:
    """Pretrain the host on Box-language documents for what the budget leaves; save it to <work>/host."""
    from llm_surgery.train.make_host import encode_docs, pretrain_docs, restatement_accuracy, shuffled_batches
    from llm_surgery.triton_autotune import persistent_autotune

    t0 = time.time()
    device = torch.device(args.device)
    amp = torch.bfloat16 if device.type == "cuda" else None
    if device.type == "cuda":
        from llm_surgery.host_kernels import use_mamba_kernels_for_hosts

        persistent_autotune()
        log(use_mamba_kernels_for_hosts())
    docs, held_out = documents(spec["host_sequences"], os.cpu_count() or 1)
    model, tok = build_host(spec)
    params = sum(p.numel() for p in model.parameters())
    log(f"host: {params:,} params, width {spec['hidden']}, {spec['pattern']}, {len(docs):,} documents "
        f"({time.time() - t0:.0f} s)")
    model.save_pretrained(work / "host_init")
    tok.save_pretrained(work / "host_init")
    smoke(args, spec, work)
    if "host_steps" in spec:
        steps, step_s, budget = spec["host_steps"], None, None
    else:
        buckets = shuffled_batches(encode_docs(tok, docs[:20 * spec["host_batch"]]), spec["host_batch"], 99, 8)
        step_s = seconds_per_step(model, buckets, device, amp)
        budget = min(60 * spec["host_minutes"], deadline - time.time() - 60 * spec["finetune_minutes"])
        steps = int(budget / (step_s * 1.03))  # a little for the updates and the evaluations
        log(f"pretraining: {step_s:.3f} s a step -> {steps} steps in {budget:.0f} s")
    t1 = time.time()
    curve = pretrain_docs(model, tok, docs, held_out[:200], batch_size=spec["host_batch"], lr=spec["host_lr"],
                          max_seconds=1.2 * budget if step_s else float("inf"), steps=steps, seed=0, log=log,
                          eval_every=max(1, steps // 8), buckets=8, device=device, autocast_dtype=amp)
    seconds, steps = time.time() - t1, curve[-1]["step"]  # fewer than planned where the time limit cut it
    with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
        restated = restatement_accuracy(model, tok, held_out)
    doc_tokens = statistics.fmean(len(d) for d in encode_docs(tok, docs[:5000]))
    host = {"params": params, "spec": spec, "steps": steps, "step_seconds": step_s, "seconds": round(seconds),
            "documents": len(docs), "tokens_seen": round(steps * spec["host_batch"] * doc_tokens),
            "restatement_accuracy": round(100 * restated, 1),
            "curve": curve, "device": device_name(device), "versions": versions()}
    model.to("cpu").save_pretrained(work / "host")
    tok.save_pretrained(work / "host")
    (work / "host" / "host.json").write_text(json.dumps(host, indent=1))
    log(f"host pretrained: {steps} steps in {seconds:.0f} s, restated objects right {host['restatement_accuracy']}%")
    del model
    torch.cuda.empty_cache() if device.type == "cuda" else None
    return host


def device_name(device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


# ---------------------------------------------------------------- the fine-tuning runs

def trainer_settings(args, spec: dict, host_dir: str | None, kind: str, lr: float, seed: int, out: Path) -> dict:
    """A fine-tuning run's TrainConfig fields: the recipe (none: the trainer's defaults, the CPU main job's), the
    scale's steps, batch and evaluation sets."""
    from llm_surgery.train.paper import recipe_defaults

    recipe = {k: v for k, v in (recipe_defaults(spec["recipe"]) if spec["recipe"] else {}).items()
              if k in ("n", "weight_decay", "warmup_ratio", "schedule", "min_lr_ratio", "tau", "tau_end")}
    return {**recipe, "model": host_dir, "kind": kind, "lr": lr, "seed": seed, "max_steps": spec["steps"],
            "batch_size": spec["batch"], "num_sequences": spec["sequences"], "test_max_ops": spec["test_max_ops"],
            "max_eval_examples": spec["max_eval_examples"], "eval_batch_size": spec["eval_batch"],
            "cuda_graphs": spec.get("cuda_graphs", True), "eval_host": False, "cpu": args.device == "cpu",
            "host_dtype": "float32", "quick_autotune": True, "progress": False, "tensorboard": False, "plot": False,
            "overwrite": True,
            "log_every": max(1, spec["steps"] // 10), "output_dir": str(out)}


class Job:
    """One child process: `finetune-one` (a trainer run) or `ablate` (a finished run evaluated again: tokens alone,
    and with `host_alone` the host without the layers)."""

    def __init__(self, what: str, kind: str, lr: float, seed: int, run_dir: Path, stage: str, settings=None,
                 host_alone: bool = False, retry: bool = False):
        self.what, self.kind, self.lr, self.seed, self.dir, self.stage = what, kind, lr, seed, run_dir, stage
        self.settings, self.host_alone, self.retry, self.proc, self.t0 = settings, host_alone, retry, None, None
        self.gpu: int | None = None

    @property
    def name(self) -> str:
        return f"{self.what} {self.kind} lr {self.lr:g} seed {self.seed}"

    def start(self, args, gpu: int | None) -> None:
        self.gpu = gpu
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.settings is not None:
            (self.dir / "settings.json").write_text(json.dumps(self.settings))
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=path)
        # two runs share a GPU: segments one allocator caches but cannot reuse leave the other short (a run of the
        # 128m lease ran out of memory at 67 GiB beside one at 71 GiB of 140)
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        cmd = [sys.executable, __file__, self.what, str(self.dir), "--device", args.device,
               *(["--host-alone"] if self.host_alone else [])]
        self.t0 = time.time()
        with open(self.dir / f"{self.what}.log", "w") as out:  # the child holds its own copy
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)


def smoke(args, spec: dict, work: Path) -> None:
    """Before the pretraining: a few steps of every kind on the random-weight host, at the fine-tuning's batch and
    at most `parallel` a GPU side by side as the fine-tuning runs them, so that a run that cannot start (or does not
    fit beside another) fails in a minute, not after the pretraining; the kernels are compiled once, here."""
    small = {**spec, "steps": 4, "max_eval_examples": 70}
    jobs = [Job("finetune-one", k, LR_GRID[k][0], 0, work / f"smoke-{k}", "smoke",
                trainer_settings(args, small, str(work / "host_init"), k, LR_GRID[k][0], 0, work / f"smoke-{k}"))
            for k in args.kinds]
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    width = spec["parallel"] * max(1, gpus)
    for first in range(0, len(jobs), width):
        for k, job in enumerate(jobs[first:first + width]):
            job.start(args, k % gpus if gpus else None)
        for job in jobs[first:first + width]:
            job.proc.wait()
    failed = [job for job in jobs if job.proc.returncode != 0]
    for job in failed:
        log(f"FAILED smoke run {job.name}:\n{(job.dir / 'finetune-one.log').read_text()[-3000:]}")
    if failed:
        raise SystemExit(1)
    log(f"smoke runs of {', '.join(args.kinds)} passed ({time.time() - jobs[0].t0:.0f} s)")


def finetune_one(run_dir: Path) -> None:
    """A child: one trainer run with <run_dir>/settings.json (its outputs in run_dir)."""
    from llm_surgery.train import TrainConfig, train

    train(TrainConfig(**json.loads((run_dir / "settings.json").read_text())))


def ablate(run_dir: Path, with_host_alone: bool) -> None:
    """A child: the finished run's test split again with every inserted mixer seeing each token alone (and, asked,
    with the layers adding nothing: the host alone) -> <run_dir>/ablation.json."""
    from llm_surgery.insert.ablation import host_alone, tokens_alone
    from llm_surgery.train.evaluate import evaluate_run
    from llm_surgery.train.outputs import write_json

    out = {"tokens alone": evaluate_run(run_dir, within=tokens_alone)}
    if with_host_alone:
        out["host alone"] = evaluate_run(run_dir, within=host_alone)
    write_json(run_dir / "ablation.json", out)


def pct(x):
    return None if x is None else round(100 * x, 2)


def row(test: dict, **fields) -> dict:
    """A rows.jsonl record: exact match and whole-state accuracy (%), and the exact-match curve over 0..N ops."""
    n = max(int(k) for k in test["by_num_ops"])
    return {**fields, "iid": pct(test["iid"]["accuracy"]), "ood": pct(test["ood"]["accuracy"]),
            "whole_state": {"iid": pct(test["iid"]["state_accuracy"]), "ood": pct(test["ood"]["state_accuracy"])},
            "curve": [pct(test["by_num_ops"][str(k)]["accuracy"]) for k in range(n + 1)]}


def finetune_all(args, spec: dict, host_dir: str | None, host: dict, work: Path, out: Path, deadline: float) -> None:
    """The sweep, the seeds at each kind's best rate and the evaluations, `parallel` children at a time; a row per
    finished evaluation. Runs on one GPU share it by time slices (side by side they should not beat one after
    another), so the children that run side by side are there to hide each other's start-up. The seeds come
    first: a sweep point is dropped when the runs still owed (at the pace of those finished) would pass the
    deadline."""
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    base = {"host_params": host["params"], "host": args.scale, "recipe": spec["recipe"], "steps": spec["steps"],
            "batch": spec["batch"], "device": host["device"], "versions": host["versions"],
            "date": time.strftime("%Y-%m-%d", time.gmtime())}

    def write(r: dict) -> None:
        with open(out / "rows.jsonl", "a") as f:
            f.write(json.dumps({**base, **r}) + "\n")

    def finetune(kind, lr, seed, stage):
        d = work / f"{kind}-lr{lr:g}-s{seed}"
        return Job("finetune-one", kind, lr, seed, d, stage, trainer_settings(args, spec, host_dir, kind, lr, seed, d))

    sweep: dict[str, dict[float, float | None]] = {k: {} for k in args.kinds}  # lr -> validation (None: failed)

    def chosen(kind, lr, validation) -> list[Job]:
        """A sweep point is in (`validation` None: failed or dropped). Once every point of the kind's is: the
        seeds at its best rate by validation exact match (ties: the earlier point) and the ablations of the
        sweep's run at that rate (seed 0 alone: each is ~20 s of GPU, which the seeds need more)."""
        sweep[kind][lr] = validation
        if len(sweep[kind]) < len(LR_GRID[kind]) or all(v is None for v in sweep[kind].values()):
            return []
        best = max((r for r in LR_GRID[kind] if sweep[kind][r] is not None), key=lambda r: sweep[kind][r])
        write({"kind": kind, "eval": "best lr", "lr": best, "sweep": {f"{k:g}": v for k, v in sweep[kind].items()}})
        log(f"{kind}: best lr {best:g} by validation exact match {sweep[kind]}")
        first = not any(j.what == "ablate" for j in [*pending, *running, *finished])
        return [*(finetune(kind, best, s, "seeds") for s in range(1, spec["seeds"])),
                Job("ablate", kind, best, 0, work / f"{kind}-lr{best:g}-s0", "seeds", host_alone=first)]

    # each kind's first grid point (the rate the earlier sizes favour), then the other points kind by kind
    pending = [finetune(k, lr, 0, "sweep") for i in range(max(map(len, LR_GRID.values())))
               for k in args.kinds if i < len(LR_GRID[k]) for lr in [LR_GRID[k][i]]]
    running: list[Job] = []
    finished: list[Job] = []
    order = {"ablate": 0, "seeds": 1, "sweep": 2}
    t_start = time.time()
    while pending or running:
        for job in [j for j in running if j.proc.poll() is not None]:
            running.remove(job)
            finished.append(job)
            pending += collect(job, write, chosen)
        while pending and len(running) < spec["parallel"] * max(1, gpus):
            pending.sort(key=lambda j: order[j.what if j.what == "ablate" else j.stage])
            job = pending.pop(0)
            owed = owed_runs(args.kinds, spec["seeds"], running, finished) + 1
            if drops(job, owed, running, finished, time.time() - t_start, deadline - time.time()):
                log(f"dropped {job.name}: {owed} runs still owed at the pace so far would pass the deadline "
                    f"({deadline - time.time():.0f} s away)")
                pending += chosen(job.kind, job.lr, None)
                continue
            if time.time() > deadline:
                log(f"not started (past the deadline): {job.name}")
                continue
            job.start(args, least_busy_gpu(gpus, running))
            running.append(job)
            log(f"started {job.name}")
        time.sleep(0.5)


def least_busy_gpu(gpus: int, running: list[Job]) -> int | None:
    """The GPU with the fewest running children (the lowest index on a tie; None on the CPU): a count of started
    jobs modulo the GPUs would put a third run of ~54 GiB on a GPU whose partner ended first."""
    if not gpus:
        return None
    load = [sum(j.gpu == g for j in running) for g in range(gpus)]
    return load.index(min(load))


def started(kind: str, stage: str, running: list[Job], finished: list[Job]) -> int:
    """The kind's trainer runs of `stage` running or ended well."""
    return sum(j.what == "finetune-one" and j.kind == kind and j.stage == stage and j.proc.returncode in (None, 0)
               for j in [*running, *finished])


def swept(kind: str, running: list[Job], finished: list[Job]) -> bool:
    """Whether a sweep point of the kind runs or ran: its seed 0. Until then no point of its may be dropped."""
    return started(kind, "sweep", running, finished) > 0


def owed_runs(kinds, seeds: int, running: list[Job], finished: list[Job]) -> int:
    """Trainer runs still to end: the running ones, and each kind's seed runs not yet started or failed, its seed 0
    (a first sweep point) included (an ablation is no seed run; a failed seed starts again)."""
    return (sum(max(0, seeds - swept(k, running, finished) - started(k, "seeds", running, finished)) for k in kinds)
            + sum(j.what == "finetune-one" for j in running))


def drops(job: Job, owed: int, running: list[Job], finished: list[Job], elapsed: float, left: float) -> bool:
    """Whether the pace rule drops `job`: a sweep point, not its kind's first (that is its seed 0), when `owed` runs
    would not end within `left` seconds at the pace so far."""
    runs_done = sum(j.what == "finetune-one" for j in finished)
    return job.stage == "sweep" and swept(job.kind, running, finished) and not fits(owed, elapsed, runs_done, left)


def fits(owed: int, elapsed: float, runs_done: int, left: float) -> bool:
    """Whether `owed` more runs end within `left` seconds at the pace of the `runs_done` that took `elapsed` (the
    pace of the whole, whatever ran side by side). Before any run ends: yes."""
    return runs_done == 0 or owed * elapsed / runs_done <= left


def collect(job: Job, write, chosen) -> list[Job]:
    """A finished child's rows; returns the jobs it makes due (a sweep's seeds, a run's evaluations)."""
    seconds = time.time() - job.t0
    meta = {"kind": job.kind, "seed": job.seed, "lr": job.lr, "stage": job.stage, "seconds": round(seconds)}
    if job.proc.returncode != 0:
        log(f"FAILED {job.name} (exit {job.proc.returncode}) after {seconds:.0f} s:\n"
            + (job.dir / f"{job.what}.log").read_text()[-2000:])
        if job.what == "finetune-one" and job.stage == "sweep":
            return chosen(job.kind, job.lr, None)
        if job.stage == "seeds" and not job.retry:  # a seed is what the study needs: once more (another partner)
            return [Job(job.what, job.kind, job.lr, job.seed, job.dir, job.stage, job.settings, job.host_alone, True)]
        return []
    if job.what == "ablate":
        for name, test in json.loads((job.dir / "ablation.json").read_text()).items():
            write(row(test, eval=name, **(meta if name == "tokens alone" else {**meta, "kind": "host"})))
        log(f"done {job.name} ({seconds:.0f} s)")
        return []
    res = json.loads((job.dir / "results.json").read_text())
    validation = pct(res["validation"]["accuracy"])
    write(row(res["test"], eval="as trained", validation=validation, params=res["params"]["trainable"], **meta))
    log(f"done {job.name} ({seconds:.0f} s): validation {validation}, test IID {pct(res['test']['iid']['accuracy'])}"
        f" / OOD {pct(res['test']['ood']['accuracy'])}")
    return chosen(job.kind, job.lr, validation) if job.stage == "sweep" else []


def stage_run(args) -> None:
    spec = {**SCALES[args.scale], **({"minutes": args.minutes} if args.minutes is not None else {})}
    t0 = time.time()
    deadline = t0 + 60 * spec["minutes"] if spec["minutes"] else float("inf")  # 0: none
    out, work = Path(args.out), Path(args.out) / "runs"
    work.mkdir(parents=True, exist_ok=True)
    (out / "rows.jsonl").write_text("")
    log(f"box_scale run --scale {args.scale} on {args.device}, torch {torch.__version__}; {spec}")
    if spec.get("host") == "shipped":
        from llm_surgery.train.host import SHIPPED_HOST

        host_dir = None   # the trainer's embedded default: the shipped host
        host_info = json.loads((Path(SHIPPED_HOST) / "host.json").read_text())
        host = {"params": host_info["parameters"], "device": device_name(torch.device(args.device)),
                "versions": versions()}
    elif args.host:
        host_dir = args.host   # a host pretrained by an earlier `run` (its fine-tuning went wrong): not again
        host = json.loads((Path(args.host) / "host.json").read_text())
    else:
        host = pretrain_host(args, spec, work, deadline)
        host_dir = str(work / "host")
    (out / "host.json").write_text(json.dumps({**host, "scale": args.scale}, indent=1))
    finetune_all(args, spec, host_dir, host, work, out, deadline)
    summary = table([json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()])
    (out / "summary.md").write_text(summary + "\n")
    log(f"box_scale done in {time.time() - t0:.0f} s; rows: {out / 'rows.jsonl'}\n{summary}")


# ---------------------------------------------------------------- summary over host sizes

def groups(rows: list[dict]) -> dict[tuple[int, str], dict]:
    """Per (host params, kind): the runs at the kind's chosen rate (the seeds), their tokens-alone evaluations,
    and the host alone. A row without a seed of its own stands for several (`seeds`, `std`: older tables)."""
    best = {(r["host_params"], r["kind"]): r["lr"] for r in rows if r["eval"] == "best lr"}
    out: dict[tuple[int, str], dict] = {}
    for r in rows:
        key = (r["host_params"], r["kind"])
        if r["eval"] == "best lr" or (key in best and r["lr"] != best[key] and r["eval"] != "host alone"):
            continue
        out.setdefault(key, {"as trained": [], "tokens alone": [], "host alone": []})[r["eval"]].append(r)
    return out


def mean_std(runs: list[dict], field: str) -> tuple[float, float, int] | None:
    """Mean, standard deviation and number of seeds of `field` (%; "a.b" reads a nested one) over `runs`."""
    def get(r, f=field):
        for part in f.split("."):
            r = r[part]
        return r
    if not runs:
        return None
    if len(runs) == 1 and runs[0].get("seeds"):  # an older table's row: its own mean and spread
        return get(runs[0]), runs[0]["std"].get(field, 0.0), runs[0]["seeds"]
    xs = [get(r) for r in runs]
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0, len(xs)


def ood_gap(g: dict, params) -> tuple[float, float, int] | None:
    """pdssm's OOD exact match minus the better baseline's at host size `params`, the larger of the two spreads and
    the fewer seeds; None where a kind has no runs there."""
    if not all((params, k) in g for k in KINDS):
        return None
    ours = mean_std(g[(params, "pdssm")]["as trained"], "ood")
    better = max((mean_std(g[(params, k)]["as trained"], "ood") for k in BASELINES), key=lambda v: v[0])
    return ours[0] - better[0], max(ours[1], better[1]), min(ours[2], better[2])


def table(rows: list[dict]) -> str:
    """Markdown: per host size and kind, IID / OOD exact match (mean ± std over seeds), the rate, tokens alone;
    then pdssm's OOD gap to the better baseline."""
    g = groups(rows)
    fmt = lambda v: "-" if v is None else f"{v[0]:.1f} ± {v[1]:.1f}"  # noqa: E731
    lines = ["| host params | inserted | lr | seeds | IID exact | OOD exact | IID whole state | IID / OOD tokens "
             "alone |", "|---|---|---|---|---|---|---|---|"]
    gaps = []
    for params in sorted({p for p, _ in g}):
        for kind in ("host", *KINDS):
            if (params, kind) not in g:
                continue
            runs = g[(params, kind)]["host alone" if kind == "host" else "as trained"]
            alone = g[(params, kind)]["tokens alone"]
            iid = mean_std(runs, "iid")
            alone_cell = f"{fmt(mean_std(alone, 'iid'))} / {fmt(mean_std(alone, 'ood'))}" if alone else "-"
            lines.append(f"| {params / 1e6:.3g} M | {'host alone' if kind == 'host' else kind} | "
                         f"{'-' if kind == 'host' else format(runs[0]['lr'], 'g')} | {iid[2]} | {fmt(iid)} | "
                         f"{fmt(mean_std(runs, 'ood'))} | {fmt(mean_std(runs, 'whole_state.iid'))} | {alone_cell} |")
        if gap := ood_gap(g, params):
            diff, spread, seeds = gap
            gaps.append(f"| {params / 1e6:.3g} M | {diff:+.1f} | {f'{spread:.1f}' if seeds > 1 else '- (1 seed)'} |")
    if gaps:
        lines += ["", "| host params | pdssm OOD - the better baseline's | larger spread (std) |", "|---|---|---|",
                  *gaps]
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> Path:
    """OOD exact match against host parameters per kind (mean, bars: std over seeds), and pdssm's gap to the
    better baseline (bars: the larger of the two spreads)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = groups(rows)
    sizes = sorted({p for p, _ in g})
    fig, (ax, gap_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for kind in KINDS:
        pts = [(p, mean_std(g[(p, kind)]["as trained"], "ood")) for p in sizes if (p, kind) in g]
        ax.errorbar([p for p, _ in pts], [v[0] for _, v in pts], yerr=[v[1] for _, v in pts], marker="o",
                    capsize=3, label=f"+ 4 {kind}")
    ax.set(xscale="log", xlabel="host parameters", ylabel="Box OOD exact match (%)", title="Box OOD (7-26 ops)")
    ax.legend()
    gap = [(p, v[0], v[1]) for p in sizes if (v := ood_gap(g, p))]
    gap_ax.errorbar([p for p, _, _ in gap], [v for _, v, _ in gap], yerr=[e for _, _, e in gap], marker="o",
                    capsize=3, color="black")
    gap_ax.axhline(0, color="grey", lw=0.8)
    gap_ax.set(xscale="log", xlabel="host parameters", ylabel="points", title="pdssm OOD - better baseline's")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


#: The rows of the 27 M host's table (`box_scale.py summarize` of the staged calls, code eb3d3ad) that are the runs
#: at the granite350m recipe's rate (1e-3) with today's defaults (identity dictionaries), and their kinds.
SUMMARY_LABELS = {"host alone": "host", "+ 4 mamba2": "mamba2", "+ 4 deltanet": "deltanet",
                  '+ 4 pdssm {"mixer_options": "{\\"dict_init\\": \\"identity\\"}"}': "pdssm"}


def rows_from_summary(text: str, host_params: int, lr: float) -> list[dict]:
    """Rows from an older summary.md (mean ± std over `seeds` per run, then the mean curve per run): one row per
    kind standing for its seeds (`seeds`, `std`)."""
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
             if line.startswith("| ") and not line.startswith("| run")]
    means = {c[0]: c for c in cells if "±" in c[2]}
    curves = {c[0].rsplit(" (mean of", 1)[0]: c[1:] for c in cells if "±" not in c[2]}
    split = lambda v: [float(x) for x in v.split("±")]  # noqa: E731
    rows = []
    for label, kind in SUMMARY_LABELS.items():
        c = means[label]
        (iid, iid_sd), (ood, ood_sd), (whole, whole_sd), (whole_ood, _) = map(split, c[2:6])
        rows.append({"host_params": host_params, "kind": kind, "eval": "host alone" if kind == "host" else
                     "as trained", "lr": None if kind == "host" else lr, "seed": None, "seeds": int(c[1]),
                     "iid": iid, "ood": ood, "whole_state": {"iid": whole, "ood": whole_ood},
                     "std": {"iid": iid_sd, "ood": ood_sd, "whole_state.iid": whole_sd},
                     "curve": [float(v) for v in curves[label]]})
    return rows


def stage_summarize(args) -> None:
    """Print the table of the rows files and draw the plot to --out (a .png path)."""
    rows = [json.loads(line) for f in args.rows for line in Path(f).read_text().splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"box_scale: error: no rows in {', '.join(args.rows)}")
    runs: dict[int, set] = {}
    for r in rows:  # a host size's rows are one run's: two hosts or fine-tuning shapes would pool as seeds
        runs.setdefault(r["host_params"], set()).add((r.get("host"), r.get("steps"), r.get("batch")))
    mixed = {p: sorted(map(str, v)) for p, v in runs.items() if len(v) > 1}
    if mixed:
        raise SystemExit("box_scale: error: rows of one host size come from different runs (host, steps, batch): "
                         + "; ".join(f"{p:,}: {', '.join(v)}" for p, v in mixed.items()) + "; summarize one run each")
    print(table(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"plot: {plot(rows, out)}")


# ---------------------------------------------------------------- command line

def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stage", choices=("run", "summarize", "import-summary", "finetune-one", "ablate"))
    ap.add_argument("paths", nargs="*", help="summarize: rows files; import-summary: an older summary.md; "
                                             "finetune-one / ablate: the run's folder")
    ap.add_argument("--scale", choices=sorted(SCALES), default="128m")
    ap.add_argument("--kinds", default=",".join(KINDS), help="run: the kinds, separated by commas")
    ap.add_argument("--out", help="run: its folder (default $OUT, else runs/box_scale); summarize: the plot (.png); "
                                  "import-summary: the rows file")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--minutes", type=float, help="run: the whole run's wall-clock budget (default: the scale's)")
    ap.add_argument("--host", help="run: fine-tune this host of an earlier run (the host folder of its <out>) instead")
    ap.add_argument("--host-alone", action="store_true", help="ablate: also evaluate the host alone")
    ap.add_argument("--host-params", type=int, help="import-summary: the host's parameters")
    ap.add_argument("--lr", type=float, default=1e-3, help="import-summary: the runs' learning rate")
    args = ap.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.kinds = [k for k in args.kinds.split(",") if k]
    if set(args.kinds) - set(KINDS):
        ap.error(f"--kinds: choose from {', '.join(KINDS)}, got {', '.join(args.kinds)}")
    if args.stage != "run" and not args.paths:
        ap.error(f"{args.stage} needs {'rows files' if args.stage == 'summarize' else 'a path'}")
    if args.stage == "import-summary" and not args.host_params:
        ap.error("import-summary needs --host-params")
    if args.stage in ("summarize", "import-summary") and not args.out:
        ap.error(f"{args.stage} needs --out (summarize: the plot's .png; import-summary: the rows file)")
    args.out = args.out or os.environ.get("OUT") or "runs/box_scale"
    if args.stage == "run":
        torch.set_num_threads(1 if args.device == "cpu" else torch.get_num_threads())
        stage_run(args)
    elif args.stage == "summarize":
        args.rows = args.paths
        stage_summarize(args)
    elif args.stage == "import-summary":
        rows = [{**r, "source": args.paths[0]} for r in
                rows_from_summary(Path(args.paths[0]).read_text(), args.host_params, args.lr)]
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{len(rows)} rows -> {args.out}")
    elif args.stage == "finetune-one":
        finetune_one(Path(args.paths[0]))
    else:
        ablate(Path(args.paths[0]), args.host_alone)


if __name__ == "__main__":
    main()

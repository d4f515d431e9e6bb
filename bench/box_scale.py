"""Box reproduction at the largest host that can cross device calls, staged over several calls: pretrain a
Granite-4.0-architecture host (resumable: its checkpoint comes back through $OUT and goes in again with `carry`),
then fine-tune 4 inserted layers of each kind on the frozen host with the paper's recipe, 3 seeds per kind, one
call per kind (or the kinds side by side in one); then merge the results into one table and plot (no GPU).

    python bench/box_scale.py pretrain --out $OUT                                  # call 1
    python bench/box_scale.py pretrain --resume box_scale/host --out $OUT          # call 2.. (until done)
    python bench/box_scale.py finetune --host box_scale/host --kinds pdssm --seeds 0,1,2 --out $OUT
    python bench/box_scale.py summarize box_scale/results --out box_scale/summary

`--scale 27m-language` pretrains the same host on the Box language alone (no queries: only the inserted layers
learn to answer); `finetune --set '{"lr": 0.003}'` runs a variant of the recipe.

Why 27 M parameters (`SCALES["27m"]`): what crosses calls must fit the device's transfer limits (64 MiB through
$OUT and 64 MiB of working tree with `carry`, the repo included), so the checkpoint is the weights alone in
bfloat16 (2 bytes a parameter, in shards of at most 15 MiB; `TRANSPORT_MIB`); Adam's moments (8 bytes a parameter
more) do not fit, so a resumed call restarts the optimizer and ramps the learning rate back over `rewarm` steps.
docs/bench/train.md ("Box reproduction at scale") has the stages, the calls and their measured times.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from box_repro import KINDS, PLAIN, Log, summary  # noqa: E402  (the small reproduction's helpers)

TRANSPORT_MIB = 56  # the host's bf16 shards: 64 MiB of working tree less the repo (~5 MiB) and some margin
SHARD_MIB = 15  # files from $OUT: at most 16 MiB each, 8 in all
RECIPE = "granite350m"  # the paper's recipe of the nearest Granite 4.0 size (llm_surgery.train.paper)

#: What determines the host (a resume must match it): its shape and its pretraining.
HOST_KEYS = ("hidden", "pattern", "heads", "kv_heads", "mamba_state", "host_data", "host_steps", "host_batch",
             "host_lr", "host_sequences", "warmup_ratio", "data_seed", "seed")
SCALES = {
    # 27.0 M parameters (51.4 MiB in bf16): 16 layers, 3 Mamba2 : 1 attention (the Granite 4.0 H hosts are
    # Mamba2 hybrids), RoPE and plain multipliers as in the small reproduction whose host learned the lookup.
    # 4,000 steps x 256 IID examples (~1 M examples, ~90 M tokens; loss on the completion) in about 2 calls.
    "27m": dict(hidden=384, pattern="MMM*" * 4, heads=6, kv_heads=2, mamba_state=16, host_data="task",
                host_steps=4000, host_batch=256, host_lr=6e-4, host_sequences=10000, warmup_ratio=0.1,
                host_seconds=420, rewarm=100, steps=600, batch=64, sequences=1000, max_eval_examples=4000,
                eval_batch=256, test_max_ops=26, data_seed=2255, seed=0),
    # The same host pretrained on the Box *language* alone (the shipped host's documents, `make_host`: descriptions
    # with operations, and restatements of boxes; never a query or an answer), the paper's split of roles: only
    # the inserted layers learn to answer. 2,400 steps x 256 documents of 60,000 fit one call (~0.17 s a step).
    "27m-language": dict(hidden=384, pattern="MMM*" * 4, heads=6, kv_heads=2, mamba_state=16, host_data="language",
                         host_steps=2400, host_batch=256, host_lr=6e-4, host_sequences=20000, warmup_ratio=0.1,
                         host_seconds=450, rewarm=100, steps=600, batch=64, sequences=1000,
                         max_eval_examples=4000, eval_batch=256, test_max_ops=26, data_seed=2255, seed=0),
    # The CPU check of the flow (seconds): nothing is expected to be learned.
    "tiny": dict(hidden=32, pattern="M*" * 4, heads=2, kv_heads=1, mamba_state=16, host_data="task", host_steps=8,
                 host_batch=8,
                 host_lr=3e-3, host_sequences=20, warmup_ratio=0.1, host_seconds=0, rewarm=2, steps=3, batch=4,
                 sequences=20, max_eval_examples=70, eval_batch=64, test_max_ops=8, data_seed=2255, seed=0),
}


class Refused(SystemExit):
    """A one-line refusal before any work starts (exit status 2)."""

    def __init__(self, msg: str):
        print(f"box_scale: error: {msg}", file=sys.stderr)
        super().__init__(2)


# ---------------------------------------------------------------- the host and its checkpoint

def build(spec: dict, device: str = "cpu"):
    """The Granite 4.0 host of `spec` and the Box word tokenizer (on the meta device: shapes only, no memory)."""
    from llm_surgery.box_data import build_box_tokenizer
    from llm_surgery.hosts import build_tiny_host

    tok = build_box_tokenizer()
    head_dim = spec["hidden"] // spec["heads"]
    with torch.device(device):
        model = build_tiny_host("granite", seed=spec["seed"], hidden_size=spec["hidden"], vocab_size=len(tok),
                                pattern=spec["pattern"], num_attention_heads=spec["heads"],
                                num_key_value_heads=spec["kv_heads"], attention_multiplier=head_dim ** -0.5,
                                mamba_d_state=spec["mamba_state"], mamba_chunk_size=64, device=device,
                                position_embedding_type="rope", **PLAIN["plain"])
    return model, tok


def unique_weights(model) -> dict[str, torch.Tensor]:
    """The state dict without the tied copies (the LM head is the embedding: `named_parameters` lists it once)."""
    keep = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    return {k: v for k, v in model.state_dict().items() if k in keep}


def transport_bytes(model) -> int:
    return sum(2 * t.numel() for t in unique_weights(model).values())


def save_host(path: Path, model, state: dict) -> None:
    """Weights in bf16 shards of at most SHARD_MIB plus state.json, written beside `path` and renamed onto it."""
    from safetensors.torch import save_file

    from llm_surgery.train.checkpoint import replace_dir

    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards, size = [{}], 0
    for name, t in unique_weights(model).items():
        if size and size + 2 * t.numel() > SHARD_MIB * 2**20:
            shards.append({})
            size = 0
        shards[-1][name] = t.detach().to("cpu", torch.bfloat16).contiguous()
        size += 2 * t.numel()
    digest = hashlib.sha256()
    for i, shard in enumerate(shards):
        save_file(shard, tmp / f"weights-{i:02d}.safetensors")
        digest.update((tmp / f"weights-{i:02d}.safetensors").read_bytes())
    (tmp / "state.json").write_text(json.dumps({**state, "shards": len(shards),
                                                "fingerprint": digest.hexdigest()[:16]}, indent=2))
    replace_dir(tmp, path)


def load_host(path: Path, spec: dict | None = None):
    """(model in float32, tokenizer, state) from a checkpoint; refuses one of another spec or an incomplete one."""
    from safetensors.torch import load_file

    state_file = Path(path) / "state.json"
    if not state_file.is_file():
        raise Refused(f"{path} is not a box_scale host checkpoint (no state.json)")
    state = json.loads(state_file.read_text())
    if spec is not None:
        diff = [f"{k}: {state['spec'].get(k)!r} there, {spec[k]!r} here" for k in HOST_KEYS
                if state["spec"].get(k) != spec[k]]
        if diff:
            raise Refused(f"{path} was pretrained with other settings ({'; '.join(diff)}): resume with the same "
                          "--scale and host flags, or start a new host without --resume")
    files = [Path(path) / f"weights-{i:02d}.safetensors" for i in range(state["shards"])]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise Refused(f"{path} is incomplete: missing {', '.join(missing)}")
    model, tok = build(state["spec"])
    weights = {}
    for f in files:
        weights.update(load_file(f))
    expected = unique_weights(model)
    if set(weights) != set(expected):
        raise Refused(f"{path} does not hold this host's weights (missing {sorted(set(expected) - set(weights))[:3]}"
                      f", unexpected {sorted(set(weights) - set(expected))[:3]})")
    model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    return model, tok, state


# ---------------------------------------------------------------- stages

def spec_of(args) -> dict:
    return {k: getattr(args, k) for k in (*HOST_KEYS, "host_seconds", "rewarm", "sequences",
                                          "max_eval_examples", "eval_batch", "test_max_ops")}


def host_batches(spec: dict, tok, start: int):
    """(endless training batches from step `start` on, what they are): "task", Box examples with the loss on the
    completion (the host learns to answer IID queries itself); "language", the shipped host's documents with the
    loss on every token (it learns to read the boxes, never to answer)."""
    import itertools

    from llm_surgery.train import make_host
    from llm_surgery.train.data import make_splits
    from llm_surgery.train.host import task_batches

    if spec["host_data"] == "language":
        docs, _ = make_host.language_documents(spec["host_sequences"], doc_seed=1, seed=spec["seed"])
        batches = make_host.shuffled_batches(make_host.encode_docs(tok, docs), spec["host_batch"], spec["seed"])
        return itertools.islice(batches, start, None), f"{len(docs):,} Box-language documents (no queries)"
    records = make_splits(spec["host_sequences"], spec["data_seed"], 6, 6)["train"]
    return (task_batches(tok, records, spec["host_batch"], spec["seed"], start),
            f"{len(records):,} Box examples (loss on the answers)")


def stage_pretrain(args, out: Path, log) -> dict:
    """Pretrain (or continue) the host for at most --host-seconds; write the checkpoint to <out>/host."""
    from box_repro import eval_sets, trainer_config

    from llm_surgery.train.evaluate import evaluate
    from llm_surgery.train.host import train_all_weights
    from llm_surgery.train.setup import make_accelerator, use_cuda_kernels

    spec = spec_of(args)
    need = transport_bytes(build(spec, "meta")[0])
    if need > TRANSPORT_MIB * 2**20:
        raise Refused(f"this host's bf16 weights take {need / 2**20:.1f} MiB, over the {TRANSPORT_MIB} MiB that can "
                      "cross device calls: choose a smaller --hidden or --pattern")
    if args.resume:
        model, tok, state = load_host(Path(args.resume), spec)
        if state["step"] >= spec["host_steps"]:
            raise Refused(f"{args.resume} is done ({state['step']}/{spec['host_steps']} steps): go on to finetune")
    else:
        model, tok = build(spec)
        state = {"spec": spec, "step": 0, "calls": [], "curve": []}
    accelerator = make_accelerator(trainer_config(args))
    use_cuda_kernels(trainer_config(args), accelerator, log)  # the host's Mamba2 layers on mamba-ssm's kernels
    sets = eval_sets(accelerator, tok, args)
    batches, what = host_batches(spec, tok, state["step"])
    n = sum(p.numel() for p in model.parameters())
    log(f"host: {n:,} params ({need / 2**20:.1f} MiB in bf16), hidden {spec['hidden']}, {spec['pattern']}, heads "
        f"{spec['heads']}/{spec['kv_heads']}; steps {state['step']} -> {spec['host_steps']} x batch "
        f"{spec['host_batch']}, lr {spec['host_lr']}, {what}, at most {spec['host_seconds'] or 'no limit on'} s")
    t0, reached = time.time(), []
    amp = torch.bfloat16 if accelerator.mixed_precision == "bf16" else None
    loss = train_all_weights(model, batches, steps=spec["host_steps"], lr=spec["host_lr"],
                             device=accelerator.device, autocast_dtype=amp, warmup_ratio=spec["warmup_ratio"],
                             start=state["step"], rewarm_steps=spec["rewarm"], log=log,
                             log_every=max(1, spec["host_steps"] // 20), on_eval=lambda k, _: reached.append(k),
                             max_seconds=spec["host_seconds"] or None, stop_at=args.stop_at)  # on_eval: last step
    seconds = time.time() - t0
    step = reached[-1]
    with accelerator.autocast():
        val = evaluate(accelerator, model, tok, sets["validation"], 6)
    log(f"host at step {step}/{spec['host_steps']} ({seconds:.0f} s this call): validation {summary(val)}")
    state["calls"].append({"steps": step - state["step"], "seconds": round(seconds), "loss": loss,
                           "examples_per_s": round((step - state["step"]) * spec["host_batch"] / seconds),
                           "device": device_name(accelerator.device),
                           "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime())})
    state["step"] = step
    state["curve"].append({"step": step, "loss": loss, "val_accuracy": val["accuracy"],
                           "val_token_accuracy": val["token_accuracy"]})
    save_host(out / "host", model, state)
    done = step >= spec["host_steps"]
    log(f"wrote {out / 'host'}; " + ("pretraining done: next, finetune" if done else
                                     "not done: call again with --resume <this host>"))
    return state


def device_name(device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def stage_finetune(args, out: Path, log) -> dict:
    """Per kind and seed: the frozen host + 4 inserted layers through llm_surgery.train, the paper's recipe;
    the results of the whole call in one file, <out>/finetune-<kinds>-s<seeds>.json (rewritten after each run)."""
    from box_repro import trainer_config

    from llm_surgery.train import train
    from llm_surgery.train.outputs import write_json
    from llm_surgery.train.paper import recipe_defaults

    model, tok, state = load_host(Path(args.host))
    spec = state["spec"]
    if state["step"] < spec["host_steps"]:
        log(f"warning: {args.host} is pretrained for {state['step']} of {spec['host_steps']} steps only")
    for k in ("sequences", "max_eval_examples", "eval_batch", "test_max_ops", "data_seed"):
        setattr(args, k, spec[k])  # the splits and caps the host was validated on
    hf_dir = Path(args.work) / "host_hf"
    shutil.rmtree(hf_dir, ignore_errors=True)
    model.save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)
    recipe = {k: v for k, v in recipe_defaults(RECIPE).items()
              if k in ("n", "weight_decay", "warmup_ratio", "lr", "schedule", "min_lr_ratio", "tau", "tau_end")}
    runs = []
    name = f"finetune-{'-'.join(args.kinds)}-s{'-'.join(map(str, args.seeds))}{'-' + args.tag if args.tag else ''}.json"
    result = {"host": {"fingerprint": state["fingerprint"], "step": state["step"], "spec": spec},
              "recipe": {"name": RECIPE, **recipe, "steps": args.steps, "batch": args.batch}, "set": args.set,
              "device": device_name(torch.device(args.device)), "runs": runs}
    for kind in args.kinds:
        for seed in args.seeds:
            t0 = time.time()
            args.seed = seed
            log(f"== {kind} seed {seed}: {recipe}, {args.steps} steps x batch {args.batch}")
            cfg = trainer_config(args, model=str(hf_dir), kind=kind, max_steps=args.steps, batch_size=args.batch,
                                 log_every=max(1, args.steps // 10), eval_host=not runs,  # host alone: once a call
                                 output_dir=str(Path(args.work) / f"{kind}-s{seed}"), **{**recipe, **args.set})
            res = train(cfg)
            seconds = time.time() - t0
            log(f"{kind} seed {seed}: {seconds:.0f} s; test {summary(res['test'])}")
            runs.append({"kind": kind, "seed": seed, "set": args.set, "test": res["test"],
                         "host_alone": res["host_alone"], "params": res["params"], "seconds": round(seconds),
                         "tokens_per_s": res["throughput"]["tokens_per_s_per_process"]})
            write_json(out / name, result)  # after every run: a call cut short keeps the runs it finished
            log(f"wrote {out / name} ({len(runs)} runs)")
    return json.loads(json.dumps(result))


def _mean_std(xs: list[float | None]) -> tuple[float, float] | None:
    """Mean and standard deviation (0 for one value) in %; None where a split had nothing to score."""
    xs = [100 * x for x in xs if x is not None]
    if not xs:
        return None
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def stage_summarize(args, out: Path, log) -> dict:
    """Merge the finetune files: per kind mean ± standard deviation over seeds, the host alone, one plot."""
    files = sorted(f for d in args.results for f in (Path(d).glob("finetune-*.json") if Path(d).is_dir()
                                                      else [Path(d)]))
    if not files:
        raise Refused(f"no finetune-*.json results in {', '.join(args.results)}")
    loaded = [json.loads(f.read_text()) for f in files]
    hosts = {r["host"]["fingerprint"] for r in loaded}
    if len(hosts) > 1:
        raise Refused(f"the results come from {len(hosts)} different hosts ({', '.join(sorted(hosts))}); "
                      "summarize the calls of one host")
    runs = [run for r in loaded for run in r["runs"]]
    host_alone = next((run["host_alone"] for run in runs if run["host_alone"]), None)
    variant = lambda run: (run["kind"], json.dumps(run.get("set") or {}, sort_keys=True))  # noqa: E731
    order = lambda v: ("+" in v[0], KINDS.index(v[0].split("+")[0]), v[1] != "{}", v[1])  # noqa: E731
    variants = sorted({variant(run) for run in runs}, key=order)

    def label(kind, changed):   # "+ 4 pdssm", "+ 1 pdssm {...}", "+ pdssm+mamba2+pdssm+mamba2"
        n = json.loads(changed).get("n", loaded[0]["recipe"]["n"])
        return (f"+ {kind}" if "+" in kind else f"+ {n} {kind}") + ("" if changed == "{}" else f" {changed}")
    groups = ([("host alone", [host_alone])] if host_alone else []) + [
        (label(kind, changed), [run["test"] for run in runs if variant(run) == (kind, changed)])
        for kind, changed in variants]
    max_ops = max(int(k) for k in runs[0]["test"]["by_num_ops"])
    rows, curves = [], []
    for label, tests in groups:
        row = {"label": label, "seeds": len(tests)}
        for split in ("iid", "ood"):
            for metric in ("accuracy", "state_accuracy"):
                row[f"{split}_{metric}"] = _mean_std([t[split][metric] for t in tests])
        by = {str(n): {"accuracy": statistics.fmean(t["by_num_ops"][str(n)]["accuracy"] for t in tests)}
              for n in range(max_ops + 1)}
        rows.append(row)
        curves.append({"label": f"{label} (mean of {len(tests)})" if len(tests) > 1 else label,
                       "test": {"by_num_ops": by, "train_max_ops": 6}})
    pm = lambda v: "-" if v is None else f"{v[0]:.1f} ± {v[1]:.1f}"  # noqa: E731
    lines = ["| run | seeds | IID exact | OOD exact | IID whole state | OOD whole state |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['label']} | {r['seeds']} | {pm(r['iid_accuracy'])} | {pm(r['ood_accuracy'])} | "
              f"{pm(r['iid_state_accuracy'])} | {pm(r['ood_state_accuracy'])} |" for r in rows]
    ns = range(max_ops + 1)
    lines += ["", "| run | " + " | ".join(map(str, ns)) + " |", "|---" * (len(ns) + 1) + "|"]
    lines += [f"| {c['label']} | " + " | ".join(f"{100 * c['test']['by_num_ops'][str(n)]['accuracy']:.0f}"
                                                 for n in ns) + " |" for c in curves]
    spec = loaded[0]["host"]["spec"]
    title = (f"Box test (%), mean ± standard deviation over seeds; host {spec['hidden']} {spec['pattern']} "
             f"(step {loaded[0]['host']['step']}), {loaded[0]['recipe']['name']} recipe, "
             f"{loaded[0]['recipe']['steps']} steps x {loaded[0]['recipe']['batch']}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text(title + "\n\n" + "\n".join(lines) + "\n")
    (out / "summary.json").write_text(json.dumps({"rows": rows, "curves": curves,
                                                  "files": [f.name for f in files]}, indent=1))
    log(title + "\n\n" + "\n".join(lines))
    try:
        from llm_surgery.train.plot import plot_accuracy

        log(f"plot: {plot_accuracy(curves, out / 'accuracy.png', title='Box, host ' + spec['pattern'])}")
    except ImportError as e:  # matplotlib is optional
        log(f"no plot ({e})")
    return {"rows": rows, "curves": curves}


# ---------------------------------------------------------------- command line

def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stage", choices=("pretrain", "finetune", "summarize"))
    ap.add_argument("results", nargs="*", help="summarize: finetune-*.json files or folders holding them")
    ap.add_argument("--out", default=os.environ.get("OUT") or "runs/box_scale")
    ap.add_argument("--scale", choices=sorted(SCALES), default="27m")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--work", default="runs/box_scale_work", help="finetune: the trainer runs' own outputs")
    ap.add_argument("--resume", help="pretrain: continue this host checkpoint")
    ap.add_argument("--stop-at", type=int, default=0, help="pretrain: stop after this step (0: time/steps)")
    ap.add_argument("--host", help="finetune: the pretrained host checkpoint")
    ap.add_argument("--kinds", default=",".join(KINDS),
                    help="the kinds to fine-tune, one run each, separated by commas; a mixed insertion joins n kinds "
                         "with '+' (pdssm+mamba2+pdssm+mamba2)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--set", default="{}", help="finetune: JSON dict of trainer settings over the recipe's, e.g. "
                    "'{\"lr\": 0.003}' (recorded per run; summarize lists each variant apart)")
    ap.add_argument("--tag", default="", help="finetune: appended to the results file's name")
    for k, v in SCALES["27m"].items():  # every preset value can be overridden
        ap.add_argument("--" + k.replace("_", "-"), type=type(v), default=None)
    args = ap.parse_args(argv)
    for k, v in SCALES[args.scale].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]   # a run's kinds: one, or a mixed 'a+b+..'
    unknown = sorted({k for run in args.kinds for k in run.split("+")} - set(KINDS))
    if unknown:
        ap.error(f"unknown kinds {unknown}; choose from {KINDS} (a mixed insertion joins n of them with '+')")
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--seeds must be integers separated by commas, got {args.seeds!r}")
    try:
        args.set = json.loads(args.set)
        assert isinstance(args.set, dict)
    except (ValueError, AssertionError):
        ap.error(f"--set must be a JSON object of trainer settings, got {args.set!r}")
    from llm_surgery.train import TrainConfig

    unknown = sorted(set(args.set) - set(TrainConfig.__dataclass_fields__))
    if unknown:
        ap.error(f"--set names no trainer setting: {', '.join(unknown)}")
    if args.stage == "finetune" and not args.host:
        ap.error("finetune needs --host (a checkpoint written by the pretrain stage)")
    if args.stage == "summarize" and not args.results:
        ap.error("summarize needs the finetune results (files or folders)")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        ap.error(f"--hidden {args.hidden} must divide into --heads {args.heads}, and those into --kv-heads "
                 f"{args.kv_heads}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out / f"{args.stage}.log")
    log(f"box_scale {args.stage} on {args.device}, torch {torch.__version__}; --scale {args.scale}")
    stage = {"pretrain": stage_pretrain, "finetune": stage_finetune, "summarize": stage_summarize}[args.stage]
    return stage(args, out, log)


if __name__ == "__main__":
    main()

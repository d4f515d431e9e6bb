"""The trainer: config parsing, schedules, sampler, checkpoints (atomic, corrupt), plotting, the embedded default,
and a real 2-process gloo run through `accelerate launch` that is killed and resumed to the same losses."""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from llm_surgery.train.checkpoint import (CheckpointError, list_checkpoints, load_checkpoint, resolve_checkpoint,
                                          save_checkpoint)
from llm_surgery.train.config import TrainConfig, build_parser, parse_config
from llm_surgery.train.data import ShardedBatchSampler, cap_records, make_splits
from llm_surgery.train.evaluate import compare_results, evaluate_run
from llm_surgery.train.metrics import read_jsonl
from llm_surgery.train.schedule import build_scheduler

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- config

def test_config_flags_override_every_field():
    cfg = parse_config(["--kind", "mamba2", "--n", "2", "--model", "/x/ckpt", "--lr", "3e-4", "--positions", "0",
                        "2", "--no-progress", "--max-steps", "7", "--max-eval-examples", "none", "--lora-r", "4"])
    assert (cfg.kind, cfg.n, cfg.model, cfg.lr, cfg.positions) == ("mamba2", 2, "/x/ckpt", 3e-4, [0, 2])
    assert cfg.progress is False and cfg.max_steps == 7 and cfg.max_eval_examples is None and cfg.lora_r == 4
    flags = {a.dest for a in build_parser()._actions}
    assert {f for f in TrainConfig.__dataclass_fields__} <= flags


def test_config_recipe_defaults_and_errors(capsys):
    cfg = parse_config([], defaults={"lr": 5e-4, "schedule": "cosine", "model": "org/name"})
    assert (cfg.lr, cfg.schedule, cfg.model) == (5e-4, "cosine", "org/name")
    assert parse_config(["--lr", "1e-2"], defaults={"lr": 5e-4}).lr == 1e-2  # the command line wins
    with pytest.raises(SystemExit, match="^2$"):
        parse_config(["--kind", "lstm"])
    assert "kind must be one of" in capsys.readouterr().err
    with pytest.raises(ValueError, match="positions"):
        TrainConfig(n=2, positions=[1])
    with pytest.raises(ValueError, match="mixer_options"):
        TrainConfig(mixer_options="[1, 2]")
    with pytest.raises(ValueError, match="unknown TrainConfig fields"):
        build_parser({"learning_rate": 1.0})


# ---------------------------------------------------------------- schedule

def _lrs(total, warmup_ratio, schedule, min_lr_ratio=0.1):
    """The lr of each of `total` updates under build_scheduler (peak 1.0)."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_scheduler(opt, total, warmup_ratio, schedule, min_lr_ratio)
    lrs = []
    for _ in range(total + 1):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def test_schedule_shapes():
    total, warm = 100, 10
    const = _lrs(total, 0.1, "constant")
    assert const[0] == 0.0 and const[5] == pytest.approx(0.5) and all(v == 1.0 for v in const[warm:])
    assert all(b > a for a, b in zip(const[:warm], const[1:warm]))  # linear warm-up
    cos = _lrs(total, 0.1, "cosine", 0.1)
    assert cos[warm] == pytest.approx(1.0) and cos[total] == pytest.approx(0.1)
    assert all(b <= a + 1e-12 for a, b in zip(cos[warm:], cos[warm + 1:]))  # monotone decay to the floor
    assert cos[55] == pytest.approx(0.1 + 0.9 * 0.5, abs=1e-9)  # half way: mid-point of the cosine
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    with pytest.raises(ValueError, match="schedule"):
        build_scheduler(opt, total, 0.1, "linear")
    with pytest.raises(ValueError, match="total_steps"):
        build_scheduler(opt, 0, 0.1, "cosine")


# ---------------------------------------------------------------- data order

def test_dictionary_logits_train_at_their_own_learning_rate():
    """--dictionary-lr-scale: Flash PD-SSM's dictionary logits form their own optimizer group at that multiple of the
    learning rate, which the schedule scales like the others; every trainable tensor is in exactly one group."""
    from llm_surgery.hosts import build_tiny_host
    from llm_surgery.insert import insert_layers
    from llm_surgery.train.setup import mark_trainable
    from llm_surgery.train.trainer import build_optimizer

    model = insert_layers(build_tiny_host("granite", seed=0), "pdssm", 2)
    mark_trainable(model)
    opt = build_optimizer(model, TrainConfig(lr=1e-3, dictionary_lr_scale=0.1))
    dictionaries = {id(p) for n, p in model.named_parameters() if n.endswith(".dictionary")}
    assert len(dictionaries) == 2
    for group in opt.param_groups:
        ids = {id(p) for p in group["params"]}
        assert ids <= dictionaries or not ids & dictionaries
        assert group["lr"] == pytest.approx(1e-4 if ids <= dictionaries else 1e-3)
    grouped = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(grouped) == sorted(id(p) for p in model.parameters() if p.requires_grad)
    sched = build_scheduler(opt, 10, 0.5, "constant")
    for _ in range(5):
        opt.step()
        sched.step()
    assert sorted(g["lr"] for g in opt.param_groups)[0] == pytest.approx(1e-4)


def test_sampler_shards_and_resumes():
    n, bs, world = 50, 4, 2
    seqs = []
    for rank in range(world):
        it = iter(ShardedBatchSampler(n, bs, rank, world, seed=3))
        seqs.append([next(it) for _ in range(9)])  # crosses an epoch boundary (6 batches per epoch)
    for b in range(9):
        assert not set(seqs[0][b]) & set(seqs[1][b])  # ranks never share an example within a step
    epoch0 = [i for b in range(6) for r in range(world) for i in seqs[r][b]]
    assert len(set(epoch0)) == 48  # one epoch = a permutation minus the dropped tail
    resumed = ShardedBatchSampler(n, bs, 1, world, seed=3)
    resumed.set_position(4)
    it = iter(resumed)
    assert [next(it) for _ in range(5)] == seqs[1][4:]
    with pytest.raises(ValueError, match="global batch"):
        ShardedBatchSampler(7, 4, 0, 2, seed=0)


def test_cap_records_is_a_cap_of_whole_sequences_then_whole_states():
    recs = [{"sequence_id": s, "num_ops": n, "box": b} for s in "abc" for n in range(4) for b in range(2)]  # 8 each
    assert len(cap_records(recs, None)) == len(cap_records(recs, 24)) == 24
    assert cap_records(recs, 16) == recs[:16]  # two whole sequences
    # 21: two sequences, then 2 of the third's 4 states (2 records each), spread: at 1 and 3 operations
    assert [(r["sequence_id"], r["num_ops"]) for r in cap_records(recs, 21)[16:]] == [("c", 1)] * 2 + [("c", 3)] * 2
    assert cap_records(recs, 5) == [r for r in recs[:8] if r["num_ops"] in (1, 3)]  # 2 states of the first
    assert cap_records(recs, 1) == recs[:1]  # below one state: the first records


# ---------------------------------------------------------------- checkpoints

@pytest.fixture(scope="module")
def accelerator():
    from accelerate import Accelerator
    return Accelerator(cpu=True)


def _tiny_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    model[0].requires_grad_(False)  # frozen: must not be saved
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    sched = build_scheduler(opt, 10, 0.1, "cosine")
    for _ in range(3):
        model(torch.randn(5, 4)).pow(2).mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched


def test_atomic_checkpoint_write_and_keep_last(tmp_path, accelerator):
    model, opt, sched = _tiny_state()
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        save_checkpoint(accelerator, root, step, model, opt, sched, {"epoch": 0, "batch_in_epoch": step}, keep_last=2)
    assert [p.name for p in list_checkpoints(root)] == ["step-00000004", "step-00000006"]
    assert not list(root.glob(".tmp-*"))
    files = sorted(f.name for f in (root / "step-00000006").iterdir())
    assert files == ["optimizer.pt", "rng-rank0.pt", "scheduler.pt", "state.json", "trainable.safetensors"]
    from safetensors.torch import load_file
    assert set(load_file(root / "step-00000006" / "trainable.safetensors")) == {"1.weight", "1.bias"}
    # a write killed half way leaves a temporary directory, never a half checkpoint that `latest` would pick
    (root / ".tmp-step-00000008").mkdir()
    (root / ".tmp-step-00000008" / "state.json").write_text("{")
    assert resolve_checkpoint("latest", root).name == "step-00000006"

    # restoring gives back weights, optimizer moments, schedule position and RNG stream
    model2, opt2, sched2 = _tiny_state()
    with torch.no_grad():
        model2[1].weight.zero_()
    torch.manual_seed(123)
    state = load_checkpoint(accelerator, root / "step-00000006", model2, opt2, sched2)
    assert state["step"] == 6 and state["batch_in_epoch"] == 6 and state["world_size"] == 1
    torch.testing.assert_close(model2[1].weight, model[1].weight)
    assert sched2.last_epoch == sched.last_epoch
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    torch.testing.assert_close(s1[0]["exp_avg"], s2[0]["exp_avg"])


def test_corrupt_or_missing_checkpoint_errors(tmp_path, accelerator):
    model, opt, sched = _tiny_state()
    root = tmp_path / "checkpoints"
    with pytest.raises(CheckpointError, match="no checkpoint under"):
        resolve_checkpoint("latest", root)
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint(str(tmp_path / "nope"), root)
    path = save_checkpoint(accelerator, root, 1, model, opt, sched, {}, keep_last=3)
    weights = path / "trainable.safetensors"
    weights.write_bytes(weights.read_bytes()[:20])  # truncated by a full disk, say
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(accelerator, path, model, opt, sched)
    path = save_checkpoint(accelerator, root, 2, model, opt, sched, {}, keep_last=3)
    (path / "optimizer.pt").unlink()
    with pytest.raises(CheckpointError, match="incomplete: missing optimizer.pt"):
        load_checkpoint(accelerator, path, model, opt, sched)
    path = save_checkpoint(accelerator, root, 3, model, opt, sched, {}, keep_last=3)
    (path / "state.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="state.json is not valid JSON"):
        load_checkpoint(accelerator, path, model, opt, sched)
    other = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))  # a different model
    path = save_checkpoint(accelerator, root, 4, model, opt, sched, {}, keep_last=3)
    with pytest.raises(CheckpointError, match="does not match"):
        load_checkpoint(accelerator, path, other, torch.optim.AdamW(other.parameters()), sched)


def test_checkpoint_of_other_shapes_is_a_checkpoint_error(tmp_path, accelerator):
    """Same parameter names, other shapes (another width or head count): a CheckpointError naming the tensor, not
    a RuntimeError from deep inside load_state_dict."""
    model, opt, sched = _tiny_state()
    path = save_checkpoint(accelerator, tmp_path / "checkpoints", 1, model, opt, sched, {}, keep_last=1)
    wider = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    wider[0].requires_grad_(False)
    opt2 = torch.optim.AdamW([p for p in wider.parameters() if p.requires_grad])
    with pytest.raises(CheckpointError, match=r"other shapes.*1.weight \(2, 8\) there, \(3, 8\) here"):
        load_checkpoint(accelerator, path, wider, opt2, build_scheduler(opt2, 10, 0.1, "cosine"))


def test_pruning_keeps_other_runs_checkpoints(tmp_path, accelerator):
    """keep_last applies to the checkpoints of the run being saved; another run's in the same folder stay."""
    from llm_surgery.train.checkpoint import checkpoint_run_id

    model, opt, sched = _tiny_state()
    root = tmp_path / "checkpoints"
    for step in (1, 2):
        save_checkpoint(accelerator, root, step, model, opt, sched, {}, keep_last=1, extra={"run_id": "older"})
    for step in (3, 4, 5):
        save_checkpoint(accelerator, root, step, model, opt, sched, {}, keep_last=1, extra={"run_id": "newer"})
    kept = {p.name: checkpoint_run_id(p) for p in list_checkpoints(root)}
    assert kept == {"step-00000002": "older", "step-00000005": "newer"}


# ---------------------------------------------------------------- evaluation

class _Oracle(torch.nn.Module):
    """Logits at position t point at input token t+1 (+ `shift`): teacher-forced exact match is then perfect
    (shift 0) or never right (shift 1), which pins the alignment of the completion positions."""

    def __init__(self, vocab: int, shift: int = 0):
        super().__init__()
        self.vocab, self.shift, self.dummy = vocab, shift, torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask=None, use_cache=False, logits_to_keep=0):
        nxt = torch.roll(input_ids, -1, dims=1)
        nxt = (nxt + self.shift) % self.vocab
        logits = torch.nn.functional.one_hot(nxt, self.vocab).float()
        from types import SimpleNamespace
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


def test_teacher_forced_eval_alignment(accelerator):
    from llm_surgery.box_data import build_box_tokenizer, generate_split
    from llm_surgery.train.evaluate import EvalSet, evaluate
    tok = build_box_tokenizer()
    recs = generate_split("test", 2, 8, seed=1)
    evalset = EvalSet(accelerator, tok, "test", recs, batch_size=16)
    right = evaluate(accelerator, _Oracle(len(tok)), tok, evalset, train_max_ops=3)
    assert right["accuracy"] == 1.0 and right["ood"]["num_examples"] == 2 * 5 * 7
    assert set(right["by_num_ops"]) == set(range(9))
    wrong = evaluate(accelerator, _Oracle(len(tok), shift=1), tok, evalset, train_max_ops=3)
    assert wrong["accuracy"] == 0.0
    assert right["token_accuracy"] == 1.0 and wrong["ood"]["token_accuracy"] == 0.0
    from llm_surgery.train.metrics import results_table
    assert results_table({"kind": "x", "test": right}).row_count == 3 + 9


# ---------------------------------------------------------------- plot

def test_plot_overlays_runs(tmp_path):
    from llm_surgery.train.plot import load_results, main as plot_main
    for name, acc in (("a", 0.9), ("b", 0.5)):
        d = tmp_path / name
        d.mkdir()
        by = {str(k): {"accuracy": acc / (1 + k), "num_examples": 7} for k in range(8)}
        (d / "results.json").write_text(json.dumps({"kind": name, "test": {"by_num_ops": by, "train_max_ops": 3}}))
    out = tmp_path / "cmp.png"
    plot_main([str(tmp_path / "a"), str(tmp_path / "b" / "results.json"), "-o", str(out)])
    assert out.stat().st_size > 5000 and out.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(FileNotFoundError, match="missing does not exist"):  # the command line: one line, exit 2
        load_results(tmp_path / "missing")


# ---------------------------------------------------------------- end to end

SMALL = ["--num-sequences", "20", "--batch-size", "4", "--max-eval-examples", "60", "--eval-batch-size", "32",
         "--log-every", "1", "--no-progress", "--no-plot", "--n", "2"]


def _env():
    return dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1",
                TOKENIZERS_PARALLELISM="false")


CRASH_AFTER_3 = [str(REPO / "tests" / "crash_after_step.py"), "3"]  # rank 0 SIGKILLed once step 3 is logged


def _launch(args, env, expect_ok=True, script=("-m", "llm_surgery.train")):
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", *script, *args]
    path = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))  # a script's folder is not the repo
    proc = subprocess.run(cmd, env={**env, "ACCELERATE_USE_CPU": "true", "PYTHONPATH": path}, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    if expect_ok and proc.returncode != 0:
        raise AssertionError(f"launch failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def _assert_same_evaluation(got: dict, want: dict) -> None:
    """Two evaluations of one checkpoint on one test split agree. (A tiny random host scores ~0 after 4 steps, so
    this checks above all that a gather neither drops nor repeats examples: every count per number of operations
    must match.)"""
    assert got["num_examples"] == want["num_examples"] == len(cap_records(make_splits(20, 2255, 6, 26)["test"], 60))
    check = compare_results(want, got)
    assert check["counts_equal"] and len(got["by_num_ops"]) > 5
    assert check["max_abs_accuracy_diff"] <= 1e-12 and got["token_accuracy"] is not None


@pytest.mark.slow
def test_two_process_gloo_run_killed_and_resumed(tmp_path, tiny_host_dir):
    common = ["--model", str(tiny_host_dir), "--kind", "mamba2", "--max-steps", "4", "--save-every", "2", *SMALL]
    full = tmp_path / "full"
    proc = _launch([*common, "--output-dir", str(full)], _env())
    assert "2 processes (MULTI_CPU)" in proc.stdout  # really two ranks on gloo, not two copies of one
    res = json.loads((full / "results.json").read_text())
    assert res["num_processes"] == 2 and res["test"]["num_examples"] > 0 and "ood" in res["test"]
    assert (full / "final" / "inserted.json").is_file() and (full / "final" / "inserted.safetensors").is_file()
    ckpt = full / "checkpoints" / "step-00000004"
    assert json.loads((ckpt / "state.json").read_text())["world_size"] == 2
    assert (ckpt / "rng-rank0.pt").is_file() and (ckpt / "rng-rank1.pt").is_file()
    ref = {r["step"]: r["loss"] for r in read_jsonl(full / "metrics.jsonl") if "loss" in r}
    assert sorted(ref) == [1, 2, 3, 4] and all(math.isfinite(v) for v in ref.values())
    # the metrics gathered from the 2 ranks equal one process evaluating the saved checkpoint alone
    _assert_same_evaluation(evaluate_run(full), res["test"])
    # a fresh launch into the finished run's directory: every rank refuses, the user reads one line
    proc = _launch([*common, "--output-dir", str(full)], _env(), expect_ok=False)
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert proc.returncode != 0 and len(errors) == 1 and "already holds a run" in errors[0], proc.stderr[-3000:]
    assert json.loads((full / "results.json").read_text()) == res

    crashed = tmp_path / "crashed"
    proc = _launch([*common, "--output-dir", str(crashed)], _env(), expect_ok=False, script=CRASH_AFTER_3)
    assert proc.returncode != 0
    assert [p.name for p in list_checkpoints(crashed / "checkpoints")] == ["step-00000002"]
    assert not (crashed / "results.json").exists()
    _launch([*common, "--output-dir", str(crashed), "--resume", "latest"], _env())
    got = {r["step"]: r["loss"] for r in read_jsonl(crashed / "metrics.jsonl") if "loss" in r}
    assert sorted(got) == [1, 2, 3, 4]
    for step in ref:
        assert abs(got[step] - ref[step]) <= 1e-6, (step, got[step], ref[step])
    resumed = json.loads((crashed / "results.json").read_text())
    assert resumed["test"]["accuracy"] == pytest.approx(res["test"]["accuracy"])


@pytest.mark.slow
def test_fsdp2_on_two_cpu_processes_matches_ddp_and_resumes(tmp_path, tiny_host_dir):
    """The trainer's FSDP2 code (sharded parameters, gathered checkpoints and artifact, resume), which Accelerate
    runs only on GPUs, run on 2 gloo processes (tests/fsdp_on_cpu.py makes Accelerate shard there): same losses
    as DDP, the same saved layers, an exact resume, and gathered metrics equal to a one-process evaluation."""
    from safetensors.torch import load_file

    common = ["--model", str(tiny_host_dir), "--kind", "pdssm", "--max-steps", "4", "--save-every", "2", *SMALL]
    script = [str(REPO / "tests" / "fsdp_on_cpu.py"), "--fsdp"]
    ddp, fsdp, crashed = tmp_path / "ddp", tmp_path / "fsdp", tmp_path / "crashed"
    _launch([*common, "--output-dir", str(ddp)], _env())
    proc = _launch([*common, "--output-dir", str(fsdp)], _env(), script=script)
    assert "2 processes (FSDP)" in proc.stdout
    losses = lambda run: {r["step"]: r["loss"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r}
    ref = losses(ddp)
    assert sorted(losses(fsdp)) == [1, 2, 3, 4]
    for step, loss in losses(fsdp).items():
        assert loss == pytest.approx(ref[step], rel=1e-5), step
    # the artifact holds whole tensors (gathered from both shards), equal to DDP's
    want, got = load_file(ddp / "final" / "inserted.safetensors"), load_file(fsdp / "final" / "inserted.safetensors")
    assert sorted(got) == sorted(want) and len(got) > 10
    for name in want:
        assert got[name].shape == want[name].shape, name
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    _assert_same_evaluation(evaluate_run(fsdp), json.loads((fsdp / "results.json").read_text())["test"])

    proc = _launch([*common, "--output-dir", str(crashed)], _env(), expect_ok=False,
                   script=[*CRASH_AFTER_3, *script])
    assert proc.returncode != 0
    assert [p.name for p in list_checkpoints(crashed / "checkpoints")] == ["step-00000002"]
    _launch([*common, "--output-dir", str(crashed), "--resume", "latest"], _env(), script=script)
    for step, loss in losses(crashed).items():
        assert abs(loss - losses(fsdp)[step]) <= 1e-6, step


def test_fsdp_without_gpus_is_a_clear_error():
    """Accelerate runs FSDP only on accelerators; on CPU it would quietly fall back to plain DDP."""
    from llm_surgery.train.setup import make_accelerator
    with pytest.raises(ValueError, match="--fsdp needs"):
        make_accelerator(TrainConfig(fsdp=True, cpu=True))


@pytest.mark.slow
def test_embedded_default_pretrains_once_and_trains(tmp_path, monkeypatch):
    """The fallback of the no-argument path when the shipped host is absent (tiny host pretrained on Box, cached),
    shortened; the second run reuses the cache."""
    from llm_surgery.train import host as host_mod, run
    from llm_surgery.train.host import tiny_host_dir as host_dir

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(host_mod, "SHIPPED_HOST", tmp_path / "no_shipped_host")
    args = ["--pretrain-steps", "3", "--max-steps", "2", "--cache-dir", str(tmp_path / "cache"), "--kind", "mamba2",
            "--output-dir", str(tmp_path / "run"), *SMALL, "--test-max-ops", "8", "--max-eval-examples", "40"]
    res = run(args)
    cached = host_dir(parse_config(args))
    assert (cached / "config.json").is_file() and (cached / "pretrain.json").is_file()
    stamp = (cached / "model.safetensors").stat().st_mtime_ns
    assert res["steps"] == 2 and set(res["test"]) >= {"iid", "ood", "by_num_ops"}
    res2 = run([*args, "--overwrite"])  # the same output dir: the first run's outputs are replaced, explicitly
    assert (cached / "model.safetensors").stat().st_mtime_ns == stamp  # not pretrained again
    assert res2["test"]["accuracy"] == res["test"]["accuracy"]


PAPER = {"granite350m": (1e-3, "constant"), "granite1b": (1e-3, "constant"), "granite3b": (5e-4, "cosine"),
         "granite7b": (5e-4, "cosine"), "nemotronh9b": (1e-4, "cosine"), "nemotronh12b": (1e-4, "cosine"),
         "nemotronh30b": (1e-4, "cosine")}


@pytest.mark.parametrize("name", sorted(PAPER))
def test_recipes_carry_the_paper_settings(name):
    from llm_surgery.train.paper import recipe_defaults
    defaults = recipe_defaults(name)
    cfg = parse_config([], defaults=defaults)
    assert (cfg.lr, cfg.schedule) == PAPER[name]
    assert cfg.weight_decay == 0.1 and cfg.warmup_ratio == 0.1 and cfg.n == 4 and cfg.min_lr_ratio == 0.1
    assert (cfg.tau, cfg.tau_end) == (1.0, 0.1)  # the STE temperature annealed over the run
    assert cfg.model.count("/") == 1  # a hub id, replaceable by --model /local/path
    local = parse_config(["--model", "/data/ckpt", "--kind", "mamba2"], defaults=defaults)
    assert local.model == "/data/ckpt" and local.kind == "mamba2"


def test_every_recipe_file_is_a_row_of_the_table_and_parses_its_command_line(monkeypatch, capsys):
    """recipes/<name>.py names its row by its file name alone: each file has a row, each row a file, and running
    the file (as `accelerate launch` does) parses that row's defaults: --help shows its hub id and schedule."""
    import runpy

    from llm_surgery.train.paper import PAPER_HOSTS

    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps help at the terminal's width, hub ids included
    files = sorted(p.stem for p in (REPO / "recipes").glob("*.py"))
    assert files == sorted(PAPER_HOSTS) == sorted(PAPER)
    for name in files:
        monkeypatch.setattr(sys, "argv", [f"recipes/{name}.py", "--help"])
        with pytest.raises(SystemExit, match="^0$"):
            runpy.run_path(str(REPO / "recipes" / f"{name}.py"), run_name="__main__")
        help_text = capsys.readouterr().out
        assert help_text.startswith(f"usage: recipes/{name}.py"), help_text[:200]
        lines = {line.split()[0]: line for line in help_text.splitlines() if line.startswith("  --")}
        assert lines["--model"].endswith(f"(default: {PAPER_HOSTS[name][0]})")
        assert lines["--schedule"].endswith(f"(default: {PAPER[name][1]})")


@pytest.mark.slow
def test_lora_trains_and_round_trips(tmp_path, tiny_host_dir, monkeypatch):
    """--lora-r adds peft LoRA to the host attention projections; it trains with the inserted layers and is
    saved next to them; load_trained puts both back into a fresh host."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from llm_surgery.train import run
    from llm_surgery.train.artifact import load_trained

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "lora"
    res = run(["--model", str(tiny_host_dir), "--kind", "deltanet", "--lora-r", "4", "--max-steps", "3",
               "--lr", "1e-2", "--grad-accum", "2", "--output-dir", str(out), *SMALL])
    assert read_jsonl(out / "metrics.jsonl")[2]["epoch"] == pytest.approx(6 / (588 // 4))  # 2 micro-batches a step
    assert res["params"]["trainable"] > res["params"]["inserted"]  # LoRA weights train too
    saved = load_file(out / "final" / "lora" / "adapter_model.safetensors")
    assert saved and all("lora_" in k and k.startswith("base_model.model.") for k in saved)
    assert not any(".pre_ssm." in k for k in saved)  # DeltaNet's q/k/v/o_proj share the names but get no LoRA
    assert any(v.abs().sum() > 0 for k, v in saved.items() if "lora_B" in k)  # B starts at zero: it trained
    host = load_trained(AutoModelForCausalLM.from_pretrained(tiny_host_dir), out / "final")
    state = host.state_dict()
    for k, v in saved.items():   # peft's in-model names carry the adapter's name ("default")
        torch.testing.assert_close(state[k.removeprefix("base_model.model.").replace(".weight", ".default.weight")], v)
    assert not any(p.requires_grad for p in host.parameters())
    assert not any(".pre_ssm." in k and "lora_" in k for k in state)   # loading keeps LoRA out of them too
    # a standard peft adapter: peft alone loads it onto the plain host (the surgery keeps the host's module names)
    from peft import PeftModel

    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_host_dir), out / "final" / "lora")
    peft_state = plain.state_dict()
    for k, v in saved.items():
        torch.testing.assert_close(peft_state[k.replace(".weight", ".default.weight")], v)
    assert plain.peft_config["default"].r == 4


@pytest.mark.slow
def test_bf16_autocast_path_like_a_gpu(tmp_path, tiny_host_dir):
    """What a GPU run does, on the CPU: bf16 frozen host, float32 trainable layers, bf16 autocast (the PD-SSM
    layer keeps its scan in float32 inside autocast). Loss must be finite and the trained weights float32."""
    from safetensors.torch import load_file

    out = tmp_path / "bf16"
    # its own process: Accelerate fixes the mixed precision once per process
    subprocess.run([sys.executable, "-m", "llm_surgery.train", "--model", str(tiny_host_dir), "--kind", "pdssm",
                    "--max-steps", "2", "--mixed-precision", "bf16", "--host-dtype", "bfloat16", "--output-dir",
                    str(out), *SMALL, "--test-max-ops", "8", "--max-eval-examples", "30"],
                   env=_env(), cwd=REPO, check=True, capture_output=True, timeout=300)
    res = json.loads((out / "results.json").read_text())
    losses = [r["loss"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    assert res["test"]["num_examples"] > 0
    weights = load_file(out / "final" / "inserted.safetensors")
    assert {v.dtype for v in weights.values()} <= {torch.float32, torch.complex64}
    # re-evaluating the artifact (its own process, bf16 like the run: float32 trained layers under autocast)
    # gives the run's own figures
    check = ("import json, sys; from llm_surgery.train.evaluate import compare_results, evaluate_run; "
             "print(json.dumps(compare_results(json.loads(sys.argv[2]), evaluate_run(sys.argv[1]))))")
    done = subprocess.run([sys.executable, "-c", check, str(out), json.dumps(res["test"])], env=_env(), cwd=REPO,
                          check=True, capture_output=True, text=True, timeout=300)
    cmp = json.loads(done.stdout.strip().splitlines()[-1])
    assert cmp["counts_equal"] and cmp["max_abs_accuracy_diff"] == 0.0, cmp


def test_mixed_precision_flag_then_accelerate_config_then_auto():
    from llm_surgery.train.config import UsageError
    from llm_surgery.train.setup import resolve_precision

    env = {"ACCELERATE_MIXED_PRECISION": "BF16"}  # what accelerate launch exports from its config or its flag
    assert resolve_precision(None, False, env)[0] == "bf16"
    assert resolve_precision("no", True, env) == ("no", "--mixed-precision")  # the flag wins
    assert resolve_precision(None, True, {}) == ("bf16", "default: auto")
    assert resolve_precision(None, False, {})[0] == "no"
    assert resolve_precision("auto", False, env)[0] == "no"
    with pytest.raises(UsageError, match=r"mixed precision 'fp8' \(ACCELERATE_MIXED_PRECISION\), which this trainer "
                                         r"does not support; use no, bf16 or fp16"):
        resolve_precision(None, True, {"ACCELERATE_MIXED_PRECISION": "fp8"})


@pytest.mark.slow
def test_accelerate_config_precision_is_used_recorded_and_a_flag_overrides_it(tmp_path, tiny_host_dir):
    """No --mixed-precision: the run takes Accelerate's setting (here bf16, as `accelerate config` or `accelerate
    launch --mixed_precision bf16` export it) and records it in config.json and its checkpoints; a resume whose flag
    says otherwise runs in the flag's precision, so it is refused as a changed setting."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    env = {**_env(), "ACCELERATE_MIXED_PRECISION": "bf16"}
    args = [sys.executable, "-m", "llm_surgery.train", *_run_args(tiny_host_dir, out, "--max-steps", "1")]
    proc = subprocess.run(args, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mixed precision bf16 (from Accelerate's config (ACCELERATE_MIXED_PRECISION))" in proc.stdout
    assert json.loads((out / "config.json").read_text())["mixed_precision"] == "bf16"
    [ckpt] = list_checkpoints(out / "checkpoints")
    assert json.loads((ckpt / "state.json").read_text())["settings"]["mixed_precision"] == "bf16"
    weights = load_file(out / "final" / "inserted.safetensors")  # float32 master weights: bf16 autocast was on
    assert {v.dtype for v in weights.values()} <= {torch.float32, torch.complex64}
    proc = subprocess.run([*args, "--resume", "latest", "--max-steps", "2", "--mixed-precision", "no"], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "mixed_precision: 'bf16' -> 'no'" in proc.stderr, proc.stderr[-3000:]


def test_step_profile_accounts_each_phase_and_the_rest_of_the_step(monkeypatch):
    """StepProfile on a fake clock where the device takes 0.5 s to finish at each synchronisation: only the window's
    steps count; a phase's time runs until the device has finished it, its issue time until the host is done;
    `other` is the step's time outside the named phases (the loop's own and the closing wait); evaluations are timed
    whether or not their step is profiled."""
    from types import SimpleNamespace

    from llm_surgery.train import profile

    now = [0.0]

    def advance(seconds):
        now[0] += seconds

    monkeypatch.setattr(profile, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    prof = profile.StepProfile(torch.device("cpu"), first_step=2, steps=2)
    monkeypatch.setattr(prof, "_sync", lambda: advance(0.5))
    for step in range(5):
        assert prof.begin_step(step) == (step in (2, 3))
        with prof.phase("data"):
            advance(1.0)
        with prof.phase("forward"):
            advance(2.0)
        advance(0.25)   # the loop's own Python
        prof.end_step()
    with prof.evaluation("test"):
        advance(3.0)
    assert prof.result() == {
        "steps": 2, "step_ms": 4750.0,   # 1.5 + 2.5 + 0.25 + the closing 0.5 s wait
        "phases_ms": {"data": 1500.0, "forward": 2500.0, "backward": 0.0, "optimizer": 0.0, "check_and_log": 0.0,
                      "other": 750.0},
        "issue_ms": {"data": 1000.0, "forward": 2000.0, "backward": 0.0, "optimizer": 0.0, "check_and_log": 0.0},
        "evaluations": [{"split": "test", "seconds": 3.5}]}   # 3 s and the closing wait
    assert profile.StepProfile(torch.device("cpu"), first_step=9, steps=2).result() is None   # no step profiled


def test_step_profile_is_written_and_stays_out_of_the_throughput(tmp_path, tiny_host_dir):
    """--profile-steps: the last steps' breakdown (data, forward, backward, optimizer, check_and_log, other) is
    written, and those steps stay out of the throughput. (How the times compare with unprofiled steps is a
    benchmark's question: on a loaded CPU their ratio swung from 0.06 to 5.7.)"""
    from llm_surgery.train import run

    out = tmp_path / "run"
    res = run(_run_args(tiny_host_dir, out, "--max-steps", "6", "--save-every", "0", "--profile-steps", "3",
                        "--no-eval-host"))
    prof = json.loads((out / "step_profile.json").read_text())
    assert prof == json.loads(json.dumps(res["step_profile"])) and prof["steps"] == 3
    phases = prof["phases_ms"]
    assert list(phases) == ["data", "forward", "backward", "optimizer", "check_and_log", "other"]
    assert min(phases.values()) >= -1e-6 and phases["forward"] > 0 and phases["backward"] > 0
    assert phases["other"] >= 0
    assert all(0 <= prof["issue_ms"][k] <= phases[k] + 1e-6 for k in prof["issue_ms"])
    assert [e["split"] for e in prof["evaluations"]] == ["validation", "test"]
    t = res["throughput"]
    assert t["warmup_steps"] == 1 and t["timed_steps"] == 6 - 1 - 3  # a fifth of the steps warm up, 3 profiled
    assert t["tokens_per_s_per_process"] > 0 and t["timed_seconds"] > 0


def test_only_trained_tensors_are_upcast_under_mixed_precision(tiny_host_dir):
    """Training and evaluate_run keep exactly the inserted layers in float32 under bf16 autocast (one helper)."""
    from types import SimpleNamespace

    from llm_surgery.insert import insert_layers, inserted_layers
    from llm_surgery.train.host import load_pretrained
    from llm_surgery.train.setup import mark_trainable, upcast_trainable

    model, _ = load_pretrained(str(tiny_host_dir), torch.bfloat16, torch.device("cpu"))
    insert_layers(model, "pdssm", 1)
    model.to(torch.bfloat16)
    mark_trainable(model)
    upcast_trainable(model, SimpleNamespace(mixed_precision="no"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    upcast_trainable(model, SimpleNamespace(mixed_precision="bf16"))
    inserted = {id(p) for block in inserted_layers(model).values() for p in block.parameters()}
    for name, p in model.named_parameters():
        assert p.dtype == (torch.float32 if id(p) in inserted else torch.bfloat16), name


def test_startup_script_times_the_first_step_of_fresh_and_warm_runs(tmp_path):
    """bench/startup.py on the CPU main job: each run stops at its first step's record, and the report holds a row
    per run in order, with no CUDA graphs to prepare there."""
    out = tmp_path / "startup.md"
    proc = subprocess.run([sys.executable, "bench/startup.py", "--command", f"{sys.executable} -m llm_surgery.train",
                           "--runs", "pdssm:fresh", "pdssm:warm", "--work-dir", str(tmp_path / "work"),
                           "--out", str(out)], env={**_env(), "PYTHONPATH": str(REPO)}, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = re.findall(r"^\| pdssm \| (fresh|warm) \| ([0-9.]+) \| - \|$", out.read_text(), flags=re.M)
    assert [r[0] for r in rows] == ["fresh", "warm"] and all(0 < float(t) < 120 for _, t in rows), out.read_text()


@pytest.mark.slow
def test_multi_gpu_script_on_cpu(tmp_path):
    """bench/multi_gpu.py's logic with a tiny host and gloo: saved host, a 1- and a 2-process launch of the granite3b
    recipe side by side (--parallel), every rank's throughput in results.json and metrics.jsonl, one table row per
    launch with its efficiency against the 1-process run at the same batch, and the step-time breakdown."""
    out = tmp_path / "mg"
    proc = subprocess.run([sys.executable, "bench/multi_gpu.py", "--cpu", "--tiny", "--steps", "4", "--check-eval",
                           "--runs", "ddp:1@2,ddp:2@2", "--parallel", "--gpus", "3", "--profile-steps", "2",
                           "--max-eval-examples", "40", "--out", str(out), "--copy-to", str(tmp_path / "small"),
                           "--", "--num-sequences", "20",
                           "--test-max-ops", "8", "--eval-batch-size", "64"],
                          env={**_env(), "PYTHONPATH": str(REPO)}, cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "multi_gpu.json").read_text())
    assert [(r["num_processes"], r["batch_size"], r["wave"]) for r in summary["runs"]] == [(1, 2, 1), (2, 2, 1)]
    two = summary["runs"][1]["throughput"]
    assert len(two["tokens_per_s_by_process"]) == 2 and all(v > 0 for v in two["tokens_per_s_by_process"])
    assert two["tokens_per_s_total"] == pytest.approx(sum(two["tokens_per_s_by_process"]))
    assert two["timed_steps"] == 11 - 2 - 2  # 4 + 5 + 2 steps; a run this short warms up for 2, 2 profiled
    logged = [r["throughput"] for r in read_jsonl(out / "ddp-np2-b2" / "metrics.jsonl") if "throughput" in r]
    assert logged == [two]
    # the precision came from the launcher (as from `accelerate config`), not from a trainer flag
    assert json.loads((out / "ddp-np2-b2" / "config.json").read_text())["mixed_precision"] == "no"
    md = (out / "multi_gpu.md").read_text()
    rows = [line for line in md.splitlines() if line[:4] in ("| 1 ", "| 2 ")]
    assert len(rows) == 4 and rows[0].split("|")[6].strip() == "100%"  # 2 throughput rows, 2 breakdown rows
    assert "step-time breakdown" in md and all(r["step_profile"]["steps"] == 2 for r in summary["runs"])
    # the 2-process run's gathered metrics against this script's one-process evaluation of its saved layers
    [check] = summary["eval_checks"]
    assert check["num_processes"] == 2 and check["counts_equal"] and check["max_abs_accuracy_diff"] < 1e-12
    assert check["num_examples"][0] == check["num_examples"][1] > 0
    # --copy-to: the summaries and each run's small files, without the host and the weights
    small = tmp_path / "small"
    assert (small / "multi_gpu.md").read_text() == md and (small / "ddp-np2-b2" / "step_profile.json").is_file()
    assert not (small / "host").exists() and not list(small.rglob("*.safetensors"))


def test_multi_gpu_timeout_kills_every_rank_and_reports_the_traceback(tmp_path, monkeypatch):
    """A launch that outlives --timeout is killed with its whole process group (orphaned ranks had kept their GPU
    memory), and a failed launch reports the child's traceback, not the launcher's summary."""
    import importlib.util
    monkeypatch.syspath_prepend(str(REPO / "bench"))   # its sibling modules, as when run as a script
    spec = importlib.util.spec_from_file_location("multi_gpu", REPO / "bench" / "multi_gpu.py")
    mg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mg)
    log = ["noise", "[rank1]: Traceback (most recent call last):", "[rank1]:   File x", "[rank1]: OutOfResources: y",
           "Traceback (most recent call last):", "ChildFailedError"]
    assert mg.failure_lines(log, context=3) == log[1:4]
    assert mg.failure_lines(["a", "b"]) == ["a", "b"]
    pidfile = tmp_path / "grandchild.pid"
    script = tmp_path / "sleeper.py"  # stands in for the recipe: it starts a "rank" and both sleep
    script.write_text("import subprocess, sys, time\n"
                      "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                      f"open({str(pidfile)!r}, 'w').write(str(p.pid))\ntime.sleep(60)\n")
    args = mg.parse_args(["--cpu", "--timeout", "15", "--out", str(tmp_path)])
    assert args.runs == [("ddp", 1, None), ("ddp", 2, None)]
    assert mg.parse_args(["--runs", "fsdp:8,ddp:1@32", "--batch-size", "8"]).runs == [("fsdp", 8, 8), ("ddp", 1, 32)]
    assert mg.parse_args(["--procs", "2,1"]).runs == [("ddp", 2, None), ("ddp", 1, None)]
    for bad in ("fsdp:1", "ddp:2@0", "ddp:2@x"):
        with pytest.raises(SystemExit, match=bad):
            mg.parse_args(["--runs", bad])
    # --parallel: consecutive launches that fit share a wave on disjoint devices
    runs = mg.parse_args(["--runs", "ddp:1@8,ddp:1@32,ddp:2@8,fsdp:2@8,ddp:2@32,ddp:4@8"]).runs
    assert [[(r[1], d) for r, d in w] for w in mg.waves(runs, 4, True)] == [
        [(1, [0]), (1, [1]), (2, [2, 3])], [(2, [0, 1]), (2, [2, 3])], [(4, [0, 1, 2, 3])]]
    assert [len(w) for w in mg.waves(runs, 4, False)] == [1] * 6
    args.recipe = str(script)
    job = mg.start(args, 1, tmp_path / "host", tmp_path / "np1")
    for _ in range(1200):   # once the stand-in's child runs, the deadline passes at once
        if pidfile.is_file() and pidfile.read_text():
            break
        time.sleep(0.1)
    else:
        pytest.fail("the stand-in recipe did not start within 120 s")
    res = mg.finish(job, deadline=time.time())
    assert res["rc"] == "timeout"
    pid = int(pidfile.read_text())
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the launched process's child outlived the timeout")


# ---------------------------------------------------------------- nothing lost, nothing mixed

def _run_args(host, out, *extra):
    return ["--model", str(host), "--kind", "mamba2", "--max-steps", "2", "--save-every", "1", "--keep-last", "5",
            "--output-dir", str(out), *SMALL, "--test-max-ops", "8", "--max-eval-examples", "30", "--no-tensorboard",
            *extra]


def test_fresh_run_refuses_a_used_dir_resume_refuses_changed_settings_overwrite_clears(tmp_path, tiny_host_dir):
    """A second fresh run into a run's directory refuses (naming --resume and --overwrite) and changes nothing; a
    resume with other settings refuses with every difference and leaves config.json alone; --overwrite replaces
    the earlier run (a new run id, none of its checkpoints left)."""
    from llm_surgery.train import run
    from llm_surgery.train.checkpoint import checkpoint_run_id
    from llm_surgery.train.config import UsageError
    from llm_surgery.train.outputs import LOCK

    out = tmp_path / "run"
    first = run(_run_args(tiny_host_dir, out))
    before = {p: p.read_bytes() for p in (out / "results.json", out / "config.json", out / "metrics.jsonl")}
    assert {checkpoint_run_id(p) for p in list_checkpoints(out / "checkpoints")} == {first["run_id"]}
    with pytest.raises(UsageError, match=r"already holds a run.*--resume latest.*--overwrite"):
        run(_run_args(tiny_host_dir, out, "--lr", "0.5"))
    with pytest.raises(CheckpointError, match=r"settings differ.*batch_size: 4 -> 2; lr: 0.0003 -> 0.002"):
        run(_run_args(tiny_host_dir, out, "--resume", "latest", "--lr", "0.002", "--batch-size", "2"))
    assert {p: p.read_bytes() for p in before} == before  # nothing written by the refused runs
    assert not (out / LOCK).exists()  # released by the refused runs too

    again = run(_run_args(tiny_host_dir, out, "--overwrite", "--max-steps", "1"))
    assert again["run_id"] != first["run_id"] and again["steps"] == 1
    assert [checkpoint_run_id(p) for p in list_checkpoints(out / "checkpoints")] == [again["run_id"]]
    assert max(r["step"] for r in read_jsonl(out / "metrics.jsonl")) == 1  # the old log is gone, not appended to
    assert json.loads((out / "config.json").read_text())["max_steps"] == 1
    stray = out / "checkpoints" / "step-00000000"  # another run's checkpoint in the same folder
    stray.mkdir()
    (stray / "state.json").write_text(json.dumps({"run_id": "someone-else"}))
    with pytest.raises(CheckpointError, match=r"checkpoints of other runs \(someone-else\)"):
        run(_run_args(tiny_host_dir, out, "--resume", "latest", "--max-steps", "1"))


def test_resume_of_a_checkpoint_without_settings_is_refused(tmp_path, accelerator):
    from llm_surgery.train.outputs import check_resume

    with pytest.raises(CheckpointError, match="records no run settings"):
        check_resume({"step": 2, "world_size": 1}, TrainConfig(), 1, "no", tmp_path)
    saved = TrainConfig().resume_settings(1, "no")
    assert check_resume({"run_id": "abc", "settings": saved}, TrainConfig(log_every=3, output_dir="x"), 1, "no",
                        tmp_path) == "abc"  # logging and places may change
    with pytest.raises(CheckpointError, match=r"world_size: 1 -> 2"):
        check_resume({"run_id": "abc", "settings": saved}, TrainConfig(), 2, "no", tmp_path)
    # the precision in effect is what counts, wherever it was set (a flag, or Accelerate's config)
    with pytest.raises(CheckpointError, match=r"mixed_precision: 'no' -> 'bf16'"):
        check_resume({"run_id": "abc", "settings": saved}, TrainConfig(), 1, "bf16", tmp_path)
    assert check_resume({"run_id": "abc", "settings": TrainConfig(mixed_precision="bf16").resume_settings(1, "bf16")},
                        TrainConfig(), 1, "bf16", tmp_path) == "abc"


def test_lock_refuses_a_second_process_and_takes_over_a_stale_one(tmp_path, tiny_host_dir):
    from llm_surgery.train import run
    from llm_surgery.train.config import UsageError
    from llm_surgery.train.outputs import LOCK, acquire_lock, release_lock

    out = tmp_path / "run"
    out.mkdir()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (out / LOCK).write_text(json.dumps({"pid": other.pid, "host": __import__("socket").gethostname()}))
        with pytest.raises(UsageError, match=rf"in use by process {other.pid} on this host"):
            run(_run_args(tiny_host_dir, out))
        assert not (out / "config.json").exists()
        assert json.loads((out / LOCK).read_text())["pid"] == other.pid  # another process's lock is left alone
    finally:
        other.kill()
        other.wait()
    said = []
    lock = acquire_lock(out, log=said.append)  # that process is gone: a stale lock
    assert "stale lock" in said[0] and json.loads(lock.read_text())["pid"] == os.getpid()
    with pytest.raises(UsageError, match="in use by process"):
        acquire_lock(out)  # held by this process now
    release_lock(lock)
    assert not lock.exists()
    (out / LOCK).write_text(json.dumps({"pid": 1, "host": "elsewhere"}))
    with pytest.raises(UsageError, match="on host elsewhere"):
        acquire_lock(out)


def test_final_is_saved_before_evaluation(tmp_path, tiny_host_dir, monkeypatch):
    """An evaluation that fails loses no training: final/ is already written (and no results.json claims
    anything)."""
    from llm_surgery.train import run, trainer
    from llm_surgery.train.outputs import LOCK

    def broken(*args, **kwargs):
        raise RuntimeError("evaluation failed")
    monkeypatch.setattr(trainer, "evaluate", broken)
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="evaluation failed"):
        run(_run_args(tiny_host_dir, out, "--save-every", "0", "--no-eval-host"))
    assert (out / "final" / "inserted.safetensors").is_file() and (out / "final" / "inserted.json").is_file()
    assert not (out / "results.json").exists() and not (out / LOCK).exists()


def test_final_and_results_are_replaced_atomically(tmp_path, monkeypatch):
    """A save that fails half way leaves the previous final/ whole; JSON is written beside and renamed."""
    from types import SimpleNamespace

    import llm_surgery.insert
    from llm_surgery.train.artifact import save_final
    from llm_surgery.train.outputs import write_json

    final = tmp_path / "final"
    final.mkdir()
    (final / "inserted.safetensors").write_bytes(b"old weights")

    def dies_half_way(model, directory, full_state_dict=None):
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "inserted.safetensors").write_bytes(b"half")
        raise OSError("disk full")
    monkeypatch.setattr(llm_surgery.insert, "save_inserted", dies_half_way)
    acc = SimpleNamespace(distributed_type="NO", is_main_process=True, unwrap_model=lambda m: m,
                          wait_for_everyone=lambda: None)
    with pytest.raises(OSError, match="disk full"):
        save_final(acc, torch.nn.Linear(1, 1), final, TrainConfig())
    assert (final / "inserted.safetensors").read_bytes() == b"old weights"

    def writes(model, directory, full_state_dict=None):
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "inserted.safetensors").write_bytes(b"new weights")
    monkeypatch.setattr(llm_surgery.insert, "save_inserted", writes)
    save_final(acc, torch.nn.Linear(1, 1), final, TrainConfig())
    assert (final / "inserted.safetensors").read_bytes() == b"new weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]  # no temporary or set-aside directory left

    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("killed")))
    (tmp_path / "results.json").write_text('{"old": 1}')
    with pytest.raises(OSError, match="killed"):
        write_json(tmp_path / "results.json", {"new": 2})
    assert json.loads((tmp_path / "results.json").read_text()) == {"old": 1}
    monkeypatch.setattr(os, "replace", real_replace)
    write_json(tmp_path / "results.json", {"new": 2})
    assert json.loads((tmp_path / "results.json").read_text()) == {"new": 2}


@pytest.mark.parametrize("flags, stop, kept", [
    ([], 3, ["step-00000001", "step-00000002"]),  # checked every step: stops at the bad step itself
    # checked only at log records and checkpoints (no step waits for the host): the bad step 3 is found at step 4,
    # and step 4's checkpoint, which would hold its update, is not written
    (["--log-every", "4", "--save-every", "2"], 4, ["step-00000002"]),
])
def test_non_finite_loss_stops_the_run_keeping_the_last_good_checkpoint(tmp_path, tiny_host_dir, monkeypatch, capsys,
                                                                        flags, stop, kept):
    from safetensors.torch import load_file

    from llm_surgery.train import main, run, trainer

    real, calls = trainer.completion_loss_inputs, []

    def poisoned(model, batch, k=None):  # the third step's forward overflows
        logits, labels = real(model, batch, k)
        calls.append(1)
        return (logits * float("nan") if len(calls) == 3 else logits), labels
    monkeypatch.setattr(trainer, "completion_loss_inputs", poisoned)
    out = tmp_path / "run"
    with pytest.raises(trainer.TrainingDiverged, match=rf"step 3: .* not finite; the run stopped at step {stop}.*"
                                                       r"saved nothing from step 3 on.*step-00000002"):
        run(_run_args(tiny_host_dir, out, "--max-steps", "6", *flags))
    assert len(calls) == stop
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == kept
    if not flags:  # the command line: one line, exit status 1 (a usage error's is 2)
        calls.clear()
        with pytest.raises(SystemExit, match="^1$"):
            main(_run_args(tiny_host_dir, tmp_path / "again", "--max-steps", "6"), prog="x")
        err = capsys.readouterr().err.splitlines()  # (transformers' loading bar before it)
        assert err[-1].startswith("x: error: step 3: ") and sum("error:" in line for line in err) == 1, err
    for ckpt in list_checkpoints(out / "checkpoints"):
        assert all(torch.isfinite(t).all() for t in load_file(ckpt / "trainable.safetensors").values())
    assert not (out / "final").exists() and not (out / "results.json").exists()
    logged = [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert max(logged, default=0) < 3  # no record of the bad step or a later one


# ---------------------------------------------------------------- bad input: one clear error before work

@pytest.mark.parametrize("flags, message", [
    (["--lr", "nan"], "lr must be a finite number in (0, inf)"),
    (["--lr", "abc"], "argument --lr: invalid float value: 'abc'"),
    (["--lr", "0"], "lr must be a finite number in (0, inf)"),
    (["--adam-beta1", "2"], "adam_beta1 must be a finite number in [0, 1)"),
    (["--adam-beta2", "1"], "adam_beta2 must be a finite number in [0, 1)"),
    (["--max-grad-norm", "0"], "max_grad_norm must be a finite number in (0, inf) (none = no clipping)"),
    (["--lora-dropout", "1.5"], "lora_dropout must be a finite number in [0, 1)"),
    (["--kind", "mamba2", "--mixer-options", '{"dict_size": 4}'], "['dict_size'] are not options of the mamba2"),
    (["--max-eval-examples", "0"], "max_eval_examples must be >= 1 (or none)"),
    (["--resume", "latest", "--overwrite"], "pass one"),
    (["--kind", "pdssm+mamba2"], "kind 'pdssm+mamba2' lists 2 kinds for n=4 layers"),
    (["--kind", "pdssm+gru", "--n", "2"], "kind must be one of"),
    (["--kind", "pdssm+mamba2", "--n", "2", "--mixer-options", '{"dict_size": 4}'],
     "['dict_size'] are not options of the mamba2"),
])
def test_bad_trainer_flags_are_refused_at_parse_time(flags, message, capsys):
    with pytest.raises(SystemExit, match="^2$"):
        parse_config(flags, prog="train")
    err = capsys.readouterr().err
    assert message in err and err.startswith("train: error: ") and err.count("\n") == 1


def test_trainer_flags_that_parse():
    assert parse_config(["--max-grad-norm", "none"]).max_grad_norm is None  # no clipping, said explicitly
    assert parse_config(["--kind", "pdssm", "--mixer-options", '{"dict_size": 4, "num_heads": 2}']).mixer_kwargs() \
        == {"dict_size": 4, "num_heads": 2}


def test_mixed_insertion_puts_one_kind_before_each_attention_block(tmp_path, tiny_host_dir):
    """--kind with n kinds joined by '+': layer i is kind i, all train, and the saved layers record it."""
    from llm_surgery.train import run

    out = tmp_path / "run"
    res = run(_run_args(tiny_host_dir, out, "--kind", "mamba2+pdssm", "--n", "2", "--max-steps", "2",
                        "--save-every", "0", "--max-eval-examples", "4"))
    assert res["kind"] == "mamba2+pdssm" and res["n"] == 2
    metas = [json.loads(p.read_text()) for p in out.rglob("*.json") if '"layers"' in p.read_text()]
    kinds = {tuple(layer["kind"] for layer in m["layers"]) for m in metas}
    assert kinds == {("mamba2", "pdssm")}, kinds


def test_empty_evaluation_sets_and_cpu_float16_are_refused_before_work(tmp_path, tiny_host_dir):
    from llm_surgery.train import run
    from llm_surgery.train.config import UsageError

    out = tmp_path / "run"
    with pytest.raises(UsageError, match=r"--num-sequences 3 gives no validation examples"):
        run([*_run_args(tiny_host_dir, out), "--num-sequences", "3"])
    with pytest.raises(UsageError, match=r"--host-dtype float16 needs a CUDA device"):
        run([*_run_args(tiny_host_dir, out), "--host-dtype", "float16", "--cpu"])
    assert not (out / "config.json").exists() and not (out / "metrics.jsonl").exists()
    with pytest.raises(UsageError, match=r"surgery refused these settings .* n=3: this host has 2 attention blocks"):
        run([*_run_args(tiny_host_dir, out), "--n", "3"])  # known once the host is (its config: cheaply) loaded
    assert not (out / "metrics.jsonl").exists()


def test_messages_are_log_records_that_the_command_line_shows_on_stdout(monkeypatch, capsys, caplog):
    """The package logs through `llm_surgery.train` (a library does not print); a command line shows the lines on
    stdout as before, once, and leaves alone a program that configured logging itself."""
    import logging

    from llm_surgery.train.messages import logger, show_messages

    caplog.set_level("INFO", logger="llm_surgery.train")
    logger.info("a message")
    assert capsys.readouterr().out == "" and "a message" in caplog.text  # a library call prints nothing
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # a bare program: pytest's capture handler off
    monkeypatch.setattr(logger, "handlers", [])
    show_messages()
    show_messages()  # idempotent: one handler, one line per message
    logger.info("host x: 10 params")
    assert capsys.readouterr().out == "host x: 10 params\n"
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logging.getLogger(), "handlers", [logging.NullHandler()])  # configured by the program
    show_messages()
    assert logger.handlers == []


def test_a_message_during_the_progress_bar_gets_its_own_line():
    """stdout and stderr on one pipe (a terminal; `bench/startup.py`): a message logged while the training bar (stderr,
    no line end) is up starts its own line instead of being glued to the bar's."""
    script = (
        "from tqdm.auto import tqdm\n"
        "from llm_surgery.train.messages import logger, show_messages\n"
        "show_messages()\n"
        "bar = tqdm(total=3, desc='train pdssm')\n"
        "bar.update(1)\n"
        "logger.info('CUDA graphs: 2 of 2 batch shapes captured in 1.0 s')\n"
        "bar.update(2)\n"
        "bar.close()\n")
    out = subprocess.run([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"), check=True).stdout
    lines = [line.strip() for line in re.split(r"[\r\n]", out)]
    assert "CUDA graphs: 2 of 2 batch shapes captured in 1.0 s" in lines, out
    assert any(line.startswith("train pdssm: 100%") for line in lines), out  # the bar came back after the message


def test_cli_errors_are_one_line_with_status_2(tmp_path, capsys):
    from llm_surgery.train import main

    with pytest.raises(SystemExit, match="^2$"):
        main(["--model", str(tmp_path / "missing"), "--output-dir", str(tmp_path / "run")], prog="train")
    err = capsys.readouterr().err
    assert err == f"train: error: model path {tmp_path / 'missing'} does not exist\n"


def test_offline_recipe_without_a_local_model_says_so_in_one_line(tmp_path):
    """recipes/granite3b.py names a hub id; with no network and nothing cached it fails at once, in one line."""
    env = {**_env(), "HF_HOME": str(tmp_path / "hf"), "PYTHONPATH": str(REPO)}  # a script's folder is not the repo
    proc = subprocess.run([sys.executable, "recipes/granite3b.py", "--cpu", "--output-dir", str(tmp_path / "run")],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert errors == [line for line in errors if "ibm-granite/granite-4.0-h-micro" in line and
                      "--model /path/to/a/local/checkpoint" in line] and len(errors) == 1, proc.stderr
    assert not (tmp_path / "run" / "config.json").exists()


def test_unreachable_hub_is_one_line_without_retries(monkeypatch, tmp_path):
    from huggingface_hub import constants

    from llm_surgery.train.config import UsageError
    from llm_surgery.train.host import model_source

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))  # nothing cached
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: connection refused
    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    attempts = []
    connect = socket.create_connection
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: attempts.append(a[0]) or connect(*a, **k))
    with pytest.raises(UsageError, match=r"org/model is a hub id .* cannot be reached .*local/checkpoint"):
        model_source("org/model")
    assert attempts == [("127.0.0.1", 9)]   # one probe of the endpoint, no retries


def test_host_too_large_for_memory_is_refused_with_its_size(monkeypatch, tmp_path):
    """Granite 4.0 H Micro in float32 on a machine with 22 GiB free: refused before anything is built, with the
    size it needs (counted on the meta device)."""
    from llm_surgery.train import host, run
    from llm_surgery.train.config import UsageError

    params, desc = host.host_parameters(TrainConfig(random_init_config="granite-4.0-h-micro"))
    assert 3.1e9 < params < 3.3e9 and desc == "granite-4.0-h-micro"
    monkeypatch.setattr(host, "available_memory", lambda device: 22 * 2**30)
    with pytest.raises(UsageError, match=r"needs 11.9 GiB per process .*3.19B parameters x 4 bytes.*22.0 GiB"):
        run(["--random-init-config", "granite-4.0-h-micro", "--cpu", "--output-dir", str(tmp_path / "run")])
    host.check_memory(params, desc, torch.bfloat16, torch.device("cpu"))  # 5.9 GiB fits twice into 22
    with pytest.raises(UsageError, match="shared by 2 processes"):
        host.check_memory(params, desc, torch.bfloat16, torch.device("cpu"), processes_here=2)


def test_tokenizer_fallback_is_announced_and_refused_for_another_vocabulary(tmp_path, caplog):
    from llm_surgery.box_data import build_box_tokenizer
    from llm_surgery.hosts import build_tiny_host
    from llm_surgery.train.config import UsageError
    from llm_surgery.train.host import load_pretrained

    vocab = len(build_box_tokenizer())
    for name, size in (("box", vocab), ("other", vocab + 64)):
        build_tiny_host("granite", seed=0, hidden_size=32, vocab_size=size, pattern="M*",
                        mamba_chunk_size=64).save_pretrained(tmp_path / name)  # saved without a tokenizer
    caplog.set_level("INFO", logger="llm_surgery.train")
    _, tok = load_pretrained(str(tmp_path / "box"), torch.float32, torch.device("cpu"))
    assert len(tok) == vocab and "using the Box word tokenizer" in caplog.text
    with pytest.raises(UsageError, match=rf"no tokenizer that loads.*fits only a host with that vocabulary, and "
                                         rf"this one has {vocab + 64}"):
        load_pretrained(str(tmp_path / "other"), torch.float32, torch.device("cpu"))

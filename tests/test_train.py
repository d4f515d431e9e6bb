"""The trainer: config parsing, schedules, sampler, checkpoints (atomic, corrupt), plotting, the embedded default,
and a real 2-process gloo run through `accelerate launch` that is killed and resumed to the same losses."""

from __future__ import annotations

import json
import math
import os
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
from llm_surgery.train.schedule import build_scheduler, lr_factor

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
    with pytest.raises(SystemExit):
        parse_config(["--kind", "lstm"])
    assert "kind must be one of" in capsys.readouterr().err
    with pytest.raises(ValueError, match="positions"):
        TrainConfig(n=2, positions=[1])
    with pytest.raises(ValueError, match="mixer_options"):
        TrainConfig(mixer_options="[1, 2]")
    with pytest.raises(ValueError, match="unknown TrainConfig fields"):
        build_parser({"learning_rate": 1.0})


# ---------------------------------------------------------------- schedule

def test_schedule_shapes():
    total, warm = 100, 10
    const = [lr_factor(s, total, warm, "constant") for s in range(total)]
    assert const[0] == pytest.approx(0.1) and const[9] == 1.0 and all(v == 1.0 for v in const[10:])
    assert all(b > a for a, b in zip(const[:10], const[1:10]))  # linear warm-up
    cos = [lr_factor(s, total, warm, "cosine", 0.1) for s in range(total + 1)]
    assert cos[10] == pytest.approx(1.0) and cos[total] == pytest.approx(0.1)
    assert all(b <= a + 1e-12 for a, b in zip(cos[10:], cos[11:]))  # monotone decay to the floor
    assert cos[55] == pytest.approx(0.1 + 0.9 * 0.5, abs=1e-9)  # half way: mid-point of the cosine
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    sched = build_scheduler(opt, total, 0.1, "cosine")
    lrs = []
    for _ in range(total):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(1e-4) and max(lrs) == pytest.approx(1e-3) and lrs[-1] > 1e-4 - 1e-12
    with pytest.raises(ValueError, match="schedule"):
        lr_factor(50, total, warm, "linear")


# ---------------------------------------------------------------- data order

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


def test_cap_records_keeps_whole_sequences():
    recs = [{"sequence_id": s, "i": i} for s in "abc" for i in range(5)]
    assert len(cap_records(recs, 7)) == 10 and len(cap_records(recs, 3)) == 5 and len(cap_records(recs, None)) == 15


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
    from llm_surgery.train.plot import main as plot_main
    for name, acc in (("a", 0.9), ("b", 0.5)):
        d = tmp_path / name
        d.mkdir()
        by = {str(k): {"accuracy": acc / (1 + k), "num_examples": 7} for k in range(8)}
        (d / "results.json").write_text(json.dumps({"kind": name, "test": {"by_num_ops": by, "train_max_ops": 3}}))
    out = tmp_path / "cmp.png"
    plot_main([str(tmp_path / "a"), str(tmp_path / "b" / "results.json"), "-o", str(out)])
    assert out.stat().st_size > 5000 and out.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(FileNotFoundError, match="no results file"):
        plot_main([str(tmp_path / "missing")])


# ---------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def tiny_host_dir(tmp_path_factory):
    """A tiny Granite-4.0 host saved like a user's checkpoint, with the Box word tokenizer."""
    from llm_surgery.box_data import build_box_tokenizer
    from llm_surgery.hosts import build_tiny_host

    path = tmp_path_factory.mktemp("host")
    tok = build_box_tokenizer()
    build_tiny_host("granite", seed=0, hidden_size=32, vocab_size=len(tok), pattern="M*M*",
                    mamba_chunk_size=64).save_pretrained(path)
    tok.save_pretrained(path)
    return path


SMALL = ["--num-sequences", "20", "--batch-size", "4", "--max-eval-examples", "60", "--eval-batch-size", "32",
         "--log-every", "1", "--no-progress", "--no-plot", "--n", "2"]


def _env():
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false")
    env.pop("LLM_SURGERY_KILL_AT_STEP", None)
    return env


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
    assert "2 process(es), MULTI_CPU" in proc.stdout  # really two ranks on gloo, not two copies of one
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

    crashed = tmp_path / "crashed"
    proc = _launch([*common, "--output-dir", str(crashed)], {**_env(), "LLM_SURGERY_KILL_AT_STEP": "3"},
                   expect_ok=False)
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
    assert "2 process(es), FSDP" in proc.stdout
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

    proc = _launch([*common, "--output-dir", str(crashed)], {**_env(), "LLM_SURGERY_KILL_AT_STEP": "3"},
                   expect_ok=False, script=script)
    assert proc.returncode != 0
    assert [p.name for p in list_checkpoints(crashed / "checkpoints")] == ["step-00000002"]
    _launch([*common, "--output-dir", str(crashed), "--resume", "latest"], _env(), script=script)
    for step, loss in losses(crashed).items():
        assert abs(loss - losses(fsdp)[step]) <= 1e-6, step


def test_fsdp_without_gpus_is_a_clear_error():
    """Accelerate runs FSDP only on accelerators; on CPU it would quietly fall back to plain DDP."""
    from llm_surgery.train.trainer import make_accelerator
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
    res2 = run(args)
    assert (cached / "model.safetensors").stat().st_mtime_ns == stamp  # not pretrained again
    assert res2["test"]["accuracy"] == res["test"]["accuracy"]


PAPER = {"granite350m": (1e-3, "constant"), "granite1b": (1e-3, "constant"), "granite3b": (5e-4, "cosine"),
         "granite7b": (5e-4, "cosine"), "nemotronh9b": (1e-4, "cosine"), "nemotronh12b": (1e-4, "cosine"),
         "nemotronh30b": (1e-4, "cosine")}


@pytest.mark.parametrize("name", sorted(PAPER))
def test_recipes_carry_the_paper_settings(name):
    import runpy
    defaults = runpy.run_path(str(REPO / "recipes" / f"{name}.py"))["DEFAULTS"]  # __main__ guard: no training
    cfg = parse_config([], defaults=defaults)
    assert (cfg.lr, cfg.schedule) == PAPER[name]
    assert cfg.weight_decay == 0.1 and cfg.warmup_ratio == 0.1 and cfg.n == 4 and cfg.min_lr_ratio == 0.1
    assert (cfg.tau, cfg.tau_end) == (1.0, 0.1)  # the STE temperature annealed over the run
    assert cfg.model.count("/") == 1  # a hub id, replaceable by --model /local/path
    local = parse_config(["--model", "/data/ckpt", "--kind", "mamba2"], defaults=defaults)
    assert local.model == "/data/ckpt" and local.kind == "mamba2"


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
    res = run(["--model", str(tiny_host_dir), "--kind", "mamba2", "--lora-r", "4", "--max-steps", "3",
               "--lr", "1e-2", "--grad-accum", "2", "--output-dir", str(out), *SMALL])
    assert read_jsonl(out / "metrics.jsonl")[2]["epoch"] == pytest.approx(6 / (588 // 4))  # 2 micro-batches a step
    assert res["params"]["trainable"] > res["params"]["inserted"]  # LoRA weights train too
    saved = load_file(out / "final" / "lora.safetensors")
    assert saved and all("lora_" in k for k in saved)
    assert any(v.abs().sum() > 0 for k, v in saved.items() if "lora_B" in k)  # B starts at zero: it trained
    host = load_trained(AutoModelForCausalLM.from_pretrained(tiny_host_dir), out / "final")
    state = host.state_dict()
    for k, v in saved.items():
        torch.testing.assert_close(state[k], v)
    assert not any(p.requires_grad for p in host.parameters())


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


def test_only_trained_tensors_are_upcast_under_mixed_precision(tiny_host_dir):
    """Training and evaluate_run keep exactly the inserted layers in float32 under bf16 autocast (one helper)."""
    from types import SimpleNamespace

    from llm_surgery.insert import insert_layers, inserted_layers
    from llm_surgery.train.host import load_pretrained
    from llm_surgery.train.trainer import mark_trainable, upcast_trainable

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


@pytest.mark.slow
def test_multi_gpu_script_on_cpu(tmp_path):
    """bench/multi_gpu.py's logic with a tiny host and gloo: saved host, 1- then 2-process launches of the granite3b
    recipe, every rank's throughput in results.json and metrics.jsonl, one table row per launch."""
    out = tmp_path / "mg"
    proc = subprocess.run([sys.executable, "bench/multi_gpu.py", "--cpu", "--tiny", "--steps", "6", "--check-eval",
                           "--max-eval-examples", "40", "--out", str(out), "--", "--num-sequences", "20",
                           "--test-max-ops", "8", "--eval-batch-size", "64"],
                          env={**_env(), "PYTHONPATH": str(REPO)}, cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "multi_gpu.json").read_text())
    assert [r["num_processes"] for r in summary["runs"]] == [1, 2]
    two = summary["runs"][1]["throughput"]
    assert len(two["tokens_per_s_by_process"]) == 2 and all(v > 0 for v in two["tokens_per_s_by_process"])
    assert two["tokens_per_s_total"] == pytest.approx(sum(two["tokens_per_s_by_process"]))
    logged = [r["throughput"] for r in read_jsonl(out / "ddp-np2" / "metrics.jsonl") if "throughput" in r]
    assert logged == [two]
    rows = [line for line in (out / "multi_gpu.md").read_text().splitlines() if line[:4] in ("| 1 ", "| 2 ")]
    assert len(rows) == 2 and rows[0].split("|")[5].strip() == "100%"
    # the 2-process run's gathered metrics against this script's one-process evaluation of its saved layers
    [check] = summary["eval_checks"]
    assert check["num_processes"] == 2 and check["counts_equal"] and check["max_abs_accuracy_diff"] < 1e-12
    assert check["num_examples"][0] == check["num_examples"][1] > 0


def test_multi_gpu_timeout_kills_every_rank_and_reports_the_traceback(tmp_path):
    """A launch that outlives --timeout is killed with its whole process group (orphaned ranks had kept their GPU
    memory), and a failed launch reports the child's traceback, not the launcher's summary."""
    import importlib.util
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
    assert args.runs == [("ddp", 1), ("ddp", 2)]
    assert mg.parse_args(["--runs", "fsdp:8,ddp:1"]).runs == [("fsdp", 8), ("ddp", 1)]
    assert mg.parse_args(["--procs", "2,1"]).runs == [("ddp", 2), ("ddp", 1)]
    with pytest.raises(SystemExit, match="fsdp:1"):
        mg.parse_args(["--runs", "fsdp:1"])
    args.recipe = str(script)
    res = mg.launch(args, 1, tmp_path / "host", tmp_path / "np1")
    assert res["rc"] == "timeout"
    assert pidfile.is_file(), "the stand-in recipe did not start within the timeout"
    pid = int(pidfile.read_text())
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the launched process's child outlived the timeout")

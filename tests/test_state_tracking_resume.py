"""A state-tracking run paused at every step and resumed each time ends exactly where the uninterrupted run
ends; checkpoints of another configuration, damaged ones and finished runs are handled."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from llm_surgery.bench.state_tracking.__main__ import main as cli_main
from llm_surgery.bench.state_tracking.resume import latest
from llm_surgery.bench.state_tracking.train import cli_defaults, train
from llm_surgery.train.checkpoint import CheckpointError


def small(**kw):
    """Two complex Flash PD-SSM layers with the automaton preset (learned start state, decay gate), a curriculum,
    validation every 4 steps and a weight average: every piece of state a resume has to carry (the adaptive
    curriculum, whose threshold lets it grow here, draws its checks from the second generator)."""
    opts = dict(task="parity", steps=28, batch_size=8, d_model=16, eval_every=4, eval_lengths=(40, 64),
                eval_batch=8, ema_decay=0.9, seed=3, curriculum_mode="adaptive", curriculum_threshold=5.0,
                retries=0)   # one try (retries of unfit runs: test_state_tracking_bench.py)
    opts.update(kw)
    return cli_defaults("pdssm", mixer=dict(num_heads=2, state_size=4), **opts)


def final_weights(run_dir) -> dict:
    return {k: v for k, v in load_file(latest(run_dir) / "run.safetensors").items() if k.startswith("model.")}


def test_paused_at_every_step_resumes_exactly(tmp_path):
    cfg = small()
    straight = train(cfg, run_dir=tmp_path / "straight")
    assert "paused" not in straight and straight["steps_run"] == cfg.steps
    calls, out = 0, {"paused": True}
    while out.get("paused"):
        out = train(cfg, run_dir=tmp_path / "paused", deadline=0.0)  # a deadline long past: one step per call
        calls += 1
        assert calls <= cfg.steps + 1
    assert calls == out["steps_run"] > 1  # paused after every step but the last
    for key in ("steps_run", "acc", "acc_selected", "val_curve", "val_best_step", "train_loss", "train_max_len"):
        assert out[key] == straight[key], key
    a, b = final_weights(tmp_path / "straight"), final_weights(tmp_path / "paused")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_retry_pauses_and_resumes_like_a_first_try(tmp_path):
    """With retries, the paused calls walk through the first try and then the retry (in <run_dir>-attempt1) and
    end where the uninterrupted pair of tries ends."""
    cfg = small(steps=8, retries=1, retry_loss=1e-9, stop_acc=2.0)   # 8 steps never fit: always one retry
    straight = train(cfg, run_dir=tmp_path / "straight")
    assert straight["config"]["attempt"] == 1 and len(straight["earlier_attempts"]) == 1
    out, calls = {"paused": True}, 0
    while out.get("paused"):
        out = train(cfg, run_dir=tmp_path / "paused", deadline=0.0)
        calls += 1
        assert calls <= 2 * cfg.steps + 2
    assert calls > cfg.steps and (tmp_path / "paused-attempt1").is_dir()
    for key in ("acc", "acc_selected", "val_curve", "train_loss", "earlier_attempts"):
        assert out[key] == straight[key], key


def test_finished_run_is_returned_not_retrained(tmp_path):
    cfg = small(steps=4)
    first = train(cfg, run_dir=tmp_path)
    (tmp_path / "result.json").write_text(json.dumps({**first, "acc_mean": -1.0}))  # a marker: not recomputed
    assert train(cfg, run_dir=tmp_path)["acc_mean"] == -1.0


def test_other_configuration_is_refused(tmp_path):
    train(small(), run_dir=tmp_path, deadline=0.0)
    with pytest.raises(CheckpointError, match="lr: 0.002 there, 0.001 now"):
        train(small(lr=1e-3), run_dir=tmp_path)
    with pytest.raises(ValueError, match="restarts == 1"):
        train(small(restarts=2), run_dir=tmp_path)


def test_damaged_checkpoints_are_named(tmp_path):
    train(small(), run_dir=tmp_path, deadline=0.0)
    ckpt = latest(tmp_path)
    data = (ckpt / "run.safetensors").read_bytes()
    (ckpt / "run.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt"):
        train(small(), run_dir=tmp_path)
    (ckpt / "state.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete: missing state.json"):
        train(small(), run_dir=tmp_path)


def test_cli_pauses_and_continues(tmp_path, capsys):
    args = ["--task", "parity", "--seeds", "1", "--steps", "6", "--batch-size", "8", "--d-model", "16",
            "--eval-every", "2", "--eval-lengths", "40,64", "--eval-batch", "8", "--mixer",
            '{"num_heads": 2, "state_size": 4}', "--checkpoint-dir", str(tmp_path / "ck"),
            "--out", str(tmp_path / "r.jsonl")]
    assert cli_main(args + ["--pause-after", "0"]) == 3
    assert "paused at step 1" in capsys.readouterr().out
    assert not (tmp_path / "r.jsonl").exists()
    assert cli_main(args) == 0
    rows = [json.loads(line) for line in Path(tmp_path / "r.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["steps_run"] == 6
    assert (tmp_path / "ck" / "pdssm-parity-seed0" / "result.json").is_file()

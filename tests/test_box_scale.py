"""bench/box_scale.py: the Box reproduction staged over device calls. The whole flow at tiny size on the CPU (host
pretrained in 2 calls, the second resuming the first's checkpoint; 2 kinds x 2 seeds in 2 calls; summarize), the
27 M preset's checkpoint within the transfer limits, refusals, and the pretraining loop's resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import box_scale  # noqa: E402


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(REPO))
    env.pop("OUT", None)
    # each call its own process, as on the device (Accelerate fixes device and precision once per process)
    return subprocess.run([sys.executable, "bench/box_scale.py", *args, "--scale", "tiny", "--threads", "1",
                           "--device", "cpu"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
def test_staged_flow_pretrain_in_two_calls_finetune_two_kinds_two_seeds_summarize(tmp_path):
    from safetensors.torch import load_file

    _ok(_run("pretrain", "--out", str(tmp_path / "call1"), "--stop-at", "4"))
    first = json.loads((tmp_path / "call1" / "host" / "state.json").read_text())
    assert first["step"] == 4 and len(first["calls"]) == 1
    _ok(_run("pretrain", "--out", str(tmp_path / "call2"), "--resume", str(tmp_path / "call1" / "host")))
    host = tmp_path / "call2" / "host"
    state = json.loads((host / "state.json").read_text())
    assert state["step"] == state["spec"]["host_steps"] == 8
    assert [c["step"] for c in state["curve"]] == [4, 8] and len(state["calls"]) == 2
    before, after = load_file(tmp_path / "call1" / "host" / "weights-00.safetensors"), load_file(
        host / "weights-00.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the second call trained on
    # a finished host is not pretrained again
    done = _run("pretrain", "--out", str(tmp_path / "call3"), "--resume", str(host))
    assert done.returncode == 2 and "is done (8/8 steps)" in done.stderr

    for kind in ("pdssm", "mamba2"):
        _ok(_run("finetune", "--host", str(host), "--kinds", kind, "--seeds", "0,1",
                 "--out", str(tmp_path / "results"), "--work", str(tmp_path / f"work-{kind}")))
        res = json.loads((tmp_path / "results" / f"finetune-{kind}-s0-1.json").read_text())
        assert res["host"]["fingerprint"] == state["fingerprint"]
        assert [(r["kind"], r["seed"]) for r in res["runs"]] == [(kind, 0), (kind, 1)]
        assert res["runs"][0]["host_alone"] is not None and res["runs"][1]["host_alone"] is None
        assert res["recipe"]["lr"] == 1e-3 and res["recipe"]["weight_decay"] == 0.1  # granite350m's
        assert res["recipe"]["warmup_ratio"] == 0.1 and res["recipe"]["n"] == 4
        assert all(r["params"]["inserted"] > 0 for r in res["runs"])  # layers were inserted and trained

    # a variant of the recipe (--set), recorded per run and listed apart by summarize
    _ok(_run("finetune", "--host", str(host), "--kinds", "pdssm", "--seeds", "0", "--set", '{"lr": 0.003}',
             "--tag", "lr", "--out", str(tmp_path / "results"), "--work", str(tmp_path / "work-lr")))
    res = json.loads((tmp_path / "results" / "finetune-pdssm-s0-lr.json").read_text())
    assert res["set"] == {"lr": 0.003} and res["runs"][0]["set"] == {"lr": 0.003}
    assert json.loads((tmp_path / "work-lr" / "pdssm-s0" / "config.json").read_text())["lr"] == 0.003

    _ok(_run("summarize", str(tmp_path / "results"), "--out", str(tmp_path / "summary")))
    summary = json.loads((tmp_path / "summary" / "summary.json").read_text())
    assert [(r["label"], r["seeds"]) for r in summary["rows"]] == [("host alone", 1), ("+ 4 pdssm", 2),
                                                                  ('+ 4 pdssm {"lr": 0.003}', 1),
                                                                  ("+ 4 mamba2", 2)]
    for row in summary["rows"]:
        for key in ("iid_accuracy", "ood_accuracy", "iid_state_accuracy", "ood_state_accuracy"):
            mean, spread = row[key]
            assert 0 <= mean <= 100 and spread >= 0
    assert all(sorted(map(int, c["test"]["by_num_ops"])) == list(range(9)) for c in summary["curves"])
    table = (tmp_path / "summary" / "summary.md").read_text()
    assert "| + 4 mamba2 | 2 |" in table and "| host alone | 1 |" in table
    assert (tmp_path / "summary" / "accuracy.png").read_bytes()[:4] == b"\x89PNG"


def test_27m_checkpoint_fits_the_transfer_limits_and_round_trips(tmp_path):
    spec = box_scale.SCALES["27m"]
    model, _ = box_scale.build(spec)
    n = sum(p.numel() for p in model.parameters())
    assert 25e6 < n < 28e6
    box_scale.save_host(tmp_path / "host", model, {"spec": spec, "step": 0})
    files = sorted((tmp_path / "host").iterdir())
    assert len(files) <= 6  # + the call's log: at most 8 files come back from $OUT
    assert all(f.stat().st_size <= 16 * 2**20 for f in files)
    assert sum(f.stat().st_size for f in files) <= box_scale.TRANSPORT_MIB * 2**20
    loaded, _, state = box_scale.load_host(tmp_path / "host", spec)
    assert state["shards"] == len(files) - 1
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a.to(torch.bfloat16).float(), b), name


def test_resume_refuses_a_checkpoint_of_other_settings_and_an_incomplete_one(tmp_path, capsys):
    spec = box_scale.SCALES["tiny"]
    model, _ = box_scale.build(spec)
    box_scale.save_host(tmp_path / "host", model, {"spec": spec, "step": 2})
    with pytest.raises(SystemExit, match="^2$"):
        box_scale.load_host(tmp_path / "host", {**spec, "hidden": 64})
    assert "hidden: 32 there, 64 here" in capsys.readouterr().err
    (tmp_path / "host" / "weights-00.safetensors").unlink()
    with pytest.raises(SystemExit, match="^2$"):
        box_scale.load_host(tmp_path / "host", spec)
    assert "incomplete: missing weights-00.safetensors" in capsys.readouterr().err


def test_a_host_too_big_to_cross_calls_is_refused_before_training(tmp_path):
    proc = subprocess.run([sys.executable, "bench/box_scale.py", "pretrain", "--hidden", "768", "--heads", "12",
                           "--kv-heads", "4", "--device", "cpu", "--out", str(tmp_path)], cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "over the 56 MiB that can cross device calls" in proc.stderr
    assert not (tmp_path / "host").exists()


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))

    def forward(self, x, use_cache=False):
        return SimpleNamespace(loss=(self.w * x).pow(2).sum())


def test_pretraining_loop_resumes_its_schedule_with_a_rewarm(monkeypatch):
    from llm_surgery.train.host import train_all_weights

    lrs = []
    step = torch.optim.AdamW.step

    def record(self, *a, **k):
        lrs.append(self.param_groups[0]["lr"])
        return step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", record)
    batches = iter(lambda: {"x": torch.ones(3)}, None)
    train_all_weights(_Tiny(), batches, steps=10, lr=1.0, log=lambda m: None)
    full, lrs[:] = list(lrs), []
    train_all_weights(_Tiny(), batches, steps=10, lr=1.0, start=6, rewarm_steps=2, log=lambda m: None)
    assert lrs == pytest.approx([full[6] / 2, full[7], full[8], full[9]])
    with pytest.raises(ValueError, match="start must be in"):
        train_all_weights(_Tiny(), batches, steps=10, lr=1.0, start=10)


def test_summarize_refuses_results_of_different_hosts_and_an_empty_folder(tmp_path, capsys):
    for i, fingerprint in enumerate(("aaaa", "bbbb")):
        (tmp_path / f"finetune-pdssm-s{i}.json").write_text(json.dumps({"host": {"fingerprint": fingerprint},
                                                                        "runs": []}))
    with pytest.raises(SystemExit, match="^2$"):
        box_scale.main(["summarize", str(tmp_path), "--out", str(tmp_path / "summary")])
    assert "2 different hosts (aaaa, bbbb)" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="^2$"):
        box_scale.main(["summarize", str(tmp_path / "empty"), "--out", str(tmp_path / "summary")])
    assert "no finetune-*.json results in" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="^2$"):
        box_scale.load_host(tmp_path)  # a folder that is no checkpoint
    assert "is not a box_scale host checkpoint (no state.json)" in capsys.readouterr().err


def test_language_host_learns_every_token_of_documents_without_queries_and_resumes_its_order():
    from llm_surgery.train import make_host

    tok = box_scale.build(box_scale.SCALES["tiny"], "meta")[1]
    spec = {**box_scale.SCALES["tiny"], "host_data": "language", "host_sequences": 30}
    batches, what = box_scale.host_batches(spec, tok, 0)
    first = [next(batches) for _ in range(4)]
    assert "no queries" in what
    for b in first:  # the loss on every real token, each document closed by EOS
        assert torch.equal(b["labels"] != -100, b["attention_mask"] == 1)
        ends = b["attention_mask"].sum(1) - 1
        assert (b["input_ids"][torch.arange(len(ends)), ends] == tok.eos_token_id).all()
    resumed = next(box_scale.host_batches(spec, tok, 3)[0])  # a resumed call goes on with the 4th batch
    assert torch.equal(resumed["input_ids"], first[3]["input_ids"])
    docs, _ = make_host.language_documents(30, doc_seed=1, seed=0)
    assert all(d.endswith(".") for d in docs)  # no document ends in a query ("... . Box 3", then the answer)
    task, what = box_scale.host_batches({**box_scale.SCALES["tiny"], "host_sequences": 30}, tok, 0)
    b = next(task)  # the task host: the loss on the answers only
    assert "answers" in what and (b["labels"] != -100).sum() < (b["attention_mask"] == 1).sum()


@pytest.mark.parametrize("value, message", [('{"nope": 1}', "--set names no trainer setting: nope"),
                                            ("[1]", "--set must be a JSON object")])
def test_finetune_settings_are_refused_before_work(value, message, capsys):
    with pytest.raises(SystemExit, match="^2$"):
        box_scale.parse_args(["finetune", "--host", "x", "--set", value])
    assert message in capsys.readouterr().err

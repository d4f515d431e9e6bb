"""bench/state_tracking_gpu.py: the plan of the one-call GPU run (Table 1 and the one-layer group problems) and its time limits."""

import importlib.util
import json
from pathlib import Path

import pytest

from llm_surgery.bench.state_tracking.resume import config_dict, run_dir_name

_PATH = Path(__file__).resolve().parents[1] / "bench" / "state_tracking_gpu.py"
spec = importlib.util.spec_from_file_location("state_tracking_gpu", _PATH)
gpu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu)


def test_plan_covers_both_issues_with_the_cli_defaults():
    cfgs = gpu.plan(gpu.parse_args(["--device", "cpu"]))
    key = {(c.kind, c.task, c.n_layers) for c in cfgs}
    for kind in ("pdssm", "mamba2", "deltanet"):
        assert all((kind, t, 2) in key for t in gpu.TABLE1_TASKS)
        assert all((kind, t, 1) in key for t in gpu.GROUP_TASKS)
    g = [c for c in cfgs if c.kind == "pdssm" and c.task in gpu.GROUP_TASKS]
    assert len(g) == 20 and all(c.n_layers == 1 for c in g)
    default = gpu.cli_defaults("pdssm", n_layers=1)
    # the one-layer preset, with the task's recipe over it (sizes; the element tasks' dictionary init)
    assert all(c.mixer == {**default.mixer, **gpu.ONE_LAYER_RECIPES[c.task]["mixer"]} and c.restarts == default.restarts
               for c in g)
    assert all(c.d_model == 128 and c.batch_size == 256 and c.lr == 2e-3 for c in cfgs if c.n_layers == 2)
    t1 = [c.mixer for c in cfgs if c.kind == "pdssm" and c.n_layers == 2]  # the default preset's seeds first
    assert t1[:2 * len(gpu.TABLE1_TASKS)] == [gpu.PDSSM_PRESETS["automaton"]] * 2 * len(gpu.TABLE1_TASKS)
    assert {} in t1 and gpu.PDSSM_PRESETS["robust"] in t1  # the other presets, for comparison


def test_plan_of_named_variants():
    args = gpu.parse_args(["--device", "cpu", "--t1-pdssm-seeds", "0", "--t1-presets", "", "--t1-other-seeds", "0",
                           "--g-pdssm-seeds", "0", "--g-other-seeds", "0", "--t1-variants", "snap+q10+conv1",
                           "--t1-variant-seeds", "2", "--t1-variant-seed-start", "3"])
    cfgs = gpu.plan(args)
    assert len(cfgs) == 2 * len(gpu.TABLE1_TASKS) and {c.seed for c in cfgs} == {3, 4}
    assert all(c.name == "snap+q10+conv1" and c.mixer["phase_levels"] == 10 and c.mixer["conv_kernel"] == 1
               for c in cfgs)
    # a variant is its own options over the layer defaults, not over the CLI default of the day
    for name in ("snap+q60+conv1", "tracking+eps1e-6", "tracking+decay+eps1e-6"):
        args = gpu.parse_args(["--device", "cpu", "--t1-pdssm-seeds", "0", "--t1-presets", "", "--t1-other-seeds",
                               "0", "--g-pdssm-seeds", "0", "--g-other-seeds", "0", "--t1-variants", name])
        c = gpu.plan(args)[0]
        assert c.mixer == gpu.VARIANTS[name]["mixer"] and c.adam_eps == gpu.VARIANTS[name].get("adam_eps", 1e-8)
    automaton = gpu.cli_defaults("pdssm", n_layers=2)  # the named form of the automaton preset matches it
    assert c.mixer == automaton.mixer and c.adam_eps == automaton.adam_eps
    with pytest.raises(SystemExit, match="unknown variant"):
        gpu.plan(gpu.parse_args(["--device", "cpu", "--t1-variants", "nope"]))


@pytest.mark.parametrize("runs,jobs", [(48, 16), (48, 24), (10, 16)])
def test_time_limits_fit_the_budget(runs, jobs):
    cfgs = gpu.plan(gpu.parse_args(["--device", "cpu"]))[:runs]
    limited = gpu.with_time_limits(cfgs, 540.0, jobs, reserve=80.0)
    waves = -(-len(cfgs) // jobs)
    for c in limited:
        assert c.time_limit_s * (1 + (c.restarts - 1) * c.restart_frac) * waves <= 460.0 + 1e-6


def test_summary_tables(tmp_path):
    rows = []
    for kind in ("pdssm", "deltanet"):
        for task in gpu.TABLE1_TASKS:
            rows.append({"kind": kind, "task": task, "seed": 0, "acc_mean": 0.5, "acc_max_len": 0.5,
                         "train_loss": 0.1, "steps_run": 10,
                         "config": {"n_layers": 2, "mixer": gpu.cli_defaults(kind, n_layers=2).mixer,
                                    "adam_eps": gpu.cli_defaults(kind, n_layers=2).adam_eps}})
    rows.append({"kind": "pdssm", "task": "s3", "seed": 0, "acc_mean": 1.0, "acc_max_len": 1.0, "train_loss": 0.0,
                 "steps_run": 10, "config": {"n_layers": 1, "mixer": dict(gpu.PDSSM_PRESETS["robust"])}})
    rows.append({**rows[0], "config": {"n_layers": 2, "mixer": dict(gpu.PDSSM_PRESETS["robust"])}})
    text = gpu.summarize(rows)
    assert "| pdssm | 50.0 ± 0.0 | 50.0 ± 0.0 | 50.0 ± 0.0 | 50.0 ± 0.0 | 50.0 | 1 | 10-10 |" in text
    assert "| s3 | pdssm | 1 of 1 | 100.0 |" in text and "mamba2" not in text
    assert "| pdssm (robust preset) | 50.0 ± 0.0 | — |" in text
    assert gpu.model_name({**rows[0], "config": {"n_layers": 2, "mixer": {}}}) == "pdssm (layer preset)"
    assert gpu.model_name({**rows[0], "config": {"n_layers": 2, "mixer": {}, "name": "snap"}}) == "pdssm (snap)"
    # a row of an earlier sweep: the automaton preset's mixer options without its Adam epsilon, or the tracking
    # options alone (the earlier default), is not the default
    automaton = dict(gpu.PDSSM_PRESETS["automaton"])
    assert gpu.model_name({**rows[0], "config": {"n_layers": 2, "mixer": automaton}}) == "pdssm (tracking preset)"
    tracking = dict(gpu.PDSSM_PRESETS["tracking"])
    assert gpu.model_name({**rows[0], "config": {"n_layers": 2, "mixer": tracking}}) == "pdssm (tracking preset)"
    assert "selected by validation" not in text
    rows[0] = {**rows[0], "acc_selected_mean": 0.9}  # one run validated: a second table with that run only
    text = gpu.summarize(rows)
    assert "selected by validation" in text and "| pdssm | 90.0 ± 0.0 | — | — | — | — | 1 | 10-10 |" in text
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    assert gpu.main(["--summarize", str(path)]) == 0


def test_retries_of_unfit_runs_and_summaries_of_the_last_tries(tmp_path):
    """--retry-unfit plans the next try of the unfit runs only (needs_retry); a summary keeps each run's last try."""
    def row(task, seed, loss, acc, attempt=0):
        cfg = gpu.cli_defaults("pdssm", task=task, seed=seed, n_layers=2, eval_every=500, attempt=attempt,
                               retries=attempt, time_limit_s=900.0)
        return {"kind": "pdssm", "task": task, "seed": seed, "acc_mean": acc, "acc_max_len": acc, "train_loss": loss,
                "val_best": acc, "steps_run": 10, "config": config_dict(cfg)}
    rows = [row(t, 0, 1e-6, 1.0) for t in gpu.TABLE1_TASKS] + [row("parity", 1, 0.6, 0.5), row("parity", 2, 1e-5, 0.9)]
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    (retry,) = gpu.retries_of(str(path), 1e-3, "cpu")
    assert (retry.task, retry.seed, retry.attempt, retry.retries) == ("parity", 1, 1, 1)
    unfit = rows[-2]["config"]
    assert retry.mixer == unfit["mixer"] and retry.eval_lengths == tuple(unfit["eval_lengths"])
    assert run_dir_name(retry) == "pdssm-parity-seed1-attempt1"
    assert gpu.retries_of(str(path), 1.0, "cpu") == []
    text = gpu.summarize(rows + [row("parity", 1, 1e-6, 1.0, attempt=1)])
    assert "1 results are retries" in text
    assert "| pdssm | 100.0 ± 0.0 | 100.0 ± 0.0 | 100.0 ± 0.0 | 96.7 ± 3.3 | 99.2 | 3 |" in text


def test_start_mps_falls_back_and_restores_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.delenv("CUDA_MPS_LOG_DIRECTORY", raising=False)
    monkeypatch.setattr(gpu.shutil, "which", lambda name: None)
    assert gpu.start_mps() is False
    # a daemon that starts, but a CUDA client that cannot (this machine has no GPU): quit it, restore the env
    log = tmp_path / "calls"
    fake = tmp_path / "nvidia-cuda-mps-control"
    fake.write_text(f"#!/bin/sh\necho \"$@\" $(cat) >> {log}\n")
    fake.chmod(0o755)
    monkeypatch.setattr(gpu.shutil, "which", lambda name: str(fake))
    monkeypatch.setattr(gpu.sys, "executable", "false")
    assert gpu.start_mps() is False
    assert log.read_text().split("\n")[:2] == ["-d", "quit"]
    assert "CUDA_MPS_PIPE_DIRECTORY" not in gpu.os.environ and "CUDA_MPS_LOG_DIRECTORY" not in gpu.os.environ


def test_plot_of_accuracy_against_length(tmp_path):
    rows = [{"kind": "pdssm", "task": t, "seed": 0, "acc": {"40": 1.0, "256": 0.5},
             "config": {"n_layers": 2, "mixer": {}, "name": "snap"}} for t in gpu.TABLE1_TASKS]
    out = tmp_path / "len.png"
    gpu.plot_lengths(rows, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def test_plot_of_validation_against_step(tmp_path):
    rows = [{"kind": "pdssm", "task": t, "seed": s, "val_curve": [[500, 0.5], [1000, 0.9 - 0.1 * s]],
             "config": {"n_layers": 2, "mixer": {}, "name": "snap"}} for t in gpu.TABLE1_TASKS for s in (0, 1)]
    rows.append({**rows[0], "val_curve": None})  # a run without validation is left out
    out = tmp_path / "val.png"
    gpu.plot_validation(rows, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def test_a_sweep_longer_than_one_call_pauses_and_continues(tmp_path, capsys):
    """--checkpoint-dir + --pause-after: the first call pauses every run (exit status 3, nothing reported); the
    same command continues them to their fixed --run-time and reports all; a third call reports them again."""
    argv = ["--quick", "--device", "cpu", "--jobs", "1", "--t1-pdssm-seeds", "1", "--t1-presets", "",
            "--t1-other-seeds", "0", "--g-pdssm-seeds", "0", "--g-other-seeds", "0", "--val-every", "2",
            "--run-time", "1.5", "--checkpoint-dir", str(tmp_path / "ck")]
    first = tmp_path / "first.jsonl"
    assert gpu.main(argv + ["--pause-after", "0", "--out", str(first)]) == 3
    assert capsys.readouterr().out.count("paused at step 1 ") == len(gpu.TABLE1_TASKS) and not first.exists()
    for name in ("second", "third"):
        assert gpu.main(argv + ["--out", str(tmp_path / f"{name}.jsonl")]) == 0
        rows = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        assert sorted(r["task"] for r in rows) == sorted(gpu.TABLE1_TASKS)
        assert all(r["train_seconds"] >= 1.5 and r["config"]["time_limit_s"] == 1.5 for r in rows)
    assert (tmp_path / "second.jsonl").read_text() == (tmp_path / "third.jsonl").read_text()
    with pytest.raises(SystemExit, match="needs --checkpoint-dir"):
        gpu.main(["--pause-after", "5"])


@pytest.mark.slow
def test_the_protocol_end_to_end_for_every_kind_across_calls(tmp_path, capsys):
    """--protocol --quick: the learning-rate search, then the reported seeds at the chosen rates, for pdssm, mamba2
    and deltanet on one Table 1 and one group task; the first call pauses in the search (exit status 3), the same
    command finishes it. Every kind's runs share every setting but the mixer (and the rate the search chose)."""
    argv = ["--protocol", "table1,groups", "--protocol-tasks", "parity,s3_gen", "--protocol-seeds", "2", "--quick",
            "--device", "cpu", "--jobs", "2", "--checkpoint-dir", str(tmp_path / "ck")]
    assert gpu.main(argv + ["--pause-after", "0", "--out", str(tmp_path / "first.jsonl")]) == 3
    assert "learning-rate search done" not in capsys.readouterr().out
    out = tmp_path / "second.jsonl"
    assert gpu.main(argv + ["--out", str(out)]) == 0
    text = capsys.readouterr().out
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    search = [r for r in rows if r["config"]["name"].startswith("search-")]
    final = [r for r in rows if r["config"]["name"] == "protocol"]
    assert len(search) == 3 * 2 * len(gpu.protocol.LR_GRID) * len(gpu.protocol.SEARCH_SEEDS)
    assert sorted((r["kind"], r["task"], r["seed"]) for r in final) == sorted(
        (k, t, s) for k in gpu.protocol.KINDS for t in ("parity", "s3_gen") for s in (0, 1))
    chosen = gpu.protocol.select_lr(search)
    for task in ("parity", "s3_gen"):
        for group in (search, final):
            configs = [{k: v for k, v in r["config"].items() if k not in ("kind", "mixer", "lr", "seed", "name")}
                       for r in group if r["task"] == task]
            assert all(c == configs[0] for c in configs)
        assert all(r["config"]["lr"] == chosen[(r["kind"], task)] and "acc_selected_mean" in r
                   for r in final if r["task"] == task)
    table = text[text.index("Table 1 under one protocol"):]
    for kind in gpu.protocol.KINDS:
        assert f"\n| {kind} | — | — | — | " in table and f"\n| s3_gen | {kind} | " in table
    assert "| 2 | 32-32 |" in table and "sweep" not in table and "final weights" not in table
    with pytest.raises(SystemExit, match="fixes steps"):
        gpu.main(argv + ["--run-time", "10"])
    with pytest.raises(SystemExit, match="--protocol-tasks must name"):
        gpu.main(["--protocol", "groups", "--protocol-tasks", "parity", "--dry-run"])


def test_runs_spread_over_gpus_round_robin(capsys):
    cfgs = gpu.spread(gpu.protocol.search_configs(gpu.protocol.KINDS, ["parity"], device="cuda"), 4)
    assert [c.device for c in cfgs[:5]] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3", "cuda:0"]
    assert gpu.spread(cfgs, 1) == cfgs
    assert gpu.main(["--protocol", "table1", "--gpus", "4", "--jobs", "80", "--dry-run"]) == 0
    assert "72 runs, 80 jobs, 1 waves" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="needs --device cuda"):
        gpu.main(["--protocol", "table1", "--gpus", "2", "--device", "cpu", "--dry-run"])


def test_protocol_kinds_limits_the_plan_to_those_kinds(capsys):
    """--protocol-kinds pdssm: only pdssm's search runs (the other kinds' rows of an earlier run stay valid);
    an unknown kind is refused before any work."""
    argv = ["--protocol", "groups", "--protocol-tasks", "s3", "--device", "cpu", "--dry-run"]
    assert gpu.main(argv + ["--protocol-kinds", "pdssm"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines()[1:] if ln.strip()]
    assert len(lines) == len(gpu.protocol.LR_GRID) * len(gpu.protocol.SEARCH_SEEDS)
    assert all(ln.startswith("pdssm s3 ") for ln in lines)
    assert gpu.main(argv) == 0
    assert {ln.split()[0] for ln in capsys.readouterr().out.splitlines()[1:] if ln.strip()} == set(gpu.protocol.KINDS)
    with pytest.raises(SystemExit, match="--protocol-kinds must name kinds"):
        gpu.main(argv + ["--protocol-kinds", "pdssm,lstm"])

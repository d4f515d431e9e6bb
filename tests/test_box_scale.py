"""bench/box_scale.py: Box at scale in one device lease. The whole flow at tiny size on the CPU (pretraining, the
smoke runs, the sweep, the seeds at the best rate, the ablations, the rows), the 128 M host's shape, the rows of an
older summary, the table and plot over host sizes, and the pace rule that drops sweep points, never seeds."""

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

SUMMARY_27M = REPO / "docs/bench/data/box_scale_27m_language_host_exact_init_h100_2026-11-27/summary.md"


@pytest.mark.slow
def test_tiny_flow_sweeps_then_runs_the_seeds_at_the_best_rate_and_ablates_them(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "bench/box_scale.py", "run", "--scale", "tiny", "--kinds", "pdssm,mamba2",
                           "--device", "cpu", "--out", str(tmp_path)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "smoke runs of pdssm, mamba2 passed" in proc.stdout
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    host = json.loads((tmp_path / "host.json").read_text())
    assert host["steps"] == box_scale.SCALES["tiny"]["host_steps"] and len(host["curve"]) >= 1
    assert all(r["host_params"] == host["params"] for r in rows)
    for kind in ("pdssm", "mamba2"):
        sweep = [r for r in rows if r["kind"] == kind and r.get("stage") == "sweep" and r["eval"] == "as trained"]
        assert sorted(r["lr"] for r in sweep) == sorted(box_scale.LR_GRID[kind]) and {r["seed"] for r in sweep} == {0}
        best = next(r for r in rows if r["kind"] == kind and r["eval"] == "best lr")
        assert best["lr"] == max(sweep, key=lambda r: (r["validation"], -box_scale.LR_GRID[kind].index(r["lr"])))["lr"]
        seeds = [r for r in rows if r["kind"] == kind and r["eval"] == "as trained" and r["lr"] == best["lr"]]
        assert sorted(r["seed"] for r in seeds) == [0, 1]  # the sweep's run at the best rate is seed 0
        alone = [r for r in rows if r["kind"] == kind and r["eval"] == "tokens alone"]
        assert [(r["seed"], r["lr"]) for r in alone] == [(0, best["lr"])]
        for r in seeds + alone:
            assert len(r["curve"]) == box_scale.SCALES["tiny"]["test_max_ops"] + 1
            assert 0 <= r["iid"] <= 100 and 0 <= r["ood"] <= 100 and set(r["whole_state"]) == {"iid", "ood"}
    assert [r["eval"] for r in rows if r["kind"] == "host"] == ["host alone"]  # once
    best = next(r["lr"] for r in rows if r["kind"] == "pdssm" and r["eval"] == "best lr")
    settings = json.loads((tmp_path / "runs" / f"pdssm-lr{best:g}-s1" / "settings.json").read_text())
    assert settings["weight_decay"] == 0.1 and settings["n"] == 4 and settings["tau_end"] == 0.1  # granite350m's
    table = (tmp_path / "summary.md").read_text()
    assert "| host alone |" in table and "| pdssm |" in table and "| mamba2 |" in table


def test_the_128m_host_is_a_granite_4_h_hybrid_of_over_100m_parameters():
    model, tok = box_scale.build_host(box_scale.SCALES["128m"])
    cfg = model.config
    assert type(model).__name__ == "GraniteMoeHybridForCausalLM"
    assert sum(p.numel() for p in model.parameters()) > 1e8
    assert [i for i, t in enumerate(cfg.layer_types) if "mamba" not in t and "linear" not in t] == [5, 15, 25, 35]
    assert cfg.num_hidden_layers == 40 and cfg.position_embedding_type == "nope"  # granite-4.0-h-micro's
    assert cfg.mamba_n_heads * cfg.mamba_d_head == 2 * cfg.hidden_size and cfg.mamba_d_state == 128
    assert cfg.vocab_size == len(tok)


def test_rows_of_the_older_summary_are_the_recipe_rate_runs_with_their_spread():
    rows = box_scale.rows_from_summary(SUMMARY_27M.read_text(), 26_760_288, 1e-3)
    by = {r["kind"]: r for r in rows}
    assert set(by) == {"host", "pdssm", "mamba2", "deltanet"}
    line = next(x for x in SUMMARY_27M.read_text().splitlines() if x.startswith("| + 4 mamba2 |"))
    iid, ood = (c.strip() for c in line.split("|")[3:5])
    assert f"{by['mamba2']['iid']} ± {by['mamba2']['std']['iid']}" == iid
    assert f"{by['mamba2']['ood']} ± {by['mamba2']['std']['ood']}" == ood
    assert all(len(r["curve"]) == 27 and r["seeds"] >= 1 for r in rows)
    assert box_scale.mean_std([by["pdssm"]], "ood") == (by["pdssm"]["ood"], by["pdssm"]["std"]["ood"], 3)


def _row(params, kind, seed, lr, iid, ood, ev="as trained"):
    return {"host_params": params, "kind": kind, "seed": seed, "lr": lr, "eval": ev, "iid": iid, "ood": ood,
            "whole_state": {"iid": 1.0, "ood": 0.0}, "curve": [iid, ood]}


def test_table_takes_each_kind_at_its_best_rate_and_gives_the_gap_to_the_better_baseline(tmp_path):
    rows = [_row(1e8, "pdssm", s, 3e-4, 50 + s, 20 + 2 * s) for s in range(3)]
    rows += [_row(1e8, "pdssm", 0, 1e-3, 90, 90)]  # a sweep point that lost on validation: left out
    rows += [_row(1e8, "mamba2", s, 1e-3, 40, 10 + s) for s in range(3)]
    rows += [_row(1e8, "deltanet", s, 1e-3, 40, 15) for s in range(3)]
    rows += [_row(1e8, "pdssm", s, 3e-4, 30, 5, "tokens alone") for s in range(3)]
    rows += [{"host_params": 1e8, "kind": k, "eval": "best lr", "lr": lr}
             for k, lr in (("pdssm", 3e-4), ("mamba2", 1e-3), ("deltanet", 1e-3))]
    table = box_scale.table(rows)
    assert "| 100 M | pdssm | 0.0003 | 3 | 51.0 ± 1.0 | 22.0 ± 2.0 | 1.0 ± 0.0 | 30.0 ± 0.0 / 5.0 ± 0.0 |" in table
    assert "| 100 M | +7.0 | 2.0 |" in table  # 22.0 against deltanet's 15.0; the larger std is pdssm's
    path = box_scale.plot(rows + box_scale.rows_from_summary(SUMMARY_27M.read_text(), 26_760_288, 1e-3),
                          tmp_path / "scale.png")
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_a_failed_seed_run_is_started_once_more_and_a_failed_sweep_point_counts_as_dropped(tmp_path):
    """A seed (or its ablation) that fails gets one more start; a second failure, or a failed sweep point, none."""
    class Done:
        returncode = 1

    def failed(stage, what="finetune-one", retry=False):
        job = box_scale.Job(what, "pdssm", 3e-4, 1, tmp_path, stage, {"lr": 3e-4}, retry=retry)
        (tmp_path / f"{what}.log").write_text("CUDA out of memory")
        job.proc, job.t0 = Done(), 0.0
        return job

    dropped = []
    again = box_scale.collect(failed("seeds"), None, lambda *a: dropped.append(a) or [])
    assert [(j.what, j.kind, j.lr, j.seed, j.stage, j.settings, j.retry) for j in again] == \
        [("finetune-one", "pdssm", 3e-4, 1, "seeds", {"lr": 3e-4}, True)]
    assert box_scale.collect(failed("seeds", retry=True), None, None) == []
    assert [j.what for j in box_scale.collect(failed("seeds", "ablate"), None, None)] == ["ablate"]
    assert box_scale.collect(failed("sweep"), None, lambda *a: dropped.append(a) or []) == []
    assert dropped == [("pdssm", 3e-4, None)]


def _job(what, kind, stage, rc=None, lr=3e-4, gpu=None):
    """A scheduler's view of a child: its process's return code (None: running) and the GPU it runs on."""
    j = box_scale.Job(what, kind, lr, 0, Path("unused"), stage)
    j.proc, j.gpu = SimpleNamespace(returncode=rc), gpu
    return j


def test_owed_runs_count_seed_runs_not_ablations_and_not_failed_ones():
    running = [_job("finetune-one", "pdssm", "seeds"), _job("finetune-one", "mamba2", "sweep"),
               _job("ablate", "pdssm", "seeds")]
    finished = [_job("finetune-one", "pdssm", "seeds", 0), _job("finetune-one", "mamba2", "seeds", 1),
                _job("ablate", "mamba2", "seeds", 0)]
    # pdssm: one seed started but no sweep point (its seed 0); mamba2: swept, one seed failed, so both seeds still
    # owed; deltanet: nothing started, all three owed; plus 2 running runs
    assert box_scale.owed_runs(["pdssm", "mamba2", "deltanet"], 3, running, finished) == 1 + 2 + 3 + 2
    assert box_scale.swept("mamba2", running, finished) and not box_scale.swept("deltanet", running, finished)


def test_sweep_points_are_dropped_only_when_the_owed_runs_would_pass_the_deadline():
    assert box_scale.fits(owed=9, elapsed=0, runs_done=0, left=1)  # no pace yet: the first runs start
    assert box_scale.fits(owed=6, elapsed=200, runs_done=2, left=600)  # 6 x 100 s
    assert not box_scale.fits(owed=7, elapsed=200, runs_done=2, left=600)


def test_a_kinds_first_sweep_point_is_never_dropped_its_later_ones_are():
    """Two runs side by side, the first has ended, the pace says the owed runs pass the deadline: the third kind's
    first point (its seed 0) still starts; another rate of a kind already swept does not."""
    def point(kind, lr, rc=None):
        return _job("finetune-one", kind, "sweep", rc, lr)

    finished, running = [point("pdssm", 3e-4, 0)], [point("mamba2", 1e-3)]
    owed = box_scale.owed_runs(["pdssm", "mamba2", "deltanet"], 3, running, finished) + 1
    assert owed == 2 + 2 + 3 + 1 + 1
    pace = dict(elapsed=216, left=689)  # 9 runs x 216 s > 689 s
    assert not box_scale.drops(point("deltanet", 1e-3), owed, running, finished, **pace)
    assert box_scale.drops(point("pdssm", 1e-3), owed, running, finished, **pace)
    assert not box_scale.drops(point("pdssm", 1e-3), owed, running, finished, elapsed=216, left=9 * 216)


def test_a_run_starts_on_the_gpu_with_the_fewest_running():
    def on(gpu):
        return _job("finetune-one", "pdssm", "seeds", gpu=gpu)

    assert box_scale.least_busy_gpu(0, [on(None)]) is None
    assert box_scale.least_busy_gpu(2, []) == 0
    # GPU 1's first run ended: the next goes there, not to GPU 0 (a count of started runs would say 0)
    assert box_scale.least_busy_gpu(2, [on(0), on(0), on(1)]) == 1
    assert box_scale.least_busy_gpu(3, [on(0), on(2)]) == 1


def test_summarize_refuses_rows_of_two_runs_at_one_host_size(tmp_path):
    """Two runs on hosts of one size (another host, or another fine-tuning shape) would pool as seeds of one."""
    row = {"host_params": 127_597_760, "host": "124m", "steps": 600, "batch": 64, "kind": "pdssm", "eval": "as trained",
           "seed": 0, "lr": 3e-4, "iid": 50.0, "ood": 10.0, "whole_state": {"iid": 1.0, "ood": 0.0}, "curve": [1.0]}
    old, new = tmp_path / "old.jsonl", tmp_path / "new.jsonl"
    old.write_text(json.dumps(row) + "\n")
    new.write_text(json.dumps({**row, "host": "128m", "steps": 150, "batch": 256}) + "\n")
    with pytest.raises(SystemExit, match="rows of one host size come from different runs .*127,597,760"):
        box_scale.main(["summarize", str(old), str(new), "--out", str(tmp_path / "plot.png")])


@pytest.mark.parametrize("argv, message", [(["summarize"], "summarize needs rows files"),
                                           (["import-summary", "x.md"], "import-summary needs --host-params"),
                                           (["summarize", "rows.jsonl"], "summarize needs --out"),
                                           (["run", "--kinds", "pdssm,lstm"], "--kinds: choose from")])
def test_bad_command_lines_are_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit, match="^2$"):
        box_scale.main(argv)
    assert message in capsys.readouterr().err

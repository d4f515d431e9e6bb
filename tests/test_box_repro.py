"""bench/box_repro.py end to end at tiny size on the CPU (--quick): host pretrained and saved, reloaded frozen,
every kind trained through llm_surgery.train, then the table, results.json, plot and log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
KINDS = ("pdssm", "mamba2", "deltanet")


@pytest.mark.slow
def test_quick_pipeline_writes_one_row_per_kind(tmp_path):
    out = tmp_path / "box"
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(REPO))
    env.pop("OUT", None)
    # its own process: Accelerate fixes device and precision once per process
    subprocess.run([sys.executable, "bench/box_repro.py", "--quick", "--threads", "1", "--out", str(out)],
                   cwd=REPO, env=env, check=True, capture_output=True, timeout=300)
    for name in ("results.json", "results.md", "accuracy.png", "box_repro.log", "host/config.json",
                 "host/host.json"):
        assert (out / name).is_file(), name
    assert (out / "accuracy.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((out / "host" / "config.json").read_text())["model_type"] == "granitemoehybrid"

    res = json.loads((out / "results.json").read_text())
    max_ops = res["args"]["test_max_ops"]
    assert [r["kind"] for r in res["rows"]] == ["host", *KINDS]
    for r in res["rows"]:
        assert sorted(map(int, r["test"]["by_num_ops"])) == list(range(max_ops + 1))
        assert 0.0 <= r["test"]["iid"]["accuracy"] <= 1.0
    for kind in KINDS:  # the trainer ran with the saved host and wrote its own artifacts
        run = json.loads((out / kind / "results.json").read_text())
        assert run["kind"] == kind and run["host"] == str(out / "host") and run["params"]["inserted"] > 0
        assert (out / kind / "final" / "inserted.safetensors").is_file()

    rows = [line for line in (out / "results.md").read_text().splitlines() if line.startswith("| ")]
    header, body = rows[0], rows[2:]  # after the --- line
    assert header.count("|") == 4 + max_ops + 2  # run, IID, OOD, IID tokens, one per number of transitions
    for kind in KINDS:
        assert sum(line.startswith(f"| {kind} x4 |") for line in body) == 1
    assert len(body) == 1 + len(KINDS)  # and the host alone

"""The host shipped with the package (llm_surgery/data/box_host), its integrity check and fallback, the host-alone
baseline of a run, and the trainer's tau annealing. Fast: no test runs the full main job."""

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from llm_surgery.train import parse_config, run
from llm_surgery.train import host as host_mod
from llm_surgery.train.host import SHIPPED_HOST, embedded_host, load_pretrained, shipped_host_problem
from llm_surgery.train.schedule import tau_at

REPO = Path(__file__).resolve().parents[1]
TINY = ["--num-sequences", "20", "--batch-size", "4", "--max-eval-examples", "40", "--eval-batch-size", "64",
        "--test-max-ops", "8", "--log-every", "1", "--no-progress", "--no-plot", "--no-tensorboard"]


def test_shipped_host_matches_its_hashes_loads_and_is_declared_package_data():
    assert shipped_host_problem() is None
    files = sorted(p.name for p in SHIPPED_HOST.iterdir())
    assert {"SHA256SUMS", "config.json", "model.safetensors", "host.json"} <= set(files)
    assert sum((SHIPPED_HOST / f).stat().st_size for f in files) <= 20e6
    model, tok = load_pretrained(str(SHIPPED_HOST), torch.float32, torch.device("cpu"))
    record = json.loads((SHIPPED_HOST / "host.json").read_text())
    assert type(model).__name__ == "GraniteMoeHybridForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == record["parameters"]
    assert tok.convert_tokens_to_ids("Box") != tok.unk_token_id
    assert "data/box_host/*" in (REPO / "pyproject.toml").read_text()
    assert "llm_surgery/data" in (REPO / "MANIFEST.in").read_text()


def test_shipped_host_reads_descriptions_but_was_never_taught_the_answers():
    """What the README says the host knows: it restates a description's objects by box number (chance ~1%),
    from documents it never saw (validation signatures, another random stream)."""
    from llm_surgery.box_data import generate_split, signature_partition
    from llm_surgery.train.make_host import documents, is_full_restatement, restatement_accuracy

    model, tok = load_pretrained(str(SHIPPED_HOST), torch.float32, torch.device("cpu"))
    val = generate_split("validation", 30, 6, seed=7, signatures=signature_partition(2255)["validation"])
    docs = [d for d in documents(val, random.Random(0)) if is_full_restatement(d)]
    assert restatement_accuracy(model, tok, docs) > 0.5



def test_make_host_pretrains_on_whole_permutations_and_stops_where_told():
    """`make_host`'s recipe through the shared host loop: each permutation of the documents is used whole before
    the next (a batch runs on into the next one), and `--stop-at` ends the run with a last evaluation."""
    from llm_surgery.box_data import generate_split, signature_partition
    from llm_surgery.train.make_host import build, documents, encode_docs, pretrain_docs, shuffled_batches

    model, tok = build(0)
    train = generate_split("train", 4, 6, seed=1, signatures=signature_partition(2255)["train"])
    docs = documents(train, random.Random(0))
    data = encode_docs(tok, docs)
    stream = shuffled_batches(data, 5, seed=0)
    rows = [tuple(r[m.bool()].tolist()) for b in (next(stream) for _ in range(-(-2 * len(data) // 5)))
            for r, m in zip(b["input_ids"], b["attention_mask"])]
    assert sorted(rows[:len(data)]) == sorted(rows[len(data):2 * len(data)]) == sorted(map(tuple, data))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    curve = pretrain_docs(model, tok, docs, docs[:4], batch_size=4, lr=3e-3, max_seconds=float("inf"), steps=10,
                          seed=0, log=lambda msg: None, eval_every=3, stop_at=5)
    assert [c["step"] for c in curve] == [3, 5] and all(c["loss"] > 0 for c in curve)
    assert not model.training and any(not torch.equal(before[k], v) for k, v in model.state_dict().items())

def test_length_buckets_keep_the_documents_and_cut_the_padding():
    """`shuffled_batches(..., buckets=K)`: each run of K batches holds the documents of K plain batches of the same
    seed (within the first permutation: 3 x 32 of 120 here), sorted by length into batches, so the padding falls."""
    from llm_surgery.box_data import generate_split, signature_partition
    from llm_surgery.train.make_host import build, documents, encode_docs, shuffled_batches

    _, tok = build(0)
    train = generate_split("train", 40, 6, seed=1, signatures=signature_partition(2255)["train"])
    data = encode_docs(tok, documents(train, random.Random(0)))
    plain, bucketed = shuffled_batches(data, 8, seed=3), shuffled_batches(data, 8, seed=3, buckets=4)
    def real(b):
        return sorted(tuple(r[m.bool()].tolist()) for r, m in zip(b["input_ids"], b["attention_mask"]))
    pad = [0, 0]
    for _ in range(3):
        runs = [[next(s) for _ in range(4)] for s in (plain, bucketed)]
        assert sorted(sum((real(b) for b in runs[0]), [])) == sorted(sum((real(b) for b in runs[1]), []))
        for i, run in enumerate(runs):
            pad[i] += sum(int((b["attention_mask"] == 0).sum()) for b in run)
    assert pad[1] < pad[0] / 2


def _corrupt_copy(tmp_path) -> Path:
    bad = tmp_path / "box_host"
    shutil.copytree(SHIPPED_HOST, bad)
    data = bytearray((bad / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (bad / "model.safetensors").write_bytes(bytes(data))
    return bad


def test_corrupt_or_missing_shipped_host_falls_back_to_pretraining_with_one_line(tmp_path, monkeypatch):
    bad = _corrupt_copy(tmp_path)
    assert "model.safetensors does not match its sha256" in shipped_host_problem(bad)
    assert "SHA256SUMS is missing" in shipped_host_problem(tmp_path / "nowhere")
    monkeypatch.setattr(host_mod, "SHIPPED_HOST", bad)
    cfg = parse_config(["--pretrain-steps", "1", "--num-sequences", "20", "--cache-dir", str(tmp_path / "cache")])
    lines = []
    path = embedded_host(cfg, log=lines.append)
    assert path == host_mod.tiny_host_dir(cfg) and (path / "pretrain.json").is_file()  # pretrained as before
    warning = [m for m in lines if "shipped host not used" in m]
    assert len(warning) == 1 and "\n" not in warning[0] and "corrupt" in warning[0]
    monkeypatch.setattr(host_mod, "SHIPPED_HOST", SHIPPED_HOST)
    assert embedded_host(cfg, log=lines.append) == SHIPPED_HOST


@pytest.mark.slow
def test_run_prints_the_host_alone_beside_the_trained_layers(tmp_path, capsys):
    """The default run (shipped host) evaluates the host alone before training: the inserted layers start as the
    identity, so that row equals an evaluation of the bare host; the table prints both."""
    from accelerate import Accelerator

    from llm_surgery.train.data import cap_records, make_splits
    from llm_surgery.train.evaluate import EvalSet, evaluate

    res = run(["--max-steps", "2", "--output-dir", str(tmp_path / "run"), *TINY])
    assert res["host"] == str(SHIPPED_HOST)
    out = capsys.readouterr().out
    assert "host alone" in out and "IID" in out and "transitions" in out
    acc = Accelerator(cpu=True)
    model, tok = load_pretrained(str(SHIPPED_HOST), torch.float32, acc.device)
    test = EvalSet(acc, tok, "test", cap_records(make_splits(20, 2255, 6, 8)["test"], 40), 64)
    bare = evaluate(acc, model, tok, test, 6)
    assert res["host_alone"]["token_accuracy"] == pytest.approx(bare["token_accuracy"], abs=1e-12)
    assert res["host_alone"]["accuracy"] == bare["accuracy"]
    assert res["host_alone"]["by_num_ops"].keys() == bare["by_num_ops"].keys()


def test_tau_at_is_geometric_over_the_run_and_fixed_without_an_end():
    assert tau_at(0, 11, 1.0, 0.1) == 1.0
    assert tau_at(10, 11, 1.0, 0.1) == pytest.approx(0.1)
    assert tau_at(5, 11, 1.0, 0.01) == pytest.approx(0.1)
    assert tau_at(5, 11, None, 0.01) == pytest.approx(0.1)  # start: the layer's default 1.0
    assert tau_at(5, 11, 0.5, None) == 0.5 and tau_at(5, 11, None, None) is None


@pytest.mark.parametrize("flag", ["0", "-1", "nan", "inf"])
def test_bad_tau_end_is_a_one_line_error(flag, capsys):
    with pytest.raises(SystemExit, match="^2$"):
        parse_config(["--tau-end", flag])
    assert "tau_end must be a finite number in (0, inf)" in capsys.readouterr().err


@pytest.fixture(scope="module")
def small_host(tmp_path_factory):
    from llm_surgery.box_data import build_box_tokenizer
    from llm_surgery.hosts import build_tiny_host

    path = tmp_path_factory.mktemp("host")
    tok = build_box_tokenizer()
    build_tiny_host("granite", hidden_size=32, vocab_size=len(tok), pattern="M*M*").save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.slow
def test_trainer_anneals_tau_by_step_and_a_resumed_run_continues_it(tmp_path, monkeypatch, small_host):
    """--tau-end: every step sets the layers' temperature from the step (tau_at); a run resumed at step 2 sets
    the values the uninterrupted run set at steps 2 and 3, and logs them; it reports the first run's host alone."""
    import llm_surgery.insert as insert
    from llm_surgery.train.metrics import read_jsonl

    seen = []
    real = insert.set_tau
    monkeypatch.setattr(insert, "set_tau", lambda model, tau: seen.append(tau) or real(model, tau))
    common = ["--model", str(small_host), "--kind", "pdssm", "--n", "2", "--max-steps", "4", "--save-every", "2", "--tau", "2.0",
              "--tau-end", "0.02", *TINY]
    schedule = [2.0 * 0.01 ** (s / 3) for s in range(4)]
    first = run([*common, "--output-dir", str(tmp_path / "a")])
    assert seen == pytest.approx([2.0, *schedule], rel=1e-12)  # --tau at insertion, then one value per step
    seen.clear()
    resumed = run([*common, "--output-dir", str(tmp_path / "a"), "--resume",
                   str(tmp_path / "a" / "checkpoints" / "step-00000002")])
    assert seen == pytest.approx([2.0, *schedule[2:]], rel=1e-12)
    # the host-alone row comes from the checkpoint (evaluated before the first step of the first run)
    assert resumed["host_alone"]["accuracy"] == first["host_alone"]["accuracy"]
    assert resumed["host_alone"]["token_accuracy"] == pytest.approx(first["host_alone"]["token_accuracy"])
    logged = {r["step"]: r["tau"] for r in read_jsonl(tmp_path / "a" / "metrics.jsonl") if "tau" in r}
    assert logged == pytest.approx({s + 1: t for s, t in enumerate(schedule)}, rel=1e-12)

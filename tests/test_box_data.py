"""Tests of llm_surgery.box_data: generated texts are re-simulated from the words alone by a parser written
here (it does not use the generator's state code), plus splits, determinism, files, CLI, scorer, tokenizer,
collation and greedy decoding with tiny real transformers models."""

import json
import math
import re
from collections import Counter, defaultdict

import pytest
import torch

from llm_surgery.box_data import (COMMON_OBJECTS, RARE_OBJECTS, BoxCollator, build_box_tokenizer,
                                  encode_example, encode_records, generate_split, generate_splits,
                                  greedy_complete, read_jsonl, score, write_splits)
from llm_surgery.box_data.__main__ import main as cli_main

SMALL = {"train": 40, "validation": 10, "test": 20}

# ---------------------------------------------------------------- an independent parser and simulator

_OBJ = r"the [a-z]+(?: and the [a-z]+)*"
_MOVE = re.compile(rf"^Move ({_OBJ}) from Box (\d) to Box (\d)\.$")
_REMOVE = re.compile(rf"^Remove ({_OBJ}) from Box (\d)\.$")
_PUT = re.compile(rf"^Put ({_OBJ}) into Box (\d)\.$")
_CLAUSE = re.compile(rf"^Box (\d) (?:contains ({_OBJ})|is empty)$")


def _objects(text):
    objs = [w[len("the "):] for w in text.split(" and ")]
    assert objs == sorted(objs), f"objects not sorted: {text!r}"
    assert len(set(objs)) == len(objs)
    return objs


def simulate(context, vocab):
    """Parse a context, check every operation is legal, return (initial counts, final boxes, changes, ops)."""
    m = re.fullmatch(r"(.*\.) Box (\d)", context)
    assert m, context
    body, query = m.group(1), int(m.group(2))
    sentences = re.findall(r"[^.]+\.", body)
    assert " ".join(s.strip() for s in sentences) == body
    desc, ops = sentences[0].strip(), [s.strip() for s in sentences[1:]]
    clauses = desc[:-1].split(", ")
    assert len(clauses) == 7
    boxes = []
    for i, clause in enumerate(clauses):
        c = _CLAUSE.match(clause)
        assert c and int(c.group(1)) == i, clause
        boxes.append(_objects(c.group(2)) if c.group(2) else [])
    initial_counts = tuple(len(b) for b in boxes)
    changes = [0] * 7
    kinds = []

    def check_world():
        everything = [o for b in boxes for o in b]
        assert len(everything) == len(set(everything)), "an object is in two boxes"
        assert all(len(b) <= 3 for b in boxes), "capacity exceeded"
        assert set(everything) <= set(vocab)

    check_world()
    for op in ops:
        if (g := _MOVE.match(op)):
            objs, src, dst = _objects(g.group(1)), int(g.group(2)), int(g.group(3))
            assert src != dst and set(objs) <= set(boxes[src]), op
            boxes[src] = [o for o in boxes[src] if o not in objs]
            boxes[dst] = sorted(boxes[dst] + objs)
            changes[src] += 1
            changes[dst] += 1
            kinds.append(("move", len(objs)))
        elif (g := _REMOVE.match(op)):
            objs, src = _objects(g.group(1)), int(g.group(2))
            assert set(objs) <= set(boxes[src]), op
            boxes[src] = [o for o in boxes[src] if o not in objs]
            changes[src] += 1
            kinds.append(("remove", len(objs)))
        elif (g := _PUT.match(op)):
            objs, dst = _objects(g.group(1)), int(g.group(2))
            assert not set(objs) & {o for b in boxes for o in b}, f"put of an object already in a box: {op}"
            boxes[dst] = sorted(boxes[dst] + objs)
            changes[dst] += 1
            kinds.append(("put", len(objs)))
        else:
            raise AssertionError(f"unparseable operation {op!r}")
        check_world()
    return initial_counts, boxes, query, changes, kinds


def expected_target(objs):
    return " contains " + " and ".join("the " + o for o in objs) if objs else " is empty"


def check_split(records, max_ops, vocab):
    """Every target re-simulated; uniform num_ops; full (sequence, prefix) groups; prefixes nest."""
    by_seq = defaultdict(dict)
    kinds = Counter()
    for r in records:
        counts, boxes, query, changes, k = simulate(r["context"], vocab)
        assert query == r["box"]
        assert len(k) == r["num_ops"]
        assert r["target"] == expected_target(boxes[query])
        assert r["objects"] == boxes[query]
        assert r["num_ops_box"] == changes[query]
        assert r["signature"] == "".join(map(str, counts))
        by_seq[r["sequence_id"]][(r["num_ops"], r["box"])] = r["context"]
        kinds.update(k)
    per_ops = Counter(r["num_ops"] for r in records)
    assert set(per_ops) == set(range(max_ops + 1))
    assert len(set(per_ops.values())) == 1, f"num_ops not uniform: {per_ops}"
    for seq, ctx in by_seq.items():
        assert set(ctx) == {(n, b) for n in range(max_ops + 1) for b in range(7)}, seq
        prefixes = [ctx[(n, 0)][: -len(" Box 0")] for n in range(max_ops + 1)]
        assert all(prefixes[n + 1].startswith(prefixes[n] + " ") for n in range(max_ops))
        assert all(ctx[(n, b)] == f"{prefixes[n]} Box {b}" for n, b in ctx)
    return kinds


@pytest.fixture(scope="module")
def splits():
    return generate_splits(SMALL, seed=7, train_max_ops=4, test_max_ops=12, disjoint_vocab=True)


# ---------------------------------------------------------------- generator

def test_vocabularies():
    assert len(COMMON_OBJECTS) == len(set(COMMON_OBJECTS)) == 100
    assert len(RARE_OBJECTS) == len(set(RARE_OBJECTS)) == 100
    assert not set(COMMON_OBJECTS) & set(RARE_OBJECTS)
    assert all(w.isalpha() and w.islower() for w in COMMON_OBJECTS + RARE_OBJECTS)


def test_every_target_resimulated(splits):
    assert {k: len(v) for k, v in splits.items()} == {
        "train": 40 * 5 * 7, "validation": 10 * 5 * 7, "test": 20 * 13 * 7, "test_disjoint_vocab": 20 * 13 * 7}
    kinds = Counter()
    for name, max_ops in [("train", 4), ("validation", 4), ("test", 12)]:
        kinds += check_split(splits[name], max_ops, COMMON_OBJECTS)
    check_split(splits["test_disjoint_vocab"], 12, RARE_OBJECTS)
    # all operation kinds occur, with single and several objects
    for kind in ("move", "remove", "put"):
        assert kinds[(kind, 1)] > 0 and sum(v for (k, n), v in kinds.items() if k == kind and n > 1) > 0


def test_split_rule_signatures_disjoint(splits):
    sigs = {name: {simulate(r["context"], COMMON_OBJECTS + RARE_OBJECTS)[0] for r in recs if r["num_ops"] == 0}
            for name, recs in splits.items()}
    assert not sigs["train"] & sigs["test"]
    assert not sigs["train"] & sigs["validation"]
    assert not sigs["validation"] & sigs["test"]
    assert not sigs["train"] & sigs["test_disjoint_vocab"]
    assert all(r["split"] == name and r["sequence_id"].startswith(name + "-") for name, recs in splits.items()
               for r in recs)


def test_initial_counts_follow_clipped_poisson():
    recs = generate_split("train", 400, 0, seed=3)
    counts = Counter(len(r["objects"]) for r in recs)
    n = sum(counts.values())
    p = [math.exp(-2) * 2 ** k / math.factorial(k) for k in range(3)]
    expected = p + [1 - sum(p)]
    for k in range(4):
        assert abs(counts[k] / n - expected[k]) < 0.03, (k, counts)


def test_deterministic_and_seed_dependent(splits):
    again = generate_splits(SMALL, seed=7, train_max_ops=4, test_max_ops=12, disjoint_vocab=True)
    assert again == splits
    other = generate_splits(SMALL, seed=8, train_max_ops=4, test_max_ops=12)
    assert other["train"] != splits["train"] and other["test"] != splits["test"]
    # the test set does not depend on how much train data is drawn
    bigger = generate_splits({"train": 80, "validation": 10, "test": 20}, seed=7, train_max_ops=4,
                             test_max_ops=12)
    assert bigger["test"] == splits["test"]


def test_default_sizes_documented():
    from llm_surgery.box_data.generate import split_sizes

    assert split_sizes(1000) == {"train": 600, "validation": 100, "test": 300}
    assert sum(split_sizes(7).values()) == 7


@pytest.mark.slow
def test_default_splits_resimulated():
    """The defaults: 0-6 ops for train/validation, 0-26 for test, every target re-simulated (~10 s)."""
    data = generate_splits()
    assert {k: len(v) for k, v in data.items()} == {"train": 29400, "validation": 4900, "test": 56700}
    for name, max_ops in [("train", 6), ("validation", 6), ("test", 26)]:
        check_split(data[name], max_ops, COMMON_OBJECTS)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"num_sequences": -1}, ValueError, r"num_sequences must be >= 0, got -1"),
    ({"num_sequences": {"train": -2}}, ValueError, r"num_sequences\['train'\] must be >= 0, got -2"),
    ({"num_sequences": {"dev": 2}}, ValueError, r"num_sequences has unknown splits \['dev'\]"),
    ({"num_sequences": 2.5}, TypeError, r"num_sequences must be an int, got 2.5"),
    ({"train_max_ops": -1}, ValueError, r"train_max_ops must be >= 0, got -1"),
    ({"train_max_ops": 6, "test_max_ops": 5}, ValueError, r"test_max_ops \(5\) must be >= train_max_ops \(6\)"),
])
def test_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        generate_splits(**kwargs)


# ---------------------------------------------------------------- files and CLI

def test_cli_generate_files_card_and_datasets(tmp_path, monkeypatch, capsys):
    out = tmp_path / "box"
    argv = ["generate", "--out", str(out), "--seed", "1", "--split-sequences", "6", "2", "3",
            "--train-max-ops", "2", "--test-max-ops", "5", "--disjoint-vocab", "--no-progress"]
    assert cli_main(argv) == 0
    files = {p.name for p in out.iterdir()}
    assert files == {"train.jsonl", "validation.jsonl", "test.jsonl", "test_disjoint_vocab.jsonl", "README.md"}
    test = read_jsonl(out / "test.jsonl")
    assert test == generate_splits({"train": 6, "validation": 2, "test": 3}, seed=1, train_max_ops=2,
                                   test_max_ops=5)["test"]
    card = (out / "README.md").read_text()
    assert "| 5 | 0 | 0 | 21 | 21 |" in card and "| train | 6 | 126 |" in card
    # an existing output is kept unless --overwrite
    before = (out / "train.jsonl").read_bytes()
    with pytest.raises(SystemExit, match="^2$"):
        cli_main(argv[:-1] + ["--seed", "2"])
    assert "already holds train.jsonl" in capsys.readouterr().err and (out / "train.jsonl").read_bytes() == before
    assert cli_main(argv + ["--overwrite"]) == 0

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    import datasets

    ds = datasets.load_dataset("json", data_files={s: str(out / f"{s}.jsonl") for s in
                                                   ("train", "validation", "test")},
                               cache_dir=str(tmp_path / "hf" / "datasets"))
    assert ds["test"].num_rows == 3 * 6 * 7 and ds["train"].num_rows == 6 * 3 * 7
    assert ds["test"][0]["context"] == test[0]["context"] and ds["test"][0]["target"] == test[0]["target"]
    # the card's metadata keeps test_disjoint_vocab a split of its own when the folder is loaded as a whole
    whole = datasets.load_dataset(str(out), cache_dir=str(tmp_path / "hf" / "datasets"))
    assert {k: v.num_rows for k, v in whole.items()} == {"train": 126, "validation": 42, "test": 126,
                                                          "test_disjoint_vocab": 126}


@pytest.mark.parametrize("extra, message", [
    (["--num-sequences", "-3"], "num_sequences must be >= 0, got -3"),
    (["--num-sequences", "0"], "got 0: nothing to generate"),   # zero sequences: refused, not empty files
    (["--split-sequences", "0", "0", "0"], "got {'train': 0, 'validation': 0, 'test': 0}: nothing to generate"),
    (["--train-max-ops", "9", "--test-max-ops", "8"], "test_max_ops (8) must be >= train_max_ops (9)"),
    (["--out-file-parent"], "/file/sub is not writable"),
])
def test_cli_bad_input_fails_before_work(tmp_path, capsys, extra, message):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out = blocker / "sub" if extra == ["--out-file-parent"] else tmp_path / "out"
    argv = ["generate", "--out", str(out), "--no-progress"] + ([] if extra == ["--out-file-parent"] else extra)
    with pytest.raises(SystemExit, match="^2$"):   # the exit status; the message goes to stderr, in one line
        cli_main(argv)
    err = capsys.readouterr().err
    assert err.startswith("llm-surgery-box generate: error: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_write_splits_refuses_existing(tmp_path):
    data = generate_splits({"train": 1}, seed=0, train_max_ops=1, test_max_ops=1)
    write_splits(tmp_path, data)
    with pytest.raises(FileExistsError, match=r"already holds .*train.jsonl.*; pass overwrite=True"):
        write_splits(tmp_path, data)
    write_splits(tmp_path, data, overwrite=True)


# ---------------------------------------------------------------- scorer

def _records(groups):
    """groups: list of (sequence_id, num_ops, [target per box 0..6])."""
    return [{"id": f"{s}/{n}/{b}", "sequence_id": s, "num_ops": n, "box": b, "num_ops_box": min(n, 1),
             "target": t} for s, n, targets in groups for b, t in enumerate(targets)]


def test_score_hand_written_cases():
    full = [" contains the cup and the egg", " is empty", " contains the fig", " is empty", " is empty",
            " contains the bell and the book and the car", " is empty"]
    records = _records([("a", 0, full), ("a", 9, full)])
    right = ["contains the egg and the cup", "is empty.", " contains fig", " is empty", "is empty ",
             " contains the car and the bell and the book. Box 6", "is empty\nmore"]
    wrong = [" contains the cup and the egg and the fig", " contains nothing", " contains the fig and the fig",
             " is", "", " contains the bell and the book", " contains the cup"]
    result = score(records, right + wrong, train_max_ops=6)
    assert result["num_examples"] == 14 and result["accuracy"] == 0.5
    assert result["iid"]["accuracy"] == 1.0 and result["ood"]["accuracy"] == 0.0
    assert result["state_accuracy"] == 0.5 and result["num_states"] == 2
    assert result["by_num_ops"][0]["state_accuracy"] == 1.0 and result["by_num_ops"][9]["accuracy"] == 0.0
    assert result["by_num_ops_box"][0]["num_examples"] == 7
    # one wrong box spoils the whole state
    one_wrong = right + right[:-1] + [" contains the cup"]
    result = score(records, one_wrong)
    assert result["accuracy"] == 13 / 14 and result["state_accuracy"] == 0.5
    assert result["ood"]["state_accuracy"] == 0.0 and result["ood"]["accuracy"] == 6 / 7
    # a mapping by id, and an incomplete group is not a state
    by_id = {r["id"]: p for r, p in zip(records[:10], right + right)}
    result = score(records[:10], by_id)
    assert result["accuracy"] == 1.0 and result["num_states"] == 1
    assert result["ood"]["num_states"] == 0 and result["ood"]["state_accuracy"] is None
    with pytest.raises(ValueError, match="got 7 predictions for 14 records"):
        score(records, right)
    with pytest.raises(ValueError, match=r"14 record\(s\) have no prediction"):
        score(records, {})


def test_cli_score(tmp_path, capsys):
    records = _records([("s", 0, [" is empty"] * 7), ("s", 8, [" contains the cup"] + [" is empty"] * 6)])
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    preds = [{"id": r["id"], "prediction": " is empty"} for r in records]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(p) + "\n" for p in reversed(preds)))
    assert cli_main(["score", "--data", str(tmp_path / "d.jsonl"), "--predictions", str(tmp_path / "p.jsonl"),
                     "--out", str(tmp_path / "m.json")]) == 0
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["accuracy"] == 13 / 14 and metrics["iid"]["state_accuracy"] == 1.0
    assert metrics["ood"]["state_accuracy"] == 0.0
    assert json.loads(capsys.readouterr().out) == metrics


def test_score_joins_on_id_and_names_bad_ids():
    """A mapping is joined on id: a record without a prediction, a prediction for no record (another split's
    file, say), records sharing an id and a non-string prediction are errors naming the id; a list must match the
    records' count."""
    records = _records([("s", 0, [" is empty"] * 7)])
    preds = {r["id"]: " is empty" for r in records}
    assert score(records, preds)["accuracy"] == 1.0
    with pytest.raises(ValueError, match=r"1 record\(s\) have no prediction \(first: id 's/0/3'\)"):
        score(records, {k: v for k, v in preds.items() if k != "s/0/3"})
    with pytest.raises(ValueError, match=r"id that is in no record \(first: 't/1/0'\)"):
        score(records, {**preds, "t/1/0": " is empty"})
    with pytest.raises(ValueError, match=r"records 1 and 8 share the id 's/0/0'"):
        score(records + records[:1], preds)
    with pytest.raises(TypeError, match=r"prediction for id 's/0/2' must be a string, got int"):
        score(records, {**preds, "s/0/2": 3})
    with pytest.raises(ValueError, match="got 6 predictions for 7 records"):
        score(records, [" is empty"] * 6)
    with pytest.raises(ValueError, match=r"record 2 \(id 's/0/1'\): missing field 'target'"):
        score([records[0], {k: v for k, v in records[1].items() if k != "target"}], [" is empty"] * 2)


def _score_cli(tmp_path, capsys, data_lines, pred_lines, data=None, preds=None):
    """Runs `score` on the given JSON Lines; returns (exit code, stdout, stderr)."""
    data = data or tmp_path / "d.jsonl"
    preds = preds or tmp_path / "p.jsonl"
    if data_lines is not None:
        data.write_text("".join(line + "\n" for line in data_lines))
    if pred_lines is not None:
        preds.write_text("".join(line + "\n" for line in pred_lines))
    try:
        code = cli_main(["score", "--data", str(data), "--predictions", str(preds)])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_score_aligns_on_id_and_refuses_bad_prediction_files(tmp_path, capsys):
    """The 13.8% case: ids on every line but one used to switch to alignment by position. Every such file is now
    a one-line error (exit code 2) naming the file and line or the id: a line without id among lines with ids,
    duplicate, missing and unknown ids, bad JSON, a line without 'prediction', a directory given as a file, a
    data record without a field. Without any id, lines align by position when the counts match."""
    records = _records([("s", 0, [" is empty"] * 7), ("s", 8, [" contains the cup"] + [" is empty"] * 6)])
    data = [json.dumps(r) for r in records]
    rows = [{"id": r["id"], "prediction": r["target"]} for r in records]
    lines = [json.dumps(p) for p in reversed(rows)]   # in another order than the data: joined on id
    code, out, _ = _score_cli(tmp_path, capsys, data, lines)
    assert code == 0 and json.loads(out)["accuracy"] == 1.0
    no_id = lines[:5] + [json.dumps({"prediction": rows[-6]["prediction"]})] + lines[6:]
    bad = {
        "an id on all lines but one": (no_id, r"p.jsonl, line 6: needs a string 'id' \(line 1 has one"),
        "a duplicate id": (lines + [lines[3]], r"p.jsonl, line 15: duplicate id 's/8/3' \(also on line 4\)"),
        "a missing id": (lines[1:], r"1 record\(s\) have no prediction \(first: id 's/8/6'\)"),
        "an unknown id": (lines + [json.dumps({"id": "x/0/0", "prediction": " is empty"})],
                          r"id that is in no record \(first: 'x/0/0'\)"),
        "bad JSON": (lines[:2] + ["{'id': 1}"] + lines[2:], r"p.jsonl, line 3: not valid JSON"),
        "no prediction field": (lines[:4] + [json.dumps({"id": rows[9]["id"]})] + lines[5:],
                                r"p.jsonl, line 5: expected a JSON string or an object with a string 'prediction'"),
        "too few lines without ids": ([json.dumps(r["target"]) for r in records[1:]], "got 13 predictions for 14"),
    }
    for what, (pred_lines, msg) in bad.items():
        code, out, err = _score_cli(tmp_path, capsys, data, pred_lines)
        assert code == 2 and out == "", what
        assert err.count("\n") == 1 and err.startswith("llm-surgery-box score: error: "), (what, err)
        assert re.search(msg, err), (what, err)
    plain = [json.dumps(r["target"]) for r in records[:-1]] + [json.dumps({"prediction": " is empty"})]
    code, out, _ = _score_cli(tmp_path, capsys, data, plain)   # no ids at all: by position
    assert code == 0 and json.loads(out)["accuracy"] == 1.0
    (tmp_path / "dir").mkdir()
    for args in (dict(preds=tmp_path / "dir"), dict(data=tmp_path / "dir")):
        code, _, err = _score_cli(tmp_path, capsys, None, None, **args)
        assert code == 2 and err.count("\n") == 1 and "Is a directory" in err, err
    no_target = data[:2] + [json.dumps({k: v for k, v in records[2].items() if k != "target"})] + data[3:]
    code, _, err = _score_cli(tmp_path, capsys, no_target, lines)
    assert code == 2 and "d.jsonl: record 3 (id 's/0/2'): missing field 'target'" in err, err
    code, _, err = _score_cli(tmp_path, capsys, data[:1] + ["[1,"], lines)
    assert code == 2 and "d.jsonl, line 2: not valid JSON" in err, err


# ---------------------------------------------------------------- tokenizer, collation, decoding

@pytest.fixture
def one_thread():
    """The tiny models are faster on one thread, and the CI's 2 cores are shared."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tokenizer():
    return build_box_tokenizer()


def test_tokenizer_round_trips_generated_text(tokenizer, splits):
    assert tokenizer.pad_token_id is not None and tokenizer.eos_token_id is not None
    for name in ("train", "test", "test_disjoint_vocab"):
        for r in splits[name][:: 7]:
            ids = tokenizer(r["context"] + r["target"])["input_ids"]
            assert tokenizer.unk_token_id not in ids
            assert tokenizer.decode(ids) == r["context"] + r["target"]
            assert tokenizer.decode(tokenizer(r["target"], add_special_tokens=False)["input_ids"]) == \
                r["target"].strip()
    # one token per word, box number and punctuation mark
    assert len(tokenizer("Box 0 contains the cup, Box 1 is empty.")["input_ids"]) == 11
    assert tokenizer.unk_token_id in tokenizer("Box 0 contains the spaceship")["input_ids"]
    small = build_box_tokenizer(["cup"])
    assert small.unk_token_id in small("the theremin")["input_ids"]
    with pytest.raises(ValueError, match="vocabulary words must be single alphanumeric words, got 'two words'"):
        build_box_tokenizer(["two words"])


def test_encode_example_masks_prompt(tokenizer):
    context, target = "Box 0 contains the cup, Box 1 is empty. Box 0", " contains the cup"
    enc = encode_example(tokenizer, context, target)
    n_prompt = len(tokenizer(context)["input_ids"])
    assert enc["input_ids"][:n_prompt] == tokenizer(context)["input_ids"]
    assert enc["labels"][:n_prompt] == [-100] * n_prompt
    assert enc["labels"][n_prompt:] == enc["input_ids"][n_prompt:]
    assert enc["input_ids"][-1] == tokenizer.eos_token_id
    assert tokenizer.decode(enc["labels"][n_prompt:], skip_special_tokens=True) == "contains the cup"


@pytest.mark.parametrize("side", ["left", "right"])
def test_collator_pads(tokenizer, side):
    feats = [encode_example(tokenizer, "Box 0 is empty. Box 0", " is empty"),
             encode_example(tokenizer, "Box 0 contains the cup and the egg. Box 0", " contains the cup and the egg")]
    batch = BoxCollator(tokenizer, padding_side=side, pad_to_multiple_of=8)(feats)
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape
    assert batch["input_ids"].shape[1] % 8 == 0 and batch["input_ids"].dtype == torch.long
    for row, f in enumerate(feats):
        n = len(f["input_ids"])
        mask = batch["attention_mask"][row]
        real = mask.nonzero().flatten()
        assert mask.sum() == n and real.max() - real.min() + 1 == n
        assert (real[0] == 0) if side == "right" else (real[-1] == mask.numel() - 1)
        assert batch["input_ids"][row][real].tolist() == f["input_ids"]
        assert batch["labels"][row][real].tolist() == f["labels"]
        assert (batch["labels"][row][mask == 0] == -100).all()
        assert (batch["input_ids"][row][mask == 0] == tokenizer.pad_token_id).all()
    with pytest.raises(ValueError, match="padding_side must be 'left' or 'right', got 'middle'"):
        BoxCollator(tokenizer, padding_side="middle")


def _tiny_llama(tokenizer, hidden=32):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, pad_token_id=tokenizer.pad_token_id,
                      eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    return LlamaForCausalLM(cfg)


def _tiny_granite_hybrid(tokenizer):
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    cfg = GraniteMoeHybridConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, shared_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, layer_types=["mamba", "attention"],
        mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_expand=2, mamba_chunk_size=16,
        num_local_experts=0, max_position_embeddings=1024, position_embedding_type="rope",
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    return GraniteMoeHybridForCausalLM(cfg)


@pytest.mark.parametrize("build", [_tiny_llama, _tiny_granite_hybrid])
def test_greedy_complete_left_padding_matches_unbatched(tokenizer, splits, build, one_thread):
    torch.manual_seed(0)
    model = build(tokenizer)
    contexts = [r["context"] for r in splits["test"][::61]][:6]
    assert len({len(tokenizer(c)["input_ids"]) for c in contexts}) > 1  # batches really need padding
    one = greedy_complete(model, tokenizer, contexts, max_new_tokens=5, batch_size=1)
    many = greedy_complete(model, tokenizer, contexts, max_new_tokens=5, batch_size=4)
    assert one == many and len(one) == len(contexts)
    assert all(p == "" or (p.startswith(" ") and "." not in p) for p in one)
    assert model.training  # the train/eval mode is restored


def test_tiny_model_learns_and_scores(tokenizer, one_thread):
    """Overfit a few examples: the masked loss, EOS stopping and decoding must all work for 100% accuracy."""
    torch.manual_seed(0)
    records = [r for r in generate_split("train", 2, 1, seed=11)][::4][:6]
    assert len({r["target"] for r in records}) > 2
    model = _tiny_llama(tokenizer, hidden=64)
    batch = BoxCollator(tokenizer)(encode_records(tokenizer, records))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        loss = model(**batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.02
    preds = greedy_complete(model, tokenizer, [r["context"] for r in records], max_new_tokens=12, batch_size=4)
    assert preds == [r["target"] for r in records]
    assert score(records, preds)["accuracy"] == 1.0

"""Own data (`--dataset`): TRL's three formats told from the columns, loss masks, splits and --max-length, every
refusal before work (one line, file, line and field named, exit status 2, no output left), and end-to-end runs of
the trainer on a tiny local checkpoint with a real tokenizer (tests/own_data_host.py) in each format."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llm_surgery.box_data import IGNORE_INDEX
from llm_surgery.train.config import TrainConfig, UsageError
from llm_surgery.train.own_data import encode, load_own_data, prepare_tokenizer, read_dataset

sys.path.insert(0, str(Path(__file__).parent))
from own_data_host import save_tiny_checkpoint, word_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PC = [{"prompt": f"{a} {b} ->", "completion": f" {b} {a}"} for a in "abcd" for b in "0123"]
CHAT = [{"messages": [{"role": "system", "content": "swap"}, {"role": "user", "content": f"{a} {b}"},
                      {"role": "assistant", "content": f"{b} {a}"}, {"role": "user", "content": "what"},
                      {"role": "assistant", "content": f"{a} {b}"}]} for a in "abcd" for b in "0123"]
TEXT = [{"text": f"hello world {a} {b} {a}"} for a in "abcd" for b in "0123"]


def write_jsonl(path, records):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def cfg(dataset, **kw):
    return TrainConfig(dataset=str(dataset), batch_size=4, **kw)


def load(dataset, tok=None, **kw):
    return load_own_data(cfg(dataset, **kw), tok or word_tokenizer(), "tiny", 1, log=lambda msg: None)


def scored(tok, feature):
    return tok.decode([t for t in feature["labels"] if t != IGNORE_INDEX])


# ---------------------------------------------------------------- formats and masks

def test_each_format_is_told_from_its_columns_and_masks_its_loss(tmp_path):
    tok = prepare_tokenizer(word_tokenizer(), "messages", "tiny")
    assert tok.pad_token == tok.eos_token and tok.padding_side == "left"  # the tokenizer had no pad token
    text = encode(tok, "text", TEXT[0], "x")
    assert text["labels"][0] == IGNORE_INDEX and text["labels"][1:] == text["input_ids"][1:]
    assert text["input_ids"][-1] == tok.eos_token_id and "target" not in text

    pc = encode(tok, "prompt_completion", PC[0], "x")
    n_prompt = len(tok("a 0 ->")["input_ids"])
    assert pc["labels"][:n_prompt] == [IGNORE_INDEX] * n_prompt
    assert scored(tok, pc) == "0 a </s>" and pc["target"] == pc["input_ids"][n_prompt:]

    chat = encode(tok, "messages", CHAT[0], "x")
    assert scored(tok, chat) == "0 a <|end|> a 0 <|end|>"  # both assistant turns, nothing of the others
    rendered = tok.apply_chat_template(CHAT[0]["messages"], tokenize=False)
    assert tok.decode(chat["input_ids"]) == " ".join(rendered.split())  # the template's whole text, in order
    assert tok.decode(chat["target"]) == "a 0 <|end|>"  # the last assistant turn is what generation is checked on
    assert tok.decode(chat["prompt"]).endswith("<|user|> what <|end|> <|assistant|>")

    for records, fmt in ((TEXT, "text"), (PC, "prompt_completion"), (CHAT, "messages")):
        data = load(write_jsonl(tmp_path / f"{fmt}.jsonl", records))
        assert data.format == fmt and list(data.evals) == ["validation"]  # 10% held out, seeded
        assert len(data.train) + len(data.evals["validation"]) == len(records)


def test_splits_come_from_the_dataset_else_a_seeded_hold_out_and_csv_parquet_read(tmp_path):
    write_jsonl(tmp_path / "d" / "train.jsonl", PC)
    write_jsonl(tmp_path / "d" / "test.jsonl", PC[:3])
    data = load(tmp_path / "d", max_eval_examples=2)
    assert len(data.train) == len(PC) and list(data.evals) == ["test"] and len(data.evals["test"]) == 2
    one = write_jsonl(tmp_path / "one.jsonl", PC)
    a, b = load(one, eval_ratio=0.25), load(one, eval_ratio=0.25)
    assert len(a.evals["validation"]) == 4 and a.evals["validation"].features == b.evals["validation"].features
    assert load(one, eval_ratio=0.25, data_seed=1).evals["validation"].features != a.evals["validation"].features
    import pandas as pd

    pd.DataFrame(PC).to_csv(tmp_path / "pc.csv", index=False)
    pd.DataFrame(PC).to_parquet(tmp_path / "pc.parquet")
    for name in ("pc.csv", "pc.parquet"):
        got = load(tmp_path / name)
        assert got.format == "prompt_completion" and len(got.train) + len(got.evals["validation"]) == len(PC)


def test_max_length_drops_or_truncates_and_counts(tmp_path):
    records = PC + [{"prompt": "a " * 20 + "->", "completion": " b"}] * 4
    path = write_jsonl(tmp_path / "long.jsonl", records)
    dropped = load(path, max_length=10, eval_ratio=0.05)
    assert dropped.report["train"]["dropped"] + dropped.report["validation"]["dropped"] == 4
    assert all(len(f["input_ids"]) <= 10 for f in dropped.train.features)
    # truncating keeps the first 10 tokens: the long records' prompts only, nothing to learn: left out too
    cut = load(path, max_length=10, over_length="truncate", eval_ratio=0.05)
    assert cut.report["train"]["truncated"] == 0
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": "a b c d e f g h i j k l"}] * 8)
    cut = load(text, max_length=5, over_length="truncate")
    assert cut.report["train"]["truncated"] == 7 and all(len(f["input_ids"]) == 5 for f in cut.train.features)


# ---------------------------------------------------------------- refusals

def _bad_line_7(tmp_path):
    lines = [json.dumps(r) for r in PC]
    lines[6] = lines[6][:-1]  # line 7 lacks its closing brace
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("make, message", [
    (_bad_line_7, r"bad\.jsonl line 7: malformed JSON"),
    (lambda p: write_jsonl(p / "x.jsonl", [{"question": "a", "answer": "b"}] * 8),
     r"cannot tell the format .* columns \(answer, question\)"),
    (lambda p: write_jsonl(p / "x.jsonl", [{"prompt": "a"}] * 8), r"'prompt' but no 'completion' field"),
    (lambda p: write_jsonl(p / "x.jsonl", PC[:2] + [{"prompt": "a ->"}] + PC[2:]),
     r"x\.jsonl line 3: field 'completion' is missing"),
    (lambda p: write_jsonl(p / "x.jsonl", PC[:4] + [{"prompt": "a", "completion": 3}] + PC),
     r"x\.jsonl line 5: field 'completion' must be a string, got int"),
    (lambda p: write_jsonl(p / "x.jsonl", CHAT[:1] + [{"messages": [{"role": "user", "content": "a"}]}]),
     r"x\.jsonl line 2: field 'messages' has no assistant turn"),
    (lambda p: (write_jsonl(p / "d" / "train.jsonl", PC), (p / "d" / "test.jsonl").write_text(""), p / "d")[2],
     r"the test split is empty \(.*test\.jsonl holds no records\)"),
    (lambda p: write_jsonl(p / "x.jsonl", PC), r"every record of the train split \(14\) is over --max-length 3"),
    (lambda p: write_jsonl(p / "x.jsonl", PC[:4]), r"3 training records are fewer than one global batch of 4"),
    (lambda p: p / "missing.jsonl", r"--dataset .*missing\.jsonl does not exist"),
    (lambda p: (p / "x.txt").write_text("a") and p / "x.txt", r"unsupported file type '\.txt'"),
])
def test_bad_data_is_refused_naming_file_line_and_field(tmp_path, make, message):
    with pytest.raises(UsageError, match=message):
        load(make(tmp_path), max_length=3 if "max-length" in message else None)


def test_messages_without_a_chat_template_are_refused(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", CHAT)
    with pytest.raises(UsageError, match="'messages' \\(conversational\\) but the tokenizer of tiny has no chat "
                                         "template"):
        load(path, tok=word_tokenizer(chat_template=None))


# ---------------------------------------------------------------- the command line, end to end

@pytest.fixture(scope="module")
def host(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("host") / "tiny")


def _train(args, expect=0):
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false")
    p = subprocess.run([sys.executable, "-m", "llm_surgery.train", *args], env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == expect, p.stdout[-2000:] + p.stderr[-3000:]
    return p


def test_malformed_line_exits_2_naming_it_and_leaves_nothing(tmp_path, host, capsys):
    from llm_surgery.train import main

    out = tmp_path / "run"
    with pytest.raises(SystemExit, match="^2$"):
        main(["--model", str(host), "--dataset", str(_bad_line_7(tmp_path)), "--cpu", "--output-dir", str(out)],
             prog="llm-surgery-train")
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0
    assert err.startswith("llm-surgery-train: error: ") and "bad.jsonl line 7: malformed JSON" in err
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("records", [TEXT, PC, CHAT], ids=["text", "prompt_completion", "messages"])
def test_each_format_trains_and_leaves_loadable_layers(tmp_path, host, records):
    from transformers import AutoModelForCausalLM

    from llm_surgery.insert import inserted_layers, load_inserted

    out = tmp_path / "run"
    _train(["--model", str(host), "--dataset", str(write_jsonl(tmp_path / "d.jsonl", records)), "--kind", "pdssm",
            "--n", "2", "--max-steps", "4", "--batch-size", "4", "--cpu", "--output-dir", str(out), "--no-progress",
            "--eval-generate", "--lr", "1e-2"])
    model = load_inserted(AutoModelForCausalLM.from_pretrained(host), out / "final")
    blocks = inserted_layers(model)
    assert len(blocks) == 2 and all(b.mixer.out_proj.weight.abs().sum() > 0 for b in blocks.values())  # trained
    results = json.loads((out / "results.json").read_text())
    val, host_alone = results["eval"]["validation"], results["host_alone"]["validation"]
    assert val["num_examples"] == len(records) - len(records) * 9 // 10 and torch.isfinite(torch.tensor(val["loss"]))
    assert abs(val["perplexity"] - torch.tensor(val["loss"]).exp().item()) < 1e-6 * val["perplexity"]
    assert val["loss"] != host_alone["loss"]  # the host alone is the untrained baseline
    assert ("exact_match" in val) == (records is not TEXT)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("validation_loss" in m for m in metrics)

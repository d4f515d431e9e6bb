"""Fine-tune inserted layers on a small JSONL with Hugging Face's Trainer, then evaluate: a state-tracking task.

Three cups a, b, c stand in a row; a prompt lists swaps of positions, the completion is the row after them:

    {"prompt": "a b c swap 0 1 swap 1 2 ->", "completion": " b c a"}

i.e. composing transpositions in the symmetric group S3 (what PD-SSM's one-hot transitions can track exactly). The
data ships in examples/data/cup_swaps/ (train.jsonl, test.jsonl; remade by `--write-data`, seeded).

    python examples/cup_swaps.py                      # a tiny random Granite-4.0 host built here, CPU
    python examples/cup_swaps.py --model DIR          # your checkpoint (with its tokenizer)

The same data trains with the trainer of this repo: `llm-surgery-train --model DIR --dataset
examples/data/cup_swaps --eval-generate`.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

import torch

DATA = Path(__file__).resolve().parent / "data" / "cup_swaps"
CUPS = "abc"


def make_records(n: int, seed: int, max_swaps: int = 4) -> list[dict]:
    """`n` prompt-completion records with 1..max_swaps swaps of two different positions."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        row, ops = list(CUPS), []
        for _ in range(rng.randint(1, max_swaps)):
            i, j = rng.sample(range(3), 2)
            row[i], row[j] = row[j], row[i]
            ops.append(f"swap {i} {j}")
        out.append({"prompt": f"{' '.join(CUPS)} {' '.join(ops)} ->", "completion": " " + " ".join(row)})
    return out


def write_data(directory: Path = DATA) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, n, seed in (("train", 600, 0), ("test", 100, 1)):
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in make_records(n, seed)))


def tiny_host(directory: Path) -> Path:
    """A random Granite-4.0 host (hidden size 32, two attention blocks) with a word tokenizer for this task."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from llm_surgery.hosts import build_tiny_host

    words = ["<unk>", "<s>", "</s>", *CUPS, "0", "1", "2", "swap", "->"]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    build_tiny_host("granite", seed=0, hidden_size=32, vocab_size=len(vocab), pattern="M*M*",
                    mamba_chunk_size=64).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def encode_split(tokenizer, name: str) -> list[dict]:
    """The split's records tokenized as the trainer does (loss on the completion and EOS only)."""
    from llm_surgery.train.own_data import encode, read_dataset

    split = read_dataset(str(DATA))[name]
    return [encode(tokenizer, "prompt_completion", r, p) for r, p in zip(split.rows, split.places)]


@torch.no_grad()
def exact_match(model, tokenizer, features: list[dict], batch_size: int = 50) -> float:
    """Share of records whose greedy completion is the target exactly (its EOS included)."""
    from llm_surgery.box_data import BoxCollator

    collate, hits = BoxCollator(tokenizer, padding_side="left"), 0
    model.eval()
    for start in range(0, len(features), batch_size):
        part = features[start:start + batch_size]
        batch = collate([{"input_ids": f["prompt"]} for f in part])
        longest = max(len(f["target"]) for f in part)
        out = model.generate(**batch, max_new_tokens=longest, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)[:, batch["input_ids"].shape[1]:].tolist()
        hits += sum(row[:len(f["target"])] == f["target"] for row, f in zip(out, part))
    return hits / len(features)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="host checkpoint directory (default: a tiny random Granite-4.0 host)")
    p.add_argument("--kind", default="pdssm")
    p.add_argument("--n", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=80)
    p.add_argument("--output-dir", default="runs/cup_swaps")
    p.add_argument("--write-data", action="store_true", help="(re)make examples/data/cup_swaps and exit")
    args = p.parse_args(argv)
    if args.write_data:
        write_data()
        return {}
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

    from llm_surgery.box_data import BoxCollator
    from llm_surgery.insert import insert_layers, load_inserted

    host = Path(args.model) if args.model else tiny_host(Path(tempfile.mkdtemp()) / "host")
    tokenizer = AutoTokenizer.from_pretrained(host)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    train, test = encode_split(tokenizer, "train"), encode_split(tokenizer, "test")
    torch.manual_seed(0)
    model = insert_layers(AutoModelForCausalLM.from_pretrained(host), args.kind, args.n)
    model.config.use_cache = False
    before = exact_match(model, tokenizer, test)  # the inserted layers start as the identity: the host alone
    trainer = Trainer(
        model=model, train_dataset=[{k: f[k] for k in ("input_ids", "labels")} for f in train],
        data_collator=BoxCollator(tokenizer, padding_side="left"),
        args=TrainingArguments(output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=16,
                               learning_rate=5e-3, warmup_steps=8, lr_scheduler_type="cosine", logging_steps=25,
                               save_steps=max(1, args.max_steps // 2), use_cpu=True, report_to=[], seed=0,
                               disable_tqdm=True))
    trainer.train()
    trainer.save_model(Path(args.output_dir) / "final")
    # the way back: a fresh host and the saved layers
    fresh = load_inserted(AutoModelForCausalLM.from_pretrained(host), Path(args.output_dir) / "final")
    result = {"test_exact_match_host_alone": before, "test_exact_match": exact_match(fresh, tokenizer, test),
              "train_loss": trainer.state.log_history[-1].get("train_loss"), "steps": trainer.state.global_step}
    print(json.dumps(result))
    (Path(args.output_dir) / "result.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])

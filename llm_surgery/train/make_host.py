"""Pretrain the Box host that ships with the package (`llm_surgery/data/box_host/`).

    python -m llm_surgery.train.make_host --out llm_surgery/data/box_host --minutes 15   # replaces the shipped host

The host learns the Box *language*, not the task. Its documents are
- a description of the boxes followed by 0-6 operation sentences (`Move the cup from Box 2 to Box 5.`), and
- a description of 1-7 of the boxes followed by the same boxes restated in a random order;
with the loss on every token and an EOS at the end of every document. So it can read a box's contents off a
description (by the box's number) and knows what operations look like, but it has never seen a query, an
answer after operations, or an answer followed by EOS: the inserted layers learn those.

Its documents come from the train split's initial arrangements (count signatures) of data seed 2255 but from
their own random stream (`--doc-seed`), so they share no sequence with the trainer's splits.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

import torch

from .messages import logger, show_messages

# The shipped host's shape: GraniteMoeHybridForCausalLM (the Granite 4.0 class) with four attention layers and
# no Mamba2 layer, like the dense Granite 4.0 models, RoPE, attention scale 1/sqrt(head_dim), plain multipliers.
# Why not a NoPE Mamba2 hybrid: on this budget it never learned to look anything up (see docs/bench/train.md).
SPEC = dict(hidden_size=64, pattern="****", position_embedding_type="rope", attention_multiplier=0.25,
            mamba_chunk_size=64, embedding_multiplier=1.0, residual_multiplier=1.0, logits_scaling=1.0)


def documents(records: list[dict], rng: random.Random, restatements: int = 2) -> list[str]:
    """Per sequence: one description+operations document and `restatements` restatement documents. A restatement
    document describes a random subset of 1-7 of the boxes (in box order, as the full description does) and then
    restates them in a random order: the fewer the boxes, the shorter and easier the lookup (a curriculum mixed
    into every batch)."""
    by_seq: dict[str, list[dict]] = {}
    for r in records:
        by_seq.setdefault(r["sequence_id"], []).append(r)
    docs = []
    for recs in by_seq.values():
        k = rng.randrange(max(r["num_ops"] for r in recs) + 1)
        docs.append(next(r for r in recs if r["num_ops"] == k)["context"].rsplit(" Box ", 1)[0])
        clauses = [f"Box {r['box']}{r['target']}" for r in sorted((r for r in recs if r["num_ops"] == 0),
                                                                   key=lambda r: r["box"])]
        for _ in range(restatements):
            kept = sorted(rng.sample(range(len(clauses)), rng.randint(1, len(clauses))))
            order = rng.sample(kept, len(kept))
            docs.append(", ".join(clauses[b] for b in kept) + ". " + ", ".join(clauses[b] for b in order) + ".")
    rng.shuffle(docs)
    return docs


def language_documents(sequences: int, doc_seed: int, seed: int) -> tuple[list[str], list[str]]:
    """(training documents, held-out full restatements) from `sequences` Box sequences of the train split's
    arrangements (data seed 2255's partition) drawn from their own stream `doc_seed`, so they share no sequence
    with the trainer's splits; the held-out ones come from the validation arrangements."""
    from llm_surgery.box_data import generate_split, signature_partition

    parts = signature_partition(2255)
    train = generate_split("train", sequences, 6, seed=doc_seed, signatures=parts["train"])
    val = generate_split("validation", 100, 6, seed=doc_seed, signatures=parts["validation"])
    rng = random.Random(seed)
    return documents(train, rng), [d for d in documents(val, rng) if is_full_restatement(d)]


def is_full_restatement(doc: str) -> bool:
    """A restatement document over all seven boxes (the held-out measure of what the host learned)."""
    return ". Box " in doc and doc.split(". ", 1)[0].count("Box ") == 7


def encode_docs(tokenizer, docs: list[str]) -> list[list[int]]:
    return [ids + [tokenizer.eos_token_id] for ids in tokenizer(docs, add_special_tokens=False)["input_ids"]]


def _batch(seqs: list[list[int]]) -> dict[str, torch.Tensor]:
    n = -(-max(map(len, seqs)) // 8) * 8
    ids = torch.zeros(len(seqs), n, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


@torch.no_grad()
def restatement_accuracy(model, tokenizer, docs: list[str], batch_size: int = 64) -> float:
    """Share of object tokens predicted right in the restated half of restatement documents (chance ~1%)."""
    from llm_surgery.box_data import COMMON_OBJECTS

    objects = set(tokenizer.convert_tokens_to_ids(list(COMMON_OBJECTS)))
    model.eval()
    hit = total = 0
    for i in range(0, len(docs), batch_size):
        seqs = encode_docs(tokenizer, docs[i:i + batch_size])
        b = {k: v.to(model.device) for k, v in _batch(seqs).items()}
        pred = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False).logits.argmax(-1)
        for row, s in enumerate(seqs):
            half = s.index(tokenizer.convert_tokens_to_ids(".")) + 1  # end of the description
            for t in range(half, len(s) - 1):
                if s[t + 1] in objects:
                    total += 1
                    hit += int(pred[row, t] == s[t + 1])
    model.train()
    return hit / max(total, 1)


def build(seed: int = 0, **overrides):
    from llm_surgery.box_data import build_box_tokenizer
    from llm_surgery.hosts import build_tiny_host

    tokenizer = build_box_tokenizer()
    model = build_tiny_host("granite", seed=seed, vocab_size=len(tokenizer), **{**SPEC, **overrides})
    return model, tokenizer


def shuffled_batches(data: list[list[int]], batch_size: int, seed: int, buckets: int = 1):
    """Endless batches of `batch_size` sequences: one random permutation after another, a batch running on into
    the next permutation where one ends (the shipped host's data order). With `buckets` > 1, each run of
    `buckets` batches is cut from that many batches' sequences sorted by length and comes in a random order: less
    padding (the documents' lengths vary 2x), the same sequences."""
    g, order = random.Random(seed), []
    while True:
        take = batch_size * buckets
        while len(order) < take:
            order += g.sample(range(len(data)), len(data))
        idx, order = order[:take], order[take:]
        if buckets > 1:
            idx.sort(key=lambda i: len(data[i]))
        cuts = [idx[k:k + batch_size] for k in range(0, take, batch_size)]
        for k in (g.sample(range(buckets), buckets) if buckets > 1 else [0]):
            yield _batch([data[i] for i in cuts[k]])


def pretrain_docs(model, tokenizer, docs, eval_docs, *, batch_size: int, lr: float, max_seconds: float,
                  steps: int, seed: int, log=None, eval_every: int = 200, stop_at: int = 0, buckets: int = 1,
                  device: torch.device | str = "cpu", autocast_dtype: torch.dtype | None = None) -> list[dict]:
    """The host pretraining loop on documents (5% warm-up then cosine to 0.1x over `steps`), stopping at
    `max_seconds`; returns the curve of loss and restatement accuracy. `buckets`: `shuffled_batches`'."""
    from .host import train_all_weights

    log = log or logger.info
    curve, t0 = [], time.time()

    def on_eval(step: int, loss: float) -> None:
        acc = restatement_accuracy(model, tokenizer, eval_docs)
        curve.append({"step": step, "seconds": round(time.time() - t0, 1), "loss": round(loss, 4),
                      "restatement_accuracy": round(acc, 4)})
        log(f"  step {step}: restated objects right {100 * acc:.1f}%")

    train_all_weights(model, shuffled_batches(encode_docs(tokenizer, docs), batch_size, seed, buckets), steps=steps,
                      lr=lr, warmup_ratio=0.05, min_lr_ratio=0.1, log=log, log_every=eval_every, on_eval=on_eval,
                      eval_every=eval_every, max_seconds=max_seconds, stop_at=stop_at, device=device,
                      autocast_dtype=autocast_dtype)
    return curve


def parser():
    from llm_surgery.cli import Parser

    from .host import SHIPPED_HOST

    p = Parser(prog="python -m llm_surgery.train.make_host", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True,
                   help="folder to write the host to (required: nothing is written by default); an existing one "
                        f"must hold a host made here, which is replaced. The shipped host is {SHIPPED_HOST}: pass "
                        "that path to replace it")
    p.add_argument("--minutes", type=float, default=15.0, help="wall-clock budget of the pretraining (0 = none)")
    p.add_argument("--steps", type=int, default=3000, help="length of the lr schedule")
    p.add_argument("--stop-at", type=int, default=0, help="stop after this many steps (0 = at --steps)")
    p.add_argument("--batch-size", type=int, default=32, help="documents per step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (every weight trains)")
    p.add_argument("--sequences", type=int, default=12000, help="Box sequences to draw documents from")
    p.add_argument("--doc-seed", type=int, default=1, help="seed of the documents' own random stream")
    p.add_argument("--seed", type=int, default=0, help="seed of the init and the batch order")
    p.add_argument("--spec", default="{}", help="JSON overrides of SPEC (tiny_config fields)")
    p.add_argument("--init", default=None, help="continue from this saved host (a second session); its spec wins")
    p.add_argument("--threads", type=int, default=1, help="torch threads (0 = torch's default)")
    return p


def save_host(out: Path, model, tokenizer, record: dict) -> None:
    """The host, its host.json and SHA256SUMS, written beside `out` and renamed onto it (never half-written)."""
    from .host import HASHES, file_sha256

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "host.json").write_text(json.dumps(record, indent=2))
    (tmp / HASHES).write_text("".join(f"{file_sha256(f)}  {f.name}\n" for f in sorted(tmp.iterdir())))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def check_args(args) -> None:
    """Refuse, before any work: an --out that exists and is not a host made here (save_host replaces the whole
    folder), and an --init that is not one."""
    from llm_surgery.cli import json_object

    from .config import UsageError

    out = Path(args.out)
    if out.exists() and not (out / "host.json").is_file() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"--out {out} exists and holds no host made by make_host (no host.json); it would be "
                         "replaced as a whole: pass a new or empty folder")
    if args.init and not (Path(args.init) / "host.json").is_file():
        raise UsageError(f"--init {args.init} is not a host made by make_host (no host.json)")
    if args.minutes < 0 or args.steps < 1 or args.batch_size < 1 or args.sequences < 1 or not args.lr > 0:
        raise UsageError("--minutes must be >= 0, --steps, --batch-size and --sequences >= 1, --lr > 0")
    json_object(args.spec, "--spec", UsageError)


def main(argv: list[str] | None = None) -> None:
    from .config import UsageError

    p = parser()
    args = p.parse_args(argv)
    try:
        check_args(args)
    except UsageError as e:
        p.error(str(e))
    show_messages()
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.time()
    docs, eval_docs = language_documents(args.sequences, args.doc_seed, args.seed)
    logger.info(f"{len(docs)} documents ({time.time() - t0:.0f} s); {len(eval_docs)} held-out restatements")
    spec = {**SPEC, **json.loads(args.spec)}
    model, tokenizer = build(args.seed, **spec)
    before = []
    if args.init:
        from .host import load_pretrained

        model, tokenizer = load_pretrained(args.init, torch.float32, torch.device("cpu"))
        previous = json.loads((Path(args.init) / "host.json").read_text())
        spec, before = previous["spec"], previous.get("sessions", [previous])
    n = sum(p.numel() for p in model.parameters())
    logger.info(f"host: GraniteMoeHybridForCausalLM {spec}, {n:,} parameters")
    t1 = time.time()
    curve = pretrain_docs(model, tokenizer, docs, eval_docs[:200], batch_size=args.batch_size, lr=args.lr,
                          max_seconds=60 * args.minutes or float("inf"), steps=args.steps, seed=args.seed,
                          stop_at=args.stop_at)
    seconds = time.time() - t1
    record = {"architecture": "GraniteMoeHybridForCausalLM", "spec": spec, "parameters": n,
              "documents": len(docs), "sequences": args.sequences, "doc_seed": args.doc_seed, "seed": args.seed,
              "batch_size": args.batch_size, "lr": args.lr, "schedule_steps": args.steps,
              "steps_done": curve[-1]["step"], "seconds": round(seconds), "threads": torch.get_num_threads(),
              "device": "cpu", "torch": torch.__version__, "date": time.strftime("%Y-%m-%d", time.gmtime()),
              "curve": curve, "command": "python -m llm_surgery.train.make_host " + " ".join(argv or sys.argv[1:])}
    record["sessions"] = [*before, {k: v for k, v in record.items() if k != "sessions"}]
    out = Path(args.out)
    save_host(out, model, tokenizer, record)
    logger.info(f"saved {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e6:.1f} MB) after {seconds:.0f} s")

if __name__ == "__main__":
    main()

"""Command line: `python -m llm_surgery.box_data {generate,score}` (also the `llm-surgery-box` script)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from . import generate as gen
from .files import iter_jsonl, prepare_output_dir, read_jsonl, write_splits


def _parser() -> argparse.ArgumentParser:
    from llm_surgery.cli import Parser

    p = Parser(prog="llm-surgery-box", description="Extended Box state-tracking dataset.")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="write train/validation/test JSON Lines and a dataset card")
    g.add_argument("--out", required=True, help="output directory")
    g.add_argument("--seed", type=int, default=gen.DEFAULT_SEED)
    sizes = g.add_mutually_exclusive_group()
    sizes.add_argument("--num-sequences", type=int, default=gen.DEFAULT_NUM_SEQUENCES,
                       help="total sampled sequences, cut 60/10/30 into train/validation/test (each split "
                            "needs one: at least 4)")
    sizes.add_argument("--split-sequences", type=int, nargs=3, metavar=("TRAIN", "VALIDATION", "TEST"),
                       help="sequences per split instead of --num-sequences (0 leaves a split out on purpose)")
    g.add_argument("--train-max-ops", type=int, default=gen.DEFAULT_TRAIN_MAX_OPS,
                   help="operations per train/validation sequence (contexts hold 0..this many)")
    g.add_argument("--test-max-ops", type=int, default=gen.DEFAULT_TEST_MAX_OPS,
                   help="operations per test sequence (contexts hold 0..this many)")
    g.add_argument("--disjoint-vocab", action="store_true",
                   help="also write test_disjoint_vocab.jsonl, drawn with 100 rare nouns")
    g.add_argument("--overwrite", action="store_true", help="replace existing output files")
    g.add_argument("--no-progress", action="store_true", help="hide the progress bars")

    s = sub.add_parser("score", help="accuracy of predicted completions against a split file")
    s.add_argument("--data", required=True, help="a split .jsonl written by `generate`")
    s.add_argument("--predictions", required=True,
                   help='JSON Lines: {"id": ..., "prediction": ...} per line, joined on id (every record needs '
                        'one line; duplicate or unknown ids are errors); or, with no id on any line, '
                        '{"prediction": ...} / a bare JSON string per line, aligned with --data by position '
                        '(the counts must match)')
    s.add_argument("--train-max-ops", type=int, default=gen.DEFAULT_TRAIN_MAX_OPS,
                   help="contexts with more operations count as OOD")
    s.add_argument("--out", help="also write the metrics JSON here")
    return p


def _generate(args) -> None:
    num = dict(zip(gen.SPLITS, args.split_sequences)) if args.split_sequences else args.num_sequences
    sizes = gen.check_generation_args(num, args.seed, args.train_max_ops, args.test_max_ops)
    empty = [s for s in gen.SPLITS if not sizes[s]]
    if empty and not args.split_sequences:
        raise ValueError(f"--num-sequences {args.num_sequences} gives no {' or '.join(empty)} sequence (cut "
                         "60/10/30): pass at least 4, or --split-sequences to choose each split's size")
    names = list(gen.SPLITS) + ([gen.DISJOINT_SPLIT] if args.disjoint_vocab else [])
    prepare_output_dir(args.out, names, args.overwrite)
    t0 = time.perf_counter()
    splits = gen.generate_splits(sizes, args.seed, args.train_max_ops, args.test_max_ops, args.disjoint_vocab,
                                 progress=not args.no_progress)
    params = {"seed": args.seed, "sequences": sizes, "train_max_ops": args.train_max_ops,
              "validation_max_ops": args.train_max_ops, "test_max_ops": args.test_max_ops,
              "disjoint_vocab": args.disjoint_vocab}
    paths = write_splits(args.out, splits, overwrite=True, params=params)
    for name in names:
        print(f"{name}: {len(splits[name])} examples -> {paths[name]}")
    print(f"card: {paths['card']} ({time.perf_counter() - t0:.1f} s)")


def _load_predictions(path: str):
    """{id: prediction} when any line carries an id (then every line must, once), else the list in file order."""
    rows = list(iter_jsonl(path))
    with_id = [n for n, r in rows if isinstance(r, dict) and "id" in r]
    by_id, line_of, plain = {}, {}, []
    for n, r in rows:
        where = f"{path}, line {n}"
        pred = r.get("prediction") if isinstance(r, dict) else r
        if not isinstance(pred, str):
            raise ValueError(f"{where}: expected a JSON string or an object with a string 'prediction'")
        if not with_id:
            plain.append(pred)
            continue
        rid = r.get("id") if isinstance(r, dict) else None
        if not isinstance(rid, str):
            raise ValueError(f"{where}: needs a string 'id' (line {with_id[0]} has one: give every line an id, "
                             "or none to align by position)")
        if rid in line_of:
            raise ValueError(f"{where}: duplicate id {rid!r} (also on line {line_of[rid]})")
        line_of[rid], by_id[rid] = n, pred
    return by_id if with_id else plain


def _score(args) -> None:
    from .score import check_records, score

    if args.out and Path(args.out).is_dir():
        raise ValueError(f"--out {args.out} is a directory; give a file path for the metrics JSON")
    records = read_jsonl(args.data)
    try:
        check_records(records)
    except ValueError as e:
        raise ValueError(f"{args.data}: {e}") from None
    metrics = score(records, _load_predictions(args.predictions), args.train_max_ops)
    text = json.dumps(metrics, indent=2)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    print(text)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        (_generate if args.command == "generate" else _score)(args)
    except (ValueError, TypeError) as e:
        parser.exit(2, f"{parser.prog} {args.command}: error: {e}\n")
    except OSError as e:   # a missing file, a directory given for a file, no permission: one line, no traceback
        msg = f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e)
        parser.exit(2, f"{parser.prog} {args.command}: error: {msg}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

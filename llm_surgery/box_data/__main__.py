"""Command line: `python -m llm_surgery.box_data {generate,score}` (also the `llm-surgery-box` script)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from . import generate as gen
from .files import prepare_output_dir, read_jsonl, write_splits


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llm-surgery-box", description="Extended Box state-tracking dataset.")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="write train/validation/test JSON Lines and a dataset card")
    g.add_argument("--out", required=True, help="output directory")
    g.add_argument("--seed", type=int, default=gen.DEFAULT_SEED)
    sizes = g.add_mutually_exclusive_group()
    sizes.add_argument("--num-sequences", type=int, default=gen.DEFAULT_NUM_SEQUENCES,
                       help="total sampled sequences, cut 60/10/30 into train/validation/test "
                            f"(default {gen.DEFAULT_NUM_SEQUENCES})")
    sizes.add_argument("--split-sequences", type=int, nargs=3, metavar=("TRAIN", "VALIDATION", "TEST"),
                       help="sequences per split instead of --num-sequences")
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
                   help='JSON Lines: {"id": ..., "prediction": ...} per line (joined on id), or '
                        '{"prediction": ...} / a bare JSON string per line, aligned with --data')
    s.add_argument("--train-max-ops", type=int, default=gen.DEFAULT_TRAIN_MAX_OPS,
                   help="contexts with more operations count as OOD")
    s.add_argument("--out", help="also write the metrics JSON here")
    return p


def _generate(args) -> None:
    num = dict(zip(gen.SPLITS, args.split_sequences)) if args.split_sequences else args.num_sequences
    sizes = gen.check_generation_args(num, args.seed, args.train_max_ops, args.test_max_ops)
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
    rows = read_jsonl(path)
    if rows and all(isinstance(r, dict) and "id" in r for r in rows):
        return {r["id"]: r["prediction"] for r in rows}
    preds = []
    for i, r in enumerate(rows):
        if isinstance(r, dict) and "prediction" in r:
            r = r["prediction"]
        if not isinstance(r, str):
            raise ValueError(f"{path}, line {i + 1}: expected a string or an object with 'prediction'")
        preds.append(r)
    return preds


def _score(args) -> None:
    from .score import score

    metrics = score(read_jsonl(args.data), _load_predictions(args.predictions), args.train_max_ops)
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
    except (ValueError, TypeError, FileExistsError, FileNotFoundError) as e:
        parser.exit(2, f"{parser.prog} {args.command}: error: {e}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

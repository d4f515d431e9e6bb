"""How fast the Box dataset is made: in-memory generation, writing JSON Lines, and word-level tokenization.

    python bench/box_data_speed.py [--num-sequences 1000] [--repeats 3]

Prints the machine, the date and examples/s (best of --repeats); the results go to BENCHMARKS.md.
"""

import argparse
import os
import platform
import sys
import tempfile
import time
from datetime import datetime, timezone

from llm_surgery.box_data import build_box_tokenizer, encode_records, generate_splits, write_splits


def best_time(fn, repeats):
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return min(times), result


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-sequences", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}")
    print(f"machine: {cpu}, {os.cpu_count()} logical CPUs, Python {sys.version.split()[0]}, {platform.system()}")
    print(f"num_sequences: {args.num_sequences}, best of {args.repeats}")

    for disjoint in (False, True):
        secs, splits = best_time(lambda: generate_splits(args.num_sequences, disjoint_vocab=disjoint), args.repeats)
        n = sum(len(v) for v in splits.values())
        print(f"generate_splits(disjoint_vocab={disjoint}): {n} examples in {secs:.2f} s = {n / secs:,.0f} ex/s")

    with tempfile.TemporaryDirectory() as d:
        secs, _ = best_time(lambda: write_splits(d, splits, overwrite=True), args.repeats)
        size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
    print(f"write_splits: {n} examples, {size / 2**20:.0f} MiB in {secs:.2f} s = {n / secs:,.0f} ex/s")

    tok = build_box_tokenizer()
    train = splits["train"]
    secs, enc = best_time(lambda: encode_records(tok, train), args.repeats)
    tokens = sum(len(e["input_ids"]) for e in enc)
    longest = max(len(e["input_ids"]) for e in encode_records(tok, splits["test"]))
    print(f"encode_records (word-level tokenizer, train): {len(train)} examples, {tokens} tokens in {secs:.2f} s "
          f"= {len(train) / secs:,.0f} ex/s; longest test example {longest} tokens")


if __name__ == "__main__":
    main()

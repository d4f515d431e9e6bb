"""What the inserted Flash PD-SSM layers of finished runs do on the test split: dictionary use, permutations and
how long their state entries remember (`llm_surgery.insert.probe.SelectionProbe`), one row per run and layer.

    python bench/pdssm_probe.py runs/latest [more run dirs]      # CPU or GPU, the runs' own settings
"""

from __future__ import annotations

import argparse

from llm_surgery.insert.probe import SelectionProbe
from llm_surgery.train.evaluate import evaluate_run


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="finished run dirs (config.json + final/) with inserted pdssm layers")
    ap.add_argument("--split", default="test")
    args = ap.parse_args(argv)
    rows = []
    print("| run | layer | tokens a head | members used (of K) | top member | entropy bits (max) | permutations | "
          "identities | destinations (of N) | entries surviving 16 tokens / a sequence | half-life median, tokens | "
          "half-life >= 64 |")
    print("|---" * 12 + "|")
    probes = []   # one per run, made inside evaluate_run around its model

    def probe(model):
        probes.append(SelectionProbe(model))
        return probes[-1]

    for run in args.runs:
        result = evaluate_run(run, args.split, within=probe)
        for layer, s in probes[-1].summary().items():
            rows.append({"run": run, "layer": layer, "iid": result["iid"]["accuracy"],
                         "ood": result["ood"]["accuracy"], **s})
            if not s["tokens"]:
                print(f"| {run} | {layer} | 0 | - | - | - | - | - | - | - | - | - |")
                continue
            lo, hi = s["halflife_median_tokens"]
            K = round(2 ** s["max_entropy_bits"])
            print(f"| {run} | {layer} | {s['tokens']} | {s['members_used']:.1f} ({K}) | "
                  f"{100 * s['top_member_share']:.0f}% | {s['entropy_bits']:.2f} ({s['max_entropy_bits']:.2f}) | "
                  f"{100 * s['permutation_share']:.0f}% | {100 * s['identity_share']:.0f}% | "
                  f"{s['mean_destinations']:.1f} ({s['state_size']}) | {s['surviving_16_tokens']:.1f} / "
                  f"{s['surviving_sequence']:.1f} | {lo:g}-{hi:g} | "
                  f"{100 * s['halflife_64_share']:.0f}% |", flush=True)
    return rows


if __name__ == "__main__":
    main()

"""What the inserted layers of finished runs do, on the test split: what their memory adds (evaluated again as
trained and with every inserted mixer seeing each token alone, `llm_surgery.insert.ablation.tokens_alone`: no
recurrent state, no convolution over earlier tokens), and for Flash PD-SSM layers what they select and how long
they remember (`llm_surgery.insert.probe.SelectionProbe`, recorded during the as-trained evaluation).

    python bench/state_ablation.py runs/latest [more run dirs]      # CPU or GPU, the runs' own settings
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from llm_surgery.insert.ablation import tokens_alone
from llm_surgery.insert.probe import SelectionProbe
from llm_surgery.train.evaluate import evaluate_run


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="finished run dirs (config.json + final/)")
    ap.add_argument("--split", default="test")
    args = ap.parse_args(argv)
    rows, probes = [], []

    def probe(model):   # made inside evaluate_run, around its model
        probes.append(SelectionProbe(model))
        return probes[-1]

    print("| run | kind | IID as trained | IID tokens alone | OOD as trained | OOD tokens alone |")
    print("|---|---|---|---|---|---|")
    for run in args.runs:
        kind = json.loads((Path(run) / "config.json").read_text())["kind"]
        has_pdssm = "pdssm" in kind.split("+")
        full = evaluate_run(run, args.split, within=probe if has_pdssm else None)
        alone = evaluate_run(run, args.split, within=tokens_alone)
        row = {"run": run, "kind": kind, **{f"{s}_{name}": 100 * r[s]["accuracy"] for name, r in
                                             (("trained", full), ("alone", alone)) for s in ("iid", "ood")},
               "pdssm_layers": probes[-1].summary() if has_pdssm else {}}
        rows.append(row)
        print(f"| {run} | {kind} | {row['iid_trained']:.1f} | {row['iid_alone']:.1f} | {row['ood_trained']:.1f} | "
              f"{row['ood_alone']:.1f} |", flush=True)
    if any(row["pdssm_layers"] for row in rows):
        print_probes(rows)
    return rows


def print_probes(rows: list[dict]) -> None:
    print("\n| run | layer | tokens a head | members used (of K) | top member | entropy bits (max) | permutations | "
          "identities | destinations (of N) | entries surviving 16 tokens / a sequence | half-life median, tokens | "
          "half-life >= 64 |")
    print("|---" * 12 + "|")
    for row in rows:
        for layer, s in row["pdssm_layers"].items():
            if not s["tokens"]:
                print(f"| {row['run']} | {layer} | 0 | - | - | - | - | - | - | - | - | - |")
                continue
            lo, hi = s["halflife_median_tokens"]
            K = round(2 ** s["max_entropy_bits"])
            print(f"| {row['run']} | {layer} | {s['tokens']} | {s['members_used']:.1f} ({K}) | "
                  f"{100 * s['top_member_share']:.0f}% | {s['entropy_bits']:.2f} ({s['max_entropy_bits']:.2f}) | "
                  f"{100 * s['permutation_share']:.0f}% | {100 * s['identity_share']:.0f}% | "
                  f"{s['mean_destinations']:.1f} ({s['state_size']}) | {s['surviving_16_tokens']:.1f} / "
                  f"{s['surviving_sequence']:.1f} | {lo:g}-{hi:g} | {100 * s['halflife_64_share']:.0f}% |")


if __name__ == "__main__":
    main()

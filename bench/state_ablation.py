"""What the inserted layers' memory adds: evaluate finished runs again, as trained and with every inserted mixer
seeing each token alone (`llm_surgery.insert.ablation.tokens_alone`: no recurrent state, no convolution over
earlier tokens), and print test exact match side by side.

    python bench/state_ablation.py runs/latest [more run dirs]      # CPU or GPU, the runs' own settings
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from llm_surgery.insert.ablation import tokens_alone
from llm_surgery.train.evaluate import evaluate_run


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="finished run dirs (config.json + final/)")
    ap.add_argument("--split", default="test")
    args = ap.parse_args(argv)
    rows = []
    print("| run | kind | IID as trained | IID tokens alone | OOD as trained | OOD tokens alone |")
    print("|---|---|---|---|---|---|")
    for run in args.runs:
        kind = json.loads((Path(run) / "config.json").read_text())["kind"]
        full, alone = evaluate_run(run, args.split), evaluate_run(run, args.split, within=tokens_alone)
        row = {"run": run, "kind": kind, **{f"{s}_{name}": 100 * r[s]["accuracy"] for name, r in
                                             (("trained", full), ("alone", alone)) for s in ("iid", "ood")}}
        rows.append(row)
        print(f"| {run} | {kind} | {row['iid_trained']:.1f} | {row['iid_alone']:.1f} | {row['ood_trained']:.1f} | "
              f"{row['ood_alone']:.1f} |", flush=True)
    return rows


if __name__ == "__main__":
    main()

"""Accuracy against the number of transitions (Box operations in the context), one line per run.

    python -m llm_surgery.train.plot runs/pdssm runs/mamba2 -o compare.png

Each argument is a run directory (holding results.json) or a results JSON file.
"""

from __future__ import annotations

import json
from pathlib import Path


def load_results(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist (pass the --output-dir of a finished run, or its results "
                                "JSON file)")
    file = path / "results.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no results file at {file}: {path} holds no finished run (pass the --output-dir of "
                                "a finished run, or its results JSON file)")
    try:
        results = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file} is not a results JSON file ({e})") from None
    if not isinstance(results, dict) or "by_num_ops" not in (results.get("test") or {}):
        raise ValueError(f"{file} is not a trainer results file (no test.by_num_ops)")
    results.setdefault("label", f"{results.get('kind', '?')} ({path.name if path.is_dir() else path.stem})")
    return results


def plot_accuracy(runs: list[dict], out: str | Path, title: str | None = None) -> Path:
    """Write a PNG with one accuracy-vs-transitions line per results dict; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not runs:
        raise ValueError("plot_accuracy needs at least one run")
    fig, ax = plt.subplots(figsize=(7, 4))
    train_max = None
    for res in runs:
        by = res["test"]["by_num_ops"]
        xs = sorted(int(k) for k in by)
        ys = [100 * (by[str(x)] if str(x) in by else by[x])["accuracy"] for x in xs]
        ax.plot(xs, ys, marker="o", markersize=3, label=res.get("label", res.get("kind", "?")))
        train_max = res["test"].get("train_max_ops", train_max)
    if train_max is not None:
        ax.axvline(train_max + 0.5, color="gray", linestyle="--", linewidth=1)
        ax.text(train_max + 0.7, 2, "OOD", color="gray")
    ax.set_xlabel("number of transitions (operations in the context)")
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(0, 101)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title or "Box state tracking")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_run(results: dict, out: str | Path) -> Path:
    """A trainer run's plot: the host alone (when evaluated) and host + inserted layers."""
    label = f"+ {results.get('n', '?')} x {results.get('kind', '?')}"
    runs = [{**results, "label": label}]
    if results.get("host_alone"):
        runs.insert(0, {"test": results["host_alone"], "label": "host alone"})
    return plot_accuracy(runs, out)


def main(argv: list[str] | None = None) -> None:
    from llm_surgery.cli import Parser

    parser = Parser(prog="python -m llm_surgery.train.plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run directories (--output-dir of a finished run) or results JSON "
                                                "files")
    parser.add_argument("-o", "--output", default="accuracy_vs_transitions.png", help="the PNG to write")
    parser.add_argument("--title", default=None, help="the plot's title; none = 'Box state tracking'")
    args = parser.parse_args(argv)
    try:  # every run is read before anything is written
        runs = [load_results(r) for r in args.runs]
    except (OSError, ValueError) as e:
        parser.error(str(e))
    print(plot_accuracy(runs, args.output, args.title))


if __name__ == "__main__":
    main()

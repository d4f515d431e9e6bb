"""Timing-only bounds of the warp forward: how fast it would run without parts of its work (outputs are wrong).

Writes two variants of kernels/pd_scan.cu for bench/kernel_ab.sh, each by a few checked text edits:
  bench/variants/p1only/   no look-back: every chunk starts from a zero state (no wait, no links, no
                           application of other chunks); its replay and repair run as kept
  bench/variants/p1norep/  phase 1 alone: no look-back, no replay, no repair
Then time them beside the kept kernel on one machine (GPU; docs/bench/kernels.md, session 28):

    PYTHONPATH=. python bench/pd_scan_bounds.py && VARS="cur p1only p1norep" bash bench/kernel_ab.sh time prof

What p1norep reaches bounds any kernel that keeps phase 1 as it is: the look-back, the replay and the repair
can only add to it.
"""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

NO_LOOKBACK = [
    ("const bool links = kLinks && a.T >= 16;", "const bool links = false;   // TIMING ONLY: no look-back"),
    ("const int jb = look_back(flags + static_cast<size_t>(q) * C, c - 1, -1, C);", "const int jb = c - 1;"),
    ("st[j] = live(j) ? entering_state<A>(a, q, jb + 1, lane + 32 * j) : zero_v<A>();", "st[j] = zero_v<A>();"),
]
NO_TAIL = NO_LOOKBACK + [
    ("  for_each_step(logged ? kc : Tc, [&]", "  for_each_step(0, [&]"),
    ("    repair(x);\n", ""),
]


def variant(src: str, edits) -> str:
    for old, new in edits:
        if src.count(old) != 1:
            raise SystemExit(f"pd_scan_bounds: the kernel changed, {old!r} is not there once; update the edits")
        src = src.replace(old, new)
    return src


def main():
    src = (ROOT / "kernels" / "pd_scan.cu").read_text()
    for name, edits in (("p1only", NO_LOOKBACK), ("p1norep", NO_TAIL)):
        out = ROOT / "bench" / "variants" / name
        out.mkdir(parents=True, exist_ok=True)
        (out / "pd_scan.cu").write_text(variant(src, edits))
        print(f"wrote {out / 'pd_scan.cu'}")


if __name__ == "__main__":
    main()

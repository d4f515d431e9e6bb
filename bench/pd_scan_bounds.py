"""Timing-only bounds of the warp forward: how fast it would run without parts of its work (outputs are wrong).

Writes variants of kernels/pd_scan.cu for bench/kernel_ab.sh, each by a few checked text edits:
  bench/variants/p1only/   no look-back: every chunk starts from a zero state (no wait, no links, no
                           application of other chunks); its replay and repair run as kept
  bench/variants/p1norep/  phase 1 alone: no look-back, no replay, no repair
  bench/variants/p1ideal/  p1norep with an ideal exchange: each step's scatter is one conflict-free 16-byte store
                           and one conflict-free load per entry (no list build, no heads, no walk), the least any
                           exchange of the state through shared memory can cost in this kernel
  bench/variants/p1noxchg/ p1norep with no exchange at all (an entry adds its own value): what is left is the
                           step's device-memory loads and stores, its arithmetic and the aggregate's tracking
  bench/variants/p1round1/ p1norep whose walk stops after its first round (the lists built, their heads read)
  bench/variants/p1atomics/ p1ideal with the lists' build kept (its shared-memory atomics)
  bench/variants/p1io/     p1noxchg whose logged steps only store their outputs (no log, no merges)
  bench/variants/*_l2pf/   p1norep, p1io with every form's rows prefetched into L2 three steps ahead in every
                           launch (the kept kernel: bf16 only, and only in launches without a log)
Then time any of them (names in VARS) beside the kept kernel on one machine (GPU; docs/bench/kernels.md,
sessions 28-29), for example:

    PYTHONPATH=. python bench/pd_scan_bounds.py && VARS="cur p1norep p1ideal p1noxchg" bash bench/kernel_ab.sh time

What p1norep reaches bounds any kernel that keeps phase 1 as it is: the look-back, the replay and the repair
can only add to it. p1ideal bounds any warp kernel of this shape whatever its scatter, and p1noxchg one with a
free scatter.
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
# pieces of scatter_step's lists: their build a step ahead (shared-memory atomics), the heads read and reset (here:
# another lane's slot instead), and the walk's rounds after the first
_NO_BUILD = [("    if (k + 1 < n) build(par ^ 1, pn, lk);\n", "")]
_NO_HEADS = [("      h[j] = hd[lane + 32 * j];\n      hd[lane + 32 * j] = NUL;\n",
              "      h[j] = slot_off(par, ((lane + 1) & 31) + 32 * j);   // TIMING ONLY: another lane's slot\n")]
_ONE_ROUND = [("      acc[j] = addv(cur.b[j], s.v);\n      h[j] = s.link;\n      more |= h[j] != NUL;\n",
               "      acc[j] = addv(cur.b[j], s.v);\n")]
IDEAL_EXCHANGE = NO_TAIL + _NO_BUILD + _NO_HEADS + _ONE_ROUND
ROUND1 = NO_TAIL + [("    while (more) {\n", "    while (false && more) {   // TIMING ONLY: one round\n")]
ATOMICS = NO_TAIL + _NO_HEADS + _ONE_ROUND
NO_EXCHANGE = IDEAL_EXCHANGE + [
    ("    for (int j = 0; j < E; ++j) put_slot(slots + par * M + lane + 32 * j, val[j], lk[j]);\n",
     "    for (int j = 0; j < E; ++j) lk[j] = 0;   // TIMING ONLY: no exchange\n"),
    ("      const Slot s = *reinterpret_cast<const Slot*>(smem + h[j]);\n      acc[j] = addv(cur.b[j], s.v);\n",
     "      acc[j] = addv(cur.b[j], val[j]);\n"),
]
NO_LOG = NO_EXCHANGE + [
    ("    const int cnt = lg & 63, loff = lg >> 16;\n    const bool src = lane < cnt;\n",
     "    if (lg > 0) return;   // TIMING ONLY: outputs only\n    const int cnt = lg & 63, loff = lg >> 16;\n"
     "    const bool src = lane < cnt;\n"),
]
L2_PREFETCH = [
    ("    constexpr int l2_ahead = (sizeof(In) == 2 && E <= 4) ? 3 : 0;\n", "    constexpr int l2_ahead = 3;\n"),
    ("    if (l2_ahead > 0 && a.rcap == 0 && k + l2_ahead < Tc) {\n", "    if (k + l2_ahead < Tc) {\n"),
]
VARIANTS = {"p1only": NO_LOOKBACK, "p1norep": NO_TAIL, "p1ideal": IDEAL_EXCHANGE, "p1noxchg": NO_EXCHANGE,
            "p1round1": ROUND1, "p1atomics": ATOMICS,
            "p1io": NO_LOG, "p1norep_l2pf": NO_TAIL + L2_PREFETCH, "p1io_l2pf": NO_LOG + L2_PREFETCH}


def variant(src: str, edits) -> str:
    for old, new in edits:
        if src.count(old) != 1:
            raise SystemExit(f"pd_scan_bounds: the kernel changed, {old!r} is not there once; update the edits")
        src = src.replace(old, new)
    return src


def main():
    src = (ROOT / "kernels" / "pd_scan.cu").read_text()
    for name, edits in VARIANTS.items():
        out = ROOT / "bench" / "variants" / name
        out.mkdir(parents=True, exist_ok=True)
        (out / "pd_scan.cu").write_text(variant(src, edits))
        print(f"wrote {out / 'pd_scan.cu'}")


if __name__ == "__main__":
    main()

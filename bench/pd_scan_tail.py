"""Where the warp forward's time goes past the average chunk (clock64 probes, one H100/H200 launch per case):
per-SM busy spans, phase means and tails, and the chunks that end last. The kernel ends with its slowest
chunk, and in one wave the chunks late in a sequence look back the furthest (docs/bench/kernels.md, session 16).

    PYTHONPATH=.:bench python bench/pd_scan_tail.py
"""
import torch

from cuda_timing import median_ms
from pd_scan_bench import chunk_phases, fwd_fn, inputs_for, profiled_launch

S, N = 32, 128


def stats(v):
    return f"mean {v.mean():.0f} p50 {v.median():.0f} p99 {v.quantile(0.99):.0f} max {v.max():.0f}"


def main():
    for kind, L in [("c64", 16384), ("split_bf16", 16384), ("c64", 8192), ("c64", 2048)]:
        f = fwd_fn(kind, inputs_for(kind, S, L, N, 1)[0], None, "warp")
        ms = median_ms(f)
        pr, C, T = profiled_launch(f)
        ph = chunk_phases(pr)
        slow, life, wait, apply = ph["slow"], ph["life"], ph["wait"], ph["apply"]
        sm = pr[:, 7]
        spans, last, offs = [], [], []
        for m in sm.unique():   # clock64 is per SM: compare chunks only within one
            sel = torch.nonzero(sm == m).flatten()
            spans.append(pr[sel, 5].max() - pr[sel, 0].min())
            last.append(sel[pr[sel, 5].argmax()])
            offs.append(pr[sel, 0] - pr[sel, 0].min())
        last = torch.stack(last)
        print(f"== {kind} L={L} T={T} C={C} chunks={pr.shape[0]} one eager call {ms:.4f} ms "
              "(median; the launch and the wrapper's allocations included)")
        print(f"  SM busy span (cycles): {stats(torch.stack(spans))}")
        print(f"  lifetime {stats(life)}")
        print(f"  phase 1 {stats(ph['phase1'][slow])}")
        print(f"  wait {stats(wait[slow])}")
        print(f"  apply {stats(apply[slow])}")
        print(f"  replay {stats(ph['replay'])}")
        if ph["logged"].any():
            print(f"  repair (the {100 * ph['logged'].float().mean():.0f}% of chunks logged) "
                  f"{stats(ph['repair'][ph['logged']])}")
        print(f"  look-back distance {stats(pr[slow, 6])}")
        print(f"  start offset within an SM {stats(torch.cat(offs))}")
        print(f"  last chunk on each SM: lifetime {stats(life[last])}; apply {stats(apply[last])}; "
              f"distance {stats(pr[last, 6])}")
        chunk = torch.arange(pr.shape[0]) // S   # tickets are chunk-major
        for lo, hi in [(0, C // 4), (C // 4, C // 2), (C // 2, 3 * C // 4), (3 * C // 4, C)]:
            sel = (chunk >= lo) & (chunk < hi)
            print(f"  chunks {lo}-{hi - 1}: lifetime mean {life[sel].mean():.0f} max {life[sel].max():.0f}, "
                  f"apply mean {apply[sel].mean():.0f}, wait mean {wait[sel].mean():.0f}")


if __name__ == "__main__":
    main()

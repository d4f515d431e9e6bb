"""The SASS lines that cost the most, from Nsight Compute's per-instruction source page (CSV):

    ncu --kernel-name regex:pd_fwd_warp --launch-skip 1 --launch-count 1 --section SourceCounters \
        --section WarpStateStats --page source --print-source sass --csv \
        python bench/pd_scan_ncu.py 16384 c64 warp > src.csv
    python bench/ncu_source_top.py src.csv[.gz]
"""
import csv
import gzip
import sys

from sass_loops import opcode


def main(path):
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        rows = list(csv.reader(f))
    k = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    hdr = rows[k]
    data = [r for r in rows[k + 1:] if len(r) == len(hdr)]
    col = {h: i for i, h in enumerate(hdr)}

    def num(r, h):
        try:
            return float(r[col[h]].replace(",", ""))
        except ValueError:
            return 0.0

    wf, stall, inst = "L1 Wavefronts Shared", "Warp Stall Sampling (All Samples)", "Instructions Executed"
    tot_wf, tot_stall = sum(num(r, wf) for r in data), sum(num(r, stall) for r in data)
    print(f"{len(data)} SASS lines; {sum(num(r, inst) for r in data):.0f} warp instructions; "
          f"{tot_wf:.0f} shared-memory wavefronts; {tot_stall:.0f} stall samples")
    print("\nby shared-memory wavefronts: share, wavefronts per instruction (ideal), stall share, SASS")
    for r in sorted(data, key=lambda r: -num(r, wf))[:16]:
        n = max(1.0, num(r, inst))
        print(f"  {100 * num(r, wf) / tot_wf:5.1f}%  {num(r, wf) / n:4.2f} ({num(r, wf + ' Ideal') / n:4.2f})  "
              f"{100 * num(r, stall) / tot_stall:4.1f}%  {r[1].strip()[:60]}")
    print("\nby stall samples: share, short / long scoreboard samples, executions, SASS")
    for r in sorted(data, key=lambda r: -num(r, stall))[:16]:
        print(f"  {100 * num(r, stall) / tot_stall:4.1f}%  {num(r, 'stall_short_sb'):6.0f} "
              f"{num(r, 'stall_long_sb'):6.0f}  {num(r, inst):9.0f}  {r[1].strip()[:60]}")
    print("\nby opcode (moves together): share of the warp instructions executed")
    ops = {}
    for r in data:
        op = opcode(r[1])
        op = "MOV" if "MOV" in op else op.split(".")[0]
        ops[op] = ops.get(op, 0.0) + num(r, inst)
    tot_inst = sum(ops.values())
    print("  " + "  ".join(f"{k} {100 * v / tot_inst:.1f}%" for k, v in sorted(ops.items(), key=lambda x: -x[1])[:14]))


if __name__ == "__main__":
    main(sys.argv[1])

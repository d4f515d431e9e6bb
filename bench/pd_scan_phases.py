"""The warp forward's phases per form: clock64 means per chunk (phase 1, look-back wait, apply, replay, repair of the
logged chunks, life), B=32, N=128, on the GPU. A quicker view than pd_scan_bench.py's anatomy table, and for all
five calling forms.

usage: PYTHONPATH=.:bench python bench/pd_scan_phases.py NAME [L,L,...] [form,form,...]
       (NAME labels the rows, e.g. a variant's name in bench/kernel_ab.sh; default L 8192,16384, all forms)
"""
import sys

from pd_scan_bench import chunk_phases, probe_forward

S, N = 32, 128
name = sys.argv[1] if len(sys.argv) > 1 else "cur"
Ls = [int(v) for v in sys.argv[2].split(",")] if len(sys.argv) > 2 else [8192, 16384]
kinds = sys.argv[3].split(",") if len(sys.argv) > 3 else ["c64", "split_f32", "split_bf16", "f32", "bf16"]
for L in Ls:
    for kind in kinds:
        pr, C, T = probe_forward(kind, S, L, N)
        ph = chunk_phases(pr)
        sl, lg = ph["slow"], ph["logged"]
        m = lambda v: f"{v.double().mean().item():8.0f}" if v.numel() else "       -"
        print(f"{name:5s} {kind:10s} L={L:5d} T={T} phase1 {m(ph['phase1'][sl])} wait {m(ph['wait'][sl])} "
              f"apply {m(ph['apply'][sl])} replay {m(ph['replay'])} repair {m(ph['repair'][lg])} "
              f"(logged {100 * lg.double().mean().item():.0f}%) life {m(ph['life'])}")

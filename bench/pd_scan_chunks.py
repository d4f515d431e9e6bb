"""The warp forward's chunk layout at B sequences (default 32) of N=128 entries (forward, ms and fraction of copy
bandwidth), all on one machine:
  - ramp r (r = 0: equal chunks of the default T; the default, cuda._RAMP, is marked): in one wave every chunk
    streams phase 1 side by side, then all look back and replay at once; chunks growing along the sequence let
    the early ones finish while the later ones still stream;
  - fill: equal chunks of T = ceil(L / floor(warp slots / B)), which fill every SM's warp slots exactly (2,048
    chunks of 256 steps leave 64 of an H100's 2,112 slots empty).

    PYTHONPATH=.:bench python bench/pd_scan_chunks.py [--L 2048,8192,16384] [--kinds c64,split_bf16] [--ramps 0,0.1]
                                                      [--batch 32]
"""
import argparse

import torch

from llm_surgery.ops.pd_scan import cuda as K
from pd_scan_bench import d2d_bandwidth, time_kind

N = 128
FORMS = {"c64": (K._CPLX, False), "split_f32": (K._SPLIT, False), "split_bf16": (K._SPLIT, True),
         "f32": (K._REAL, False), "bf16": (K._REAL, True)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--L", default="2048,8192,16384")
    ap.add_argument("--kinds", default="c64,split_f32,split_bf16,f32,bf16")
    ap.add_argument("--ramps", default="0,0.05,0.1,0.15")
    ap.add_argument("--batch", type=int, default=32, help="sequences B")
    args = ap.parse_args()
    S = args.batch
    prop = torch.cuda.get_device_properties(0)
    bw = d2d_bandwidth()
    ramps = [float(r) for r in args.ramps.split(",")]
    print(f"device: {prop.name}, {prop.multi_processor_count} SMs; torch {torch.__version__}; copy {bw:.2f} TB/s; "
          f"default ramp {K._RAMP}; B={S}, N={N}")
    print("| kind | L | " + " | ".join(f"ramp {r}" + (" (default)" if r == K._RAMP else "") for r in ramps) +
          " | fill T: ms |")
    print("|---|---|" + "---|" * (len(ramps) + 1))
    for kind in args.kinds.split(","):
        kd, bf16 = FORMS[kind]
        slots = K._warp_slots(K._module(), kd, bool(bf16), N, prop.multi_processor_count)
        for L in map(int, args.L.split(",")):
            cells = []
            for r in ramps:
                K._state["ramp"] = r
                try:
                    ms, tbs, _ = time_kind(kind, S, L, N, algo="warp")
                finally:
                    K._state.pop("ramp", None)
                cells.append(f"{ms:.4f} ({100 * tbs / bw:.0f}%)")
            T = -(-L // (slots // S))
            ms, tbs, _ = time_kind(kind, S, L, N, chunk=T, algo="warp")
            cells.append(f"T={T}: {ms:.4f} ({100 * tbs / bw:.0f}%)")
            print(f"| {kind} | {L} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()

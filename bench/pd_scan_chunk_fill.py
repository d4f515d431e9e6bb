"""The warp forward's chunk length against the one-wave fill (B=32, N=128, forward, ms and fraction of copy
bandwidth): the default power-of-two T, and T = ceil(L / floor(warp slots / B)), which makes the chunks fill
every SM's warp slots exactly (2048 chunks of 256 steps leave 64 of an H100's 2,112 slots empty, so half the SMs
run 16 chunks and half 15, and the kernel lasts as long as the 16-chunk SMs). Times both on the same machine.

    PYTHONPATH=.:bench python bench/pd_scan_chunk_fill.py [--L 4096,8192,12288,16384] [--kinds c64,split_bf16]
"""
import argparse

import torch

from llm_surgery.ops.pd_scan import cuda as K
from pd_scan_bench import d2d_bandwidth, time_kind

S, N = 32, 128


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--L", default="4096,8192,12288,16384")
    ap.add_argument("--kinds", default="c64,split_f32,split_bf16,f32,bf16")
    args = ap.parse_args()
    prop = torch.cuda.get_device_properties(0)
    bw = d2d_bandwidth()
    print(f"device: {prop.name}, {prop.multi_processor_count} SMs; torch {torch.__version__}; copy {bw:.2f} TB/s")
    print("| kind | L | default T (chunks) | ms (of copy) | fill T (chunks) | ms (of copy) | fill / default |")
    print("|---|---|---|---|---|---|---|")
    for kind in args.kinds.split(","):
        kd, bf16 = {"c64": (K._CPLX, False), "split_f32": (K._SPLIT, False), "split_bf16": (K._SPLIT, True),
                    "f32": (K._REAL, False), "bf16": (K._REAL, True)}[kind]
        slots = prop.multi_processor_count * K._warp_blocks_per_sm(K._module(), kd, bf16, N)
        for L in map(int, args.L.split(",")):
            T0 = K._default_chunk(K._module(), kd, bf16, False, S, L, N, prop.multi_processor_count, K._ALGOS["warp"])
            T1 = -(-L // (slots // S))
            cells = []
            for T in (T0, T1):
                ms, tbs, _ = time_kind(kind, S, L, N, chunk=T, algo="warp")
                cells.append((T, -(-L // T), ms, 100 * tbs / bw))
            (a, ca, ma, fa), (b, cb, mb, fb) = cells
            print(f"| {kind} | {L} | {a} ({S * ca}) | {ma:.4f} ({fa:.0f}%) | {b} ({S * cb}) | {mb:.4f} ({fb:.0f}%) | "
                  f"{mb / ma:.3f} |", flush=True)


if __name__ == "__main__":
    main()

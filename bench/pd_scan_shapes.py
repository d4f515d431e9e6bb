"""The warp forward at layer-like shapes (many sequences, small N, many waves) and at B=32, N=128 (one wave), bf16
forms: ms per call (CUDA graph, as pd_scan_bench.py times). For policies that depend on the launch's shape, such as
which chunks keep a repair log (docs/bench/kernels.md, session 23).

usage: PYTHONPATH=.:bench python bench/pd_scan_shapes.py NAME      (NAME labels the rows, e.g. a kernel_ab variant)
"""
import sys

from pd_scan_bench import time_kind

name = sys.argv[1] if len(sys.argv) > 1 else "cur"
for kind in ("split_bf16", "bf16"):
    for S, L, N in ((512, 1024, 32), (512, 2048, 32), (512, 4096, 32), (256, 2048, 64), (32, 1024, 128),
                    (32, 2048, 128)):
        ms = time_kind(kind, S, L, N, which="fwd", algo="warp")[0]
        print(f"{name:5s} {kind:10s} S={S:4d} L={L:5d} N={N:3d} warp {ms:.4f} ms")

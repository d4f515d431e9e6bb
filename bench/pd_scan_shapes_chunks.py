"""The warp forward (or, `--which bwd`, the backward) at many shapes (sequences x L, N): its default chunk and time
per form (ms per call, CUDA graph, as pd_scan_bench.py times), optionally explicit chunks beside it, and the share
of chunks the repair log took (clock64 probes, forward). Why: policies that depend on the launch's shape were
chosen from these tables (docs/bench/kernels.md): which chunks keep a repair log (session 23, `--set layer`), the
default chunk and the collapse check's window (session 24, `--set policy`, `--set n256`), the chunks of launches
over many waves and of the backward (session 27). Run it at two commits, or in two kernel_ab variants' trees with
`--name`, to compare them.

    PYTHONPATH=.:bench python bench/pd_scan_shapes_chunks.py [--set policy|n256|layer | --shapes S:L:N,...]
                                                             [--chunks 8,16,32,64,128,256]
                                                             [--kinds c64,split_bf16,bf16] [--logged] [--name cur]
                                                             [--which fwd|bwd]
"""
import argparse

import torch

from llm_surgery.ops.pd_scan import cuda as K
from pd_scan_bench import chunk_phases, probe_forward, time_kind

SETS = {
    # few sequences, B=32 at short L, many short sequences, the layer's shapes, and N = 16 / 256
    "policy": [(1, 16384, 128), (2, 8192, 128), (4, 4096, 128), (8, 4096, 128), (8, 2048, 128), (16, 1024, 128),
               (32, 256, 128), (32, 512, 128), (32, 768, 128), (64, 512, 128), (128, 384, 128), (256, 512, 128),
               (512, 256, 128), (512, 1024, 32), (512, 4096, 32), (256, 2048, 64), (256, 4096, 64), (512, 512, 32),
               (2048, 128, 32), (2048, 2048, 16), (32, 4096, 256), (8, 1024, 128), (4, 256, 256)],
    # the collapse check's window: N=256 chunks collapse after ~16 steps
    "n256": [(32, 2048, 256), (32, 8192, 256), (32, 16384, 256), (32, 16384, 128)],
    # the layer's shapes (many sequences, small N, many waves) and B=32, N=128 (one wave)
    "layer": [(512, 1024, 32), (512, 2048, 32), (512, 4096, 32), (256, 2048, 64), (32, 1024, 128), (32, 2048, 128)],
}
FORMS = {"c64": K._CPLX, "split_f32": K._SPLIT, "split_bf16": K._SPLIT, "f32": K._REAL, "bf16": K._REAL}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--set", default="policy", choices=sorted(SETS))
    ap.add_argument("--shapes", default="", help="S:L:N,... in place of --set's shapes")
    ap.add_argument("--chunks", default="", help="explicit chunk lengths timed beside the default (comma list)")
    ap.add_argument("--kinds", default="c64,split_bf16,bf16")
    ap.add_argument("--logged", action="store_true", help="also the logged share and replay cycles (default chunk)")
    ap.add_argument("--name", default="", help="a label in front of every row (e.g. a kernel_ab variant's name)")
    ap.add_argument("--which", default="fwd", choices=("fwd", "bwd"),
                    help="the warp forward, or the backward (its one kernel)")
    args = ap.parse_args()
    bwd = args.which == "bwd"
    algo = "auto" if bwd else "warp"
    props = torch.cuda.get_device_properties(0)
    sms, limit = props.multi_processor_count, K._smem_limit(props)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; ms, {'backward' if bwd else 'warp forward'}")
    shapes = [tuple(int(v) for v in t.split(":")) for t in args.shapes.split(",")] if args.shapes else SETS[args.set]
    for S, L, N in shapes:
        for kind in args.kinds.split(","):
            T = K._default_chunk(K._module(), FORMS[kind], kind.endswith("bf16"), bwd, S, L, N, sms,
                                 K._algo_code(algo, N, bwd), limit)   # as pd_scan's launcher asks
            label = f"{args.name} " if args.name else ""
            row = [f"{label}{kind:10s} S={S:4d} L={L:5d} N={N:3d}",
                   f"default T={T} {time_kind(kind, S, L, N, which=args.which, algo=algo)[0]:.4f}"]
            for t in [int(v) for v in args.chunks.split(",") if v]:
                if t <= L:
                    row.append(f"T={t} {time_kind(kind, S, L, N, chunk=t, which=args.which, algo=algo)[0]:.4f}")
            if args.logged and not bwd:
                ph = chunk_phases(probe_forward(kind, S, L, N)[0])
                slow = ph["slow"]
                row.append(f"logged {100 * ph['logged'][slow].double().mean().item():.0f}% of phase-1 chunks, "
                           f"replay {ph['replay'].double().mean().item():.0f} cycles, "
                           f"longest life {ph['life'].max().item():.0f}")
            print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()

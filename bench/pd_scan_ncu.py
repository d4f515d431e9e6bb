"""Forward launches of the pd_scan kernels (B=32, N=128) for Nsight Compute: the DRAM bytes each kernel really
moves against the must-move bytes (inputs once, outputs once).

    PYTHONPATH=. ncu --kernel-name regex:pd_fwd --launch-skip 1 --launch-count 1 \
        --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum \
        python bench/pd_scan_ncu.py [L] [split_f32|split_bf16|c64] [warp|block|auto] [chunk]
"""
import sys

import torch

from llm_surgery.ops.pd_scan import cuda as K

L = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
kind = sys.argv[2] if len(sys.argv) > 2 else "split_f32"
algo = sys.argv[3] if len(sys.argv) > 3 else "auto"
chunk = int(sys.argv[4]) if len(sys.argv) > 4 else None
S, N = 32, 128
P = torch.randint(0, N, (S, L, N), device="cuda", dtype=torch.int16)
D = torch.polar(0.3 + 0.65 * torch.rand(S, L, N, device="cuda"), 6.283 * torch.rand(S, L, N, device="cuda"))
b = torch.randn(S, L, N, device="cuda", dtype=torch.complex64)
if kind == "c64":
    run = lambda: K.pd_scan_fwd_cuda(P, D, b, algo=algo, chunk=chunk)
    must = S * L * N * (2 + 3 * 8)
else:
    dt = torch.float32 if kind == "split_f32" else torch.bfloat16
    Dr, Di, br, bi = (t.to(dt).contiguous() for t in (D.real, D.imag, b.real, b.imag))
    run = lambda: K.pd_scan_fwd_cuda_split(P, Dr, Di, br, bi, algo=algo, chunk=chunk)
    must = S * L * N * (2 + 3 * 2 * dt.itemsize)
for _ in range(2):   # warm-up (build, first launch) then the profiled launch
    run()
torch.cuda.synchronize()
print(f"must-move bytes of the forward: {must} ({kind}, L={L}, algo={algo}, chunk={chunk or 'default'})")

"""One forward and one backward launch (split fp32, B=32, N=128) for Nsight Compute:

    PYTHONPATH=. ncu --kernel-name regex:pd_ --launch-skip 2 --launch-count 2 --section SpeedOfLight \
        --section WarpStateStats --section InstructionStats --section SchedulerStats python bench/pd_scan_ncu.py
"""
import sys

import torch

from llm_surgery.ops.pd_scan import cuda as K

L = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
S, N = 32, 128
P = torch.randint(0, N, (S, L, N), device="cuda", dtype=torch.int16)
D = torch.polar(0.3 + 0.65 * torch.rand(S, L, N, device="cuda"), 6.283 * torch.rand(S, L, N, device="cuda"))
Dr, Di = D.real.contiguous(), D.imag.contiguous()
br, bi = torch.randn(S, L, N, device="cuda"), torch.randn(S, L, N, device="cuda")
for _ in range(2):   # warm-up (build, first launches) then the profiled pair
    xr, xi = K.pd_scan_fwd_cuda_split(P, Dr, Di, br, bi)
    K.pd_scan_bwd_cuda_split(P, Dr, Di, None, xr, xi, br, bi)
torch.cuda.synchronize()

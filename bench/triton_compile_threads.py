"""Whether Triton compiles kernels in parallel from threads (the reason `llm_surgery.triton_autotune` compiles a
tuning round's configs in a thread pool): four kernels of one `tl.dot` loop, distinct only in an unused constexpr,
compiled one after another, then four more in four threads. Use a fresh cache, or every compile is a cache hit:

    TRITON_CACHE_DIR=$(mktemp -d) python bench/triton_compile_threads.py
"""

import time
from concurrent.futures import ThreadPoolExecutor

import torch
import triton
import triton.language as tl


@triton.jit
def mm(a, b, c, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SALT: tl.constexpr):
    pm, pn = tl.program_id(0), tl.program_id(1)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    for k in range(0, K, BK):
        x = tl.load(a + rm[:, None] * K + (k + rk)[None, :])
        y = tl.load(b + (k + rk)[:, None] * N + rn[None, :])
        acc += tl.dot(x, y)
    acc = acc * (SALT + 1) / (SALT + 1)
    tl.store(c + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16))


def main() -> None:
    a = torch.randn(512, 512, device="cuda", dtype=torch.bfloat16)
    b, c = torch.randn_like(a), torch.empty_like(a)

    def compile_one(salt: int) -> float:
        t = time.perf_counter()
        mm.warmup(a, b, c, 512, 512, 512, BM=128, BN=128, BK=64, SALT=salt, num_stages=3, num_warps=8, grid=(4, 4))
        return time.perf_counter() - t

    compile_one(100)  # the first compilation also loads the compiler and the driver
    t = time.perf_counter()
    each = [compile_one(s) for s in range(4)]
    serial = time.perf_counter() - t
    t = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        par_each = list(pool.map(compile_one, range(4, 8)))
    parallel = time.perf_counter() - t
    print(f"COMPILE_THREADS serial 4 kernels {serial:.2f} s (each {[round(x, 2) for x in each]}); "
          f"4 threads {parallel:.2f} s (each {[round(x, 2) for x in par_each]})", flush=True)


if __name__ == "__main__":
    main()

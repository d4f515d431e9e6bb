"""Can the L2's atomic units take the warp forward's scatter off the SM? A measurement, not a kernel.

The warp forward's phase 1 is bound by the SM's L1/shared-memory pipe (~150 shared-memory wavefronts a step for
the linked lists, docs/bench/kernels.md, session 19). Here one warp per chunk of T steps runs the zero-state
chain x_k = b_k + scatter(P_k, D_k x_{k-1}) with the scatter done by `red.global.add.v2.f32` into a per-warp,
double-buffered 1 KB scratch row in L2 (the L2 sums collisions; no lists, heads or walks), then a CTA fence, a
`__syncwarp`, and each owner lane reads its entries back (`ld.relaxed.gpu`, past L1) and zeroes them. B=32,
N=128, L=16384, 256-step chunks (one wave of 2048 warps, as the real kernel runs it), split bf16 and complex64:

  mode 0  stream only: out = b + D (the access pattern's memory ceiling)
  mode 1  the chain with streamed inputs and outputs (what a phase 1 built this way would cost, without the
          aggregate's map tracking or the log)
  mode 2  the chain alone: one row's inputs reused every step, outputs stored once (the L2 atomics' rate)

and the real warp forward on the same inputs. Mode 1's outputs are checked against a float64 zero-state chain.

  PYTHONPATH=$PWD:$PWD/bench python bench/scatter_l2_micro.py
"""
import time

import torch
from torch.utils.cpp_extension import load_inline

from cuda_timing import median_ms
from llm_surgery.ops.pd_scan.naive import pd_scan_naive

SRC = r"""
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cstdint>
__device__ __forceinline__ float2 cmul(float2 a, float2 b) {
  return make_float2(a.x * b.x - a.y * b.y, a.x * b.y + a.y * b.x);
}
__device__ __forceinline__ void red2(float2* p, float2 v) {
  asm volatile("red.relaxed.gpu.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(v.x), "f"(v.y) : "memory");
}
__device__ __forceinline__ float2 ldr2(const float2* p) {
  float2 v;
  asm volatile("ld.relaxed.gpu.global.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st2(float2* p, float2 v) {
  asm volatile("st.relaxed.gpu.global.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(v.x), "f"(v.y) : "memory");
}
struct Args { const short* P; const void *d0, *d1, *b0, *b1; void *o0, *o1; void* scratch; int T; };
constexpr int N = 128, E = 4;
template <bool BF> __device__ __forceinline__ float2 ld_in(const void* re, const void* im, size_t i) {
  if constexpr (BF)
    return make_float2(__bfloat162float(__ldg(static_cast<const __nv_bfloat16*>(re) + i)),
                       __bfloat162float(__ldg(static_cast<const __nv_bfloat16*>(im) + i)));
  else return __ldg(static_cast<const float2*>(re) + i);
}
template <bool BF> __device__ __forceinline__ void st_out(void* re, void* im, size_t i, float2 v) {
  if constexpr (BF) {
    static_cast<__nv_bfloat16*>(re)[i] = __float2bfloat16_rn(v.x);
    static_cast<__nv_bfloat16*>(im)[i] = __float2bfloat16_rn(v.y);
  } else static_cast<float2*>(re)[i] = v;
}
template <int MODE, bool BF>
__global__ void __launch_bounds__(32, 16) kern(Args a) {
  const int lane = threadIdx.x;
  const size_t row0 = static_cast<size_t>(blockIdx.x) * a.T * N;
  float2* buf = static_cast<float2*>(a.scratch) + static_cast<size_t>(blockIdx.x) * 2 * N;
  int p[E], pn[E];
  float2 d[E], b[E], dn[E], bn[E], x[E];
  auto load = [&](int k, int (&pp)[E], float2 (&dd)[E], float2 (&bb)[E]) {
#pragma unroll
    for (int j = 0; j < E; ++j) {
      const size_t i = row0 + static_cast<size_t>(k) * N + lane + 32 * j;
      pp[j] = a.P[i];
      dd[j] = ld_in<BF>(a.d0, a.d1, i);
      bb[j] = ld_in<BF>(a.b0, a.b1, i);
    }
  };
  load(0, p, d, b);
#pragma unroll
  for (int j = 0; j < E; ++j) x[j] = make_float2(0.f, 0.f);
  int par = 0;
  for (int k = 0; k < a.T; ++k) {
    if (MODE != 2 && k + 1 < a.T) load(k + 1, pn, dn, bn);
    if constexpr (MODE == 0) {
#pragma unroll
      for (int j = 0; j < E; ++j) x[j] = make_float2(b[j].x + d[j].x, b[j].y + d[j].y);   // D read too
    } else {
      float2* row = buf + par * N;
#pragma unroll
      for (int j = 0; j < E; ++j) red2(row + p[j], cmul(d[j], x[j]));
      __threadfence_block();
      __syncwarp();
#pragma unroll
      for (int j = 0; j < E; ++j) {
        const float2 s = ldr2(row + lane + 32 * j);
        st2(row + lane + 32 * j, make_float2(0.f, 0.f));
        x[j] = make_float2(s.x + b[j].x, s.y + b[j].y);
      }
    }
    if (MODE != 2 || k + 1 == a.T) {
#pragma unroll
      for (int j = 0; j < E; ++j) st_out<BF>(a.o0, a.o1, row0 + static_cast<size_t>(k) * N + lane + 32 * j, x[j]);
    }
    if (MODE != 2) {
#pragma unroll
      for (int j = 0; j < E; ++j) { p[j] = pn[j]; d[j] = dn[j]; b[j] = bn[j]; }
    }
    par ^= 1;
  }
}
void run(int mode, int bf, Args a, int warps) {
  void (*f)(Args) = bf ? (mode == 0 ? kern<0, true> : mode == 1 ? kern<1, true> : kern<2, true>)
                       : (mode == 0 ? kern<0, false> : mode == 1 ? kern<1, false> : kern<2, false>);
  f<<<warps, 32>>>(a);
}
"""
CPP = r"""
#include <torch/extension.h>
struct Args { const short* P; const void *d0, *d1, *b0, *b1; void *o0, *o1; void* scratch; int T; };
void run(int mode, int bf, Args a, int warps);
void run_t(int mode, int bf, torch::Tensor P, torch::Tensor d0, torch::Tensor d1, torch::Tensor b0, torch::Tensor b1,
           torch::Tensor o0, torch::Tensor o1, torch::Tensor scratch, int T, int warps) {
  Args a{(const short*)P.data_ptr(), d0.data_ptr(), d1.data_ptr(), b0.data_ptr(), b1.data_ptr(), o0.data_ptr(),
         o1.data_ptr(), scratch.data_ptr(), T};
  run(mode, bf, a, warps);
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("run", &run_t); }
"""


def main():
    t0 = time.time()
    ext = load_inline("scatter_l2_micro", cpp_sources=CPP, cuda_sources=SRC, extra_cuda_cflags=["-O3", "-arch=sm_90a"])
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"build {time.time() - t0:.0f} s")
    from llm_surgery.ops.pd_scan import cuda as K
    S, L, N, T = 32, 16384, 128, 256
    rows, warps = S * L, S * L // T
    gen = torch.Generator(device="cuda").manual_seed(0)
    P = torch.randint(0, N, (rows, N), device="cuda", dtype=torch.int16, generator=gen)
    mag = 0.3 + 0.65 * torch.rand(rows, N, device="cuda", generator=gen)
    D = torch.polar(mag, 6.283 * torch.rand(rows, N, device="cuda", generator=gen))
    b = torch.randn(rows, N, device="cuda", dtype=torch.complex64, generator=gen)
    scratch = torch.zeros(warps * 2 * N, 2, device="cuda")
    # a copy of the same must-move bytes, for the ceiling
    x = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    copy_tbs = 2 * x.numel() / (median_ms(lambda: y.copy_(x)) * 1e-3) / 1e12
    del x, y
    print(f"copy (256 MiB, read + write): {copy_tbs:.2f} TB/s")
    print("| form | mode | ms | must-move TB/s | of copy |")
    print("|---|---|---|---|---|")
    for form in ("split_bf16", "c64"):
        bf = form == "split_bf16"
        if bf:
            ins = [D.real.bfloat16().contiguous(), D.imag.bfloat16().contiguous(),
                   b.real.bfloat16().contiguous(), b.imag.bfloat16().contiguous()]
            outs = [torch.empty(rows, N, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
            must = rows * N * 14
        else:
            dv, bv = torch.view_as_real(D), torch.view_as_real(b)   # interleaved: the kernel reads the first pointer
            ins = [dv, dv, bv, bv]
            o = torch.empty(rows, N, 2, device="cuda")
            outs = [o, o]
            must = rows * N * 26
        for mode, name in ((0, "stream only"), (1, "L2-red chain, streamed"), (2, "L2-red chain alone")):
            fn = lambda: ext.run(mode, int(bf), P, *ins, *outs, scratch, T, warps)
            ms = median_ms(fn)
            tbs = must / (ms * 1e-3) / 1e12
            print(f"| {form} | {mode}: {name} | {ms:.4f} | {tbs:.2f} | {100 * tbs / copy_tbs:.0f}% |", flush=True)
            if mode == 1:   # check three chunks against float64
                scratch.zero_()
                fn()
                torch.cuda.synchronize()
                if bf:
                    got = torch.complex(outs[0].float(), outs[1].float()).to(torch.complex128)
                    Dd = torch.complex(ins[0].double(), ins[1].double())
                    bd = torch.complex(ins[2].double(), ins[3].double())
                else:
                    got = torch.view_as_complex(outs[0]).to(torch.complex128)
                    Dd, bd = D.to(torch.complex128), b.to(torch.complex128)
                worst = 0.0
                for ci in (0, warps // 2, warps - 1):
                    r = slice(ci * T, (ci + 1) * T)   # the chunk's zero-state chain
                    ref = pd_scan_naive(P[r], Dd[r], bd[r])
                    g = got[ci * T:(ci + 1) * T]
                    worst = max(worst, ((g - ref).abs().max() / ref.abs().max()).item())
                print(f"  check, mode 1, 3 chunks against float64: max |err| / max |ref| = {worst:.1e}", flush=True)
        # the real warp forward on the same inputs (its chunks: its own policy)
        if bf:
            f = lambda: K.pd_scan_fwd_cuda_split(P.view(S, L, N), *[t.view(S, L, N) for t in ins], algo="warp")
        else:
            f = lambda: K.pd_scan_fwd_cuda(P.view(S, L, N), D.view(S, L, N), b.view(S, L, N), algo="warp")
        ms = median_ms(f)
        tbs = must / (ms * 1e-3) / 1e12
        print(f"| {form} | pd_scan warp forward (whole kernel) | {ms:.4f} | {tbs:.2f} | {100 * tbs / copy_tbs:.0f}% |", flush=True)


if __name__ == "__main__":
    main()

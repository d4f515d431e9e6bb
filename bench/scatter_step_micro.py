"""Latency of one scatter step of a 128-thread group (one thread per state entry, N=128) on the GPU, by parts:
a barrier, a store + barrier + load, shared-memory compare-and-swap or float atomic adds, a full step, and the
warp-combining scatter of the block kernel; clock64 cycles per step on one CTA and with four CTAs per SM.
Why: it decided the design of the cluster forward kernel tried in session 12 (docs/bench/kernels.md).

  PYTHONPATH=$PWD python bench/scatter_step_micro.py
"""
import sys

import torch
from torch.utils.cpp_extension import load_inline

SRC = r"""
#include <cuda_runtime.h>
#include <cstdint>
__device__ __forceinline__ void gsync(int n) { asm volatile("bar.sync 1, %0;" :: "r"(n) : "memory"); }
__device__ __forceinline__ void cas_add(float2* p, float2 v) {
  unsigned long long* w = reinterpret_cast<unsigned long long*>(p);
  unsigned long long old = *w, seen;
  do {
    seen = old;
    const float re = __uint_as_float((unsigned)seen) + v.x, im = __uint_as_float((unsigned)(seen >> 32)) + v.y;
    old = atomicCAS(w, seen, ((unsigned long long)__float_as_uint(im) << 32) | __float_as_uint(re));
  } while (old != seen);
}
// variant: 0 barrier, 1 store own + barrier + load, 2 CAS add to P + barrier + load/zero, 3 two f32 atomicAdd,
// 4 variant 2 with P/D/b loads and cmul (a full step), 5 match + shuffles + per-warp slot (no atomics),
// 6 variant 2 with P = own entry (no collisions, same addresses pattern as 1)
template <int V>
__global__ void k(const short* Pg, long long* out, float* sink, int steps) {
  __shared__ short P[64 * 128];
  __shared__ float2 D[64 * 128];
  __shared__ float2 buf[2][128];
  __shared__ float2 slots[2][128][4];
  const int m = threadIdx.x;
  for (int i = m; i < 64 * 128; i += 128) { P[i] = Pg[i]; D[i] = make_float2(0.5f, 0.1f); }
  buf[0][m] = buf[1][m] = make_float2(0.f, 0.f);
  for (int w = 0; w < 4; ++w) slots[0][m][w] = slots[1][m][w] = make_float2(0.f, 0.f);
  __syncthreads();
  float2 x = make_float2(1.f, 0.f);
  int par = 0, old0 = -1, old1 = -1;
  long long t0 = clock64();
  for (int t = 0; t < steps; ++t) {
    const int i = (t & 63) * 128;
    if (V == 0) { gsync(128); x.x += 1.f; }
    if (V == 1) { buf[par][m] = x; gsync(128); x = buf[par][m ^ 1]; x.x += 1e-3f; par ^= 1; }
    if (V == 2 || V == 4 || V == 6) {
      float2 v = x;
      if (V == 4) { const float2 d = D[i + m]; v = make_float2(d.x * x.x - d.y * x.y, d.x * x.y + d.y * x.x); }
      cas_add(&buf[par][V == 6 ? m : P[i + m]], v);
      gsync(128);
      x = buf[par][m];
      buf[par][m] = make_float2(0.f, 0.f);
      if (V == 4) { x.x += D[i + m].x; x.y += D[i + m].y; }
      x.x *= 0.5f; x.y *= 0.5f;
      par ^= 1;
    }
    if (V == 3) {
      atomicAdd(&buf[par][P[i + m]].x, x.x); atomicAdd(&buf[par][P[i + m]].y, x.y);
      gsync(128);
      x = buf[par][m]; buf[par][m] = make_float2(0.f, 0.f); x.x *= 0.5f; x.y *= 0.5f; par ^= 1;
    }
    if (V == 5) {
      const int dest = P[i + m], lane = m & 31;
      const unsigned mask = __match_any_sync(0xffffffffu, dest);
      const int maxc = __reduce_max_sync(0xffffffffu, (unsigned)__popc(mask));
      float2 sum = x; unsigned others = mask & ~(1u << lane);
      for (int c = 1; c < maxc; ++c) {
        const int src = others ? __ffs(others) - 1 : lane;
        const float a = __shfl_sync(0xffffffffu, x.x, src), b = __shfl_sync(0xffffffffu, x.y, src);
        if (others) { sum.x += a; sum.y += b; others &= others - 1; }
      }
      float2* base = &slots[par][0][0];
      const int old = par ? old1 : old0;
      if (old >= 0) base[old] = make_float2(0.f, 0.f);
      __syncwarp();
      int slot = -1;
      if (lane == __ffs(mask) - 1) { slot = dest * 4 + ((m >> 5) ^ ((dest >> 2) & 3)); base[slot] = sum; }
      if (par) old1 = slot; else old0 = slot;
      gsync(128);
      const float4* r4 = reinterpret_cast<const float4*>(&slots[par][m][0]);
      const float4 a = r4[0], b = r4[1];
      x = make_float2(0.5f * (a.x + a.z + b.x + b.z), 0.5f * (a.y + a.w + b.y + b.w));
      par ^= 1;
    }
  }
  long long t1 = clock64();
  if (m == 0) out[blockIdx.x] = t1 - t0;
  sink[blockIdx.x * 128 + m] = x.x + x.y;
}
void run(int v, const short* P, long long* out, float* sink, int steps, int blocks) {
  void (*f)(const short*, long long*, float*, int) = v == 0 ? k<0> : v == 1 ? k<1> : v == 2 ? k<2> : v == 3 ? k<3>
      : v == 4 ? k<4> : v == 5 ? k<5> : k<6>;
  f<<<blocks, 128>>>(P, out, sink, steps);
}
"""
CPP = "void run(int v, const short* P, long long* out, float* sink, int steps, int blocks);\n" \
      "#include <torch/extension.h>\n" \
      "void run_t(int v, torch::Tensor P, torch::Tensor out, torch::Tensor sink, int steps, int blocks) {" \
      " run(v, (const short*)P.data_ptr(), (long long*)out.data_ptr(), sink.data_ptr<float>(), steps, blocks); }"
ext = load_inline("scatter_step_micro", cpp_sources=CPP + "\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def(\"run\", &run_t); }",
                  cuda_sources=SRC, extra_cuda_cflags=["-O3", "-arch=sm_90a"])
names = ["barrier only", "store own + barrier + load", "CAS add (64-bit) + barrier + load", "2x f32 atomicAdd + barrier",
         "full step (D load, cmul, CAS, barrier, load)", "match + shuffles + per-warp slots + barrier", "CAS add to own entry"]
steps = 8192
print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}: cycles per step, 128 threads")
print("| variant | P random, 1 CTA | P random, 4 CTAs/SM | P all zero (one entry), 1 CTA |")
print("|---|---|---|---|")
sms = torch.cuda.get_device_properties(0).multi_processor_count
for v, name in enumerate(names):
    cells = []
    for pmode, blocks in (("rand", 1), ("rand", 4 * sms), ("zero", 1)):
        P = torch.randint(0, 128, (64 * 128,), dtype=torch.int16, device="cuda") if pmode == "rand" else \
            torch.zeros(64 * 128, dtype=torch.int16, device="cuda")
        out = torch.zeros(blocks, dtype=torch.int64, device="cuda")
        sink = torch.zeros(blocks * 128, device="cuda")
        ext.run(v, P, out, sink, 64, blocks)
        ext.run(v, P, out, sink, steps, blocks)
        torch.cuda.synchronize()
        cells.append(f"{out.double().mean().item() / steps:.0f}")
    print(f"| {name} | " + " | ".join(cells) + " |")

// PD-SSM recurrence on the GPU: single-pass chunked scan with decoupled look-back. This header holds what the
// kernels share (value types and arithmetic, staging, flags and look-back, chunk claiming); each kernel has its
// own file: pd_fwd_block.cu, pd_fwd_warp.cu, pd_bwd.cu; pd_scan_launch.cu launches them.
//
//   forward   x_t[n]  = b_t[n] + sum_{m : P_t[m] = n} D_t[m] x_{t-1}[m]         (scatter-add, x_{-1} = x0)
//   backward  lam_{t-1} = g_{t-1} + conj(D_t) * lam_t[P_t]                         (gather)
//             grad_b = lam, grad_D_t[m] = conj(x_{t-1}[m]) lam_t[P_t[m]], grad_x0[m] = conj(D_0[m]) lam_0[P_0[m]]
//
// One block per (sequence, chunk of T steps), one thread per state entry m. Blocks take tickets from a global
// counter in dependency order, so every block they wait for is already running (no deadlock). Each block copies
// its chunk's inputs into shared memory ONCE (bulk copies on an mbarrier), then
//   1. folds the chunk with a zero entering state into an aggregate (column map pi, factor d, zero-state end y),
//      and publishes it (flag 1) -- skipped when the entering state is already published (always for chunk 0);
//   2. looks back over its predecessors' flags (one warp, 32 at a time) to the nearest published inclusive state,
//      applies the aggregates in between, gets its entering state, publishes its own inclusive state (flag 2);
//   3. replays the chunk from the entering state out of shared memory and writes the outputs.
// Inputs are read from device memory once, outputs written once; scratch is O(sequences * chunks * N).
// The warp forward (pd_fwd_warp.cu) runs the same three phases with one warp per chunk.
//
// Layouts (template parameter K): REAL (one plane of In), SPLIT (re and im planes of In; In = Mixed: see Planes),
// CPLX (interleaved complex64, In = float). Arithmetic is fp32 (complex as float2). P is int16 (the wrapper converts).
// No file here includes a torch header: the binding lives in pd_scan_bind.cpp.
#pragma once
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cstdint>
#include "pd_scan.cuh"

namespace pdk {

enum Layout { REAL = 0, SPLIT = 1, CPLX = 2 };

// ---------------------------------------------------------------- scalar helpers
__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

__device__ __forceinline__ float cmul(float a, float b) { return a * b; }
__device__ __forceinline__ float2 cmul(float2 a, float2 b) {
  return make_float2(a.x * b.x - a.y * b.y, a.x * b.y + a.y * b.x);
}
__device__ __forceinline__ float conjv(float a) { return a; }
__device__ __forceinline__ float2 conjv(float2 a) { return make_float2(a.x, -a.y); }
__device__ __forceinline__ float addv(float a, float b) { return a + b; }
__device__ __forceinline__ float2 addv(float2 a, float2 b) { return make_float2(a.x + b.x, a.y + b.y); }
__device__ __forceinline__ float subv(float a, float b) { return a - b; }
__device__ __forceinline__ float2 subv(float2 a, float2 b) { return make_float2(a.x - b.x, a.y - b.y); }
template <typename A> __device__ __forceinline__ A zero_v();
template <> __device__ __forceinline__ float zero_v<float>() { return 0.f; }
template <> __device__ __forceinline__ float2 zero_v<float2>() { return make_float2(0.f, 0.f); }
template <typename A> __device__ __forceinline__ A one_v();
template <> __device__ __forceinline__ float one_v<float>() { return 1.f; }
template <> __device__ __forceinline__ float2 one_v<float2>() { return make_float2(1.f, 0.f); }
__device__ __forceinline__ void atomic_add_v(float* p, float v) { atomicAdd(p, v); }
__device__ __forceinline__ void atomic_add_v(float2* p, float2 v) { atomicAdd(&p->x, v.x); atomicAdd(&p->y, v.y); }
__device__ __forceinline__ float ldcg_v(const float* p) { return __ldcg(p); }
__device__ __forceinline__ float2 ldcg_v(const float2* p) { return __ldcg(p); }

template <int K> struct AccT { using T = float2; };
template <> struct AccT<REAL> { using T = float; };

// A form's plane types (the kernels' template parameter In): D, the transition factors, and V, every other plane
// (b and x forward; g, x, grad_b and grad_D backward). float32 and bfloat16 forms use one type for all; Mixed keeps
// D in float32 (bfloat16 steps by 2^-8 just below 1, too coarse for a decay) and the rest in bfloat16, halving the
// state-sized traffic of a half-precision layer.
struct Mixed {};
template <typename In> struct Planes { using D = In; using V = In; };
template <> struct Planes<Mixed> { using D = float; using V = __nv_bfloat16; };
template <typename In> constexpr bool kOneType = sizeof(typename Planes<In>::D) == sizeof(typename Planes<In>::V);

// One logical array (D, b, x, ...) of elements T (float or bfloat16; a form's types: Planes): planes in global
// memory and its slice in shared memory.
template <int K, typename T> struct Arr {
  using A = typename AccT<K>::T;
  static constexpr int planes = (K == SPLIT) ? 2 : 1;
  static constexpr int esize = (K == CPLX) ? 8 : (int)sizeof(T);  // bytes per element of one plane
  // read element i of a shared slice whose planes are `stride` elements apart
  static __device__ __forceinline__ A sload(const unsigned char* s, int i, int stride) {
    if constexpr (K == REAL) return to_f(reinterpret_cast<const T*>(s)[i]);
    else if constexpr (K == SPLIT) {
      const T* p = reinterpret_cast<const T*>(s);
      return make_float2(to_f(p[i]), to_f(p[i + stride]));
    } else return reinterpret_cast<const float2*>(s)[i];
  }
  static __device__ __forceinline__ void gstore(void* re, void* im, size_t i, A v) {
    if constexpr (K == REAL) reinterpret_cast<T*>(re)[i] = from_f<T>(v);
    else if constexpr (K == SPLIT) {
      reinterpret_cast<T*>(re)[i] = from_f<T>(v.x);
      reinterpret_cast<T*>(im)[i] = from_f<T>(v.y);
    } else reinterpret_cast<float2*>(re)[i] = v;
  }
};

// ---------------------------------------------------------------- async global -> shared copy
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src));
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::); }

// Copy `bytes` (a multiple of 2) from global to shared with the widest access the alignment allows.
__device__ __forceinline__ void copy_in(void* dst, const void* src, int bytes) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | (uintptr_t)bytes;
  unsigned char* d = static_cast<unsigned char*>(dst);
  const unsigned char* s = static_cast<const unsigned char*>(src);
  if ((a & 15) == 0) {
    for (int i = threadIdx.x * 16; i < bytes; i += blockDim.x * 16) cp_async16(d + i, s + i);
  } else if ((a & 3) == 0) {
    for (int i = threadIdx.x; i < bytes / 4; i += blockDim.x)
      reinterpret_cast<uint32_t*>(d)[i] = reinterpret_cast<const uint32_t*>(s)[i];
  } else {
    for (int i = threadIdx.x; i < bytes / 2; i += blockDim.x)
      reinterpret_cast<uint16_t*>(d)[i] = reinterpret_cast<const uint16_t*>(s)[i];
  }
}

__device__ __forceinline__ float shfl_v(float v, int src) { return __shfl_sync(0xffffffffu, v, src); }
__device__ __forceinline__ float2 shfl_v(float2 v, int src) {
  return make_float2(__shfl_sync(0xffffffffu, v.x, src), __shfl_sync(0xffffffffu, v.y, src));
}

// Warps (= per-warp scatter buffers, a power of two <= 8) of the forward block for a state of N entries;
// 0 = too large: one buffer with shared-memory atomics (compare-and-swap loops on sm_90), N + 31 & ~31 threads.
__host__ __device__ __forceinline__ int fwd_warp_buffers(int N, int asize) {
  const int need = (N + 31) / 32;
  int W = 1;
  while (W < need) W *= 2;
  return (W <= 8 && 2 * W * (32 * W) * asize <= 32 * 1024) ? W : 0;
}
__host__ __device__ __forceinline__ int fwd_block(int N, int asize) {
  const int W = fwd_warp_buffers(N, asize);
  return W ? 32 * W : (N + 31) / 32 * 32;
}

constexpr int LB = 4;   // aggregates prefetched together during the look-back

// ---------------------------------------------------------------- bulk (TMA) global -> shared staging
// One thread issues one bulk copy per contiguous region (cp.async.bulk, completing on an mbarrier) instead of
// every thread issuing 16-byte copies: the chunk's inputs arrive with a handful of instructions per block.
__device__ __forceinline__ unsigned smem_u32(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_u32(bar)));
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
  unsigned done = 0;
  do {
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
  } while (!done);
}
// Stage `bytes` from global to shared: a bulk copy when both ends and the size are 16-byte aligned (all threads
// count it in tx, thread 0 issues it), else plain loads by all threads. The transaction count may run ahead of
// the expect_tx that stage_finish posts (the mbarrier phase cannot complete before that arrival).
__device__ __forceinline__ void stage_copy(void* dst, const void* src, int bytes, uint64_t* bar, unsigned& tx) {
  if (bytes <= 0) return;
  const uintptr_t al = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | (uintptr_t)bytes;
  if ((al & 15) == 0) {
    if (threadIdx.x == 0) bulk_g2s(dst, src, static_cast<unsigned>(bytes), bar);
    tx += static_cast<unsigned>(bytes);
  } else {
    copy_in(dst, src, bytes);
  }
}
__device__ __forceinline__ void stage_finish(uint64_t* bar, unsigned tx) {
  cp_async_wait_all();
  if (tx) {
    if (threadIdx.x == 0) mbar_arrive_expect_tx(bar, tx);
    mbar_wait(bar, 0);
  }
}

__host__ __device__ __forceinline__ int align16(int x) { return (x + 15) & ~15; }

// A chunk's flag: 0 nothing yet, 1 its aggregate, bit 2 its inclusive state (the warp forward publishes 3 where the
// chunk also has an aggregate, 2 where it had none: a chunk that found its entering state at its start).
// Warp 0 scans the flags of chunks hi, hi+step, ... (step = -1 forward, +1 backward) until it finds the nearest
// chunk with an inclusive state such that every chunk in between has at least its aggregate.
// Chunks outside [0, C) count as inclusive (the sequence's boundary state). Returns that chunk's index.
__device__ __forceinline__ int look_back(const int* flags, int first, int step, int C) {
  __shared__ int s_j;
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    int top = first;
    while (true) {
      const int k = top + step * lane;
      const int f = (k < 0 || k >= C) ? 2 : *reinterpret_cast<const volatile int*>(flags + k);
      const unsigned inc = __ballot_sync(0xffffffffu, (f & 2) != 0);
      const unsigned zer = __ballot_sync(0xffffffffu, f == 0);
      if (inc) {
        const int p = __ffs(inc) - 1;
        const unsigned below = (p == 0) ? 0u : ((1u << p) - 1u);
        if ((zer & below) == 0) {
          if (lane == 0) s_j = top + step * p;
          break;
        }
      } else if (zer == 0) {
        top += 32 * step;
        continue;
      }
      __nanosleep(64);
    }
    __threadfence();
  }
  __syncthreads();
  return s_j;
}

// Thread-level check that a chunk's inclusive state is published (acquire: fence after the flag read).
__device__ __forceinline__ int ready(const int* flag) {
  const int f = *reinterpret_cast<const volatile int*>(flag);
  __threadfence();
  return (f & 2) != 0;
}

__device__ __forceinline__ void publish_flag(int* flag, int v) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) atomicExch(flag, v);
}

// Out-of-range indices (a contract violation: the Python entry points check P where asked) become 0, so no
// shared-memory access ever leaves the state. Done once per block on the staged chunk, so the step loops index
// without checks. Called after the chunk is visible to all threads; the caller's next barrier publishes the fixes.
__device__ __forceinline__ void sanitize_idx(Idx* sP, int count, int N) {
  for (int i = threadIdx.x; i < count; i += blockDim.x)
    if (static_cast<unsigned>(sP[i]) >= static_cast<unsigned>(N)) sP[i] = 0;
}


// The chunk a block works on. Tickets are taken in launch order (atomicAdd on a.counter), chunk-major, so every
// chunk's neighbour in scan order started earlier: a look-back never waits on a block that is not resident.
// The backward runs the chunks last first.
constexpr int PROBES = 10;   // clock64 probes per chunk (llm_surgery/ops/pd_scan/launch_policy.py: PROBES; a test compares)
struct Chunk {
  int c, q, s0, Tc;    // chunk index, sequence, first step, steps in this chunk (the last one may be short)
  size_t row0;         // element offset of the chunk's first row in [S, L, N] inputs
  long long* prof;     // this chunk's PROBES clock64 probes, or null
};
// tabled: the chunks' first steps come from a.starts (the warp forward), else chunks of a.T steps
__device__ __forceinline__ Chunk chunk_of(const ScanArgs& a, int tk, bool last_first, bool tabled) {
  Chunk ch;
  ch.c = last_first ? a.C - 1 - tk / a.S : tk / a.S;
  ch.q = tk % a.S;
  ch.s0 = tabled ? __ldg(a.starts + ch.c) : ch.c * a.T;
  ch.Tc = tabled ? __ldg(a.starts + ch.c + 1) - ch.s0 : min(a.T, a.L - ch.s0);
  ch.row0 = (static_cast<size_t>(ch.q) * a.L + ch.s0) * a.N;
  ch.prof = a.prof ? a.prof + PROBES * static_cast<size_t>(tk) : nullptr;
  return ch;
}

// A block's start: thread 0 takes its ticket and initialises its staging mbarrier (null: none); after the
// barrier every thread has the chunk, and probe 0 (the start) is written when profiling.
__device__ __forceinline__ Chunk claim_chunk(const ScanArgs& a, bool last_first, uint64_t* bar = nullptr,
                                             bool tabled = false) {
  __shared__ int s_ticket;
  if (threadIdx.x == 0) {
    s_ticket = atomicAdd(a.counter, 1);
    if (bar) mbar_init(bar);
  }
  __syncthreads();
  const Chunk ch = chunk_of(a, s_ticket, last_first, tabled);
  if (ch.prof && threadIdx.x == 0) ch.prof[0] = clock64();
  return ch;
}

// Forward probes 1, 6, 7, 8 once the chunk is staged: the time, "no look-back yet", the SM it runs on, and "no
// repair" (probe 8: the warp forward's repair start)
__device__ __forceinline__ void prof_staged(long long* prof) {
  prof[1] = clock64();
  prof[6] = -1;
  prof[8] = -1;
  unsigned smid;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  prof[7] = smid;
}

// Stage `count` elements of one logical array (its re plane, and its im plane for SPLIT) from element `row` on
// into shared memory at dst (planes plane_bytes apart).
template <int K, typename T>   // T: the array's element type (Arr)
__device__ __forceinline__ void stage_array(unsigned char* dst, int plane_bytes, const void* re, const void* im,
                                            size_t row, int count, uint64_t* bar, unsigned& tx) {
  using R = Arr<K, T>;
  const int nb = count * R::esize;
  stage_copy(dst, static_cast<const unsigned char*>(re) + row * R::esize, nb, bar, tx);
  if constexpr (K == SPLIT)
    stage_copy(dst + plane_bytes, static_cast<const unsigned char*>(im) + row * R::esize, nb, bar, tx);
}

// Entry m of the state entering chunk c of sequence q, once chunk c - 1 has published its inclusive state
// (chunk 0: x0, or zero without one).
template <typename A>
__device__ __forceinline__ A entering_state(const ScanArgs& a, int q, int c, int m) {
  if (c == 0) return a.x0 ? static_cast<const A*>(a.x0)[static_cast<size_t>(q) * a.N + m] : zero_v<A>();
  return ldcg_v(static_cast<const A*>(a.incl) + (static_cast<size_t>(q) * a.C + c - 1) * a.N + m);
}

}  // namespace pdk

// The block forward: one block per (sequence, chunk), one thread per state entry, the chunk staged in shared
// memory and each step's scatter-add done there (Scatter). Any N <= 1024. The algorithm: pd_scan_common.cuh.
#include "pd_scan_kernels.cuh"

namespace pdk {

// ---------------------------------------------------------------- scatter-add in shared memory
__device__ __forceinline__ void add4(float& r, float4 v) { r += (v.x + v.y) + (v.z + v.w); }
__device__ __forceinline__ void add4(float2& r, float4 v) { r.x += v.x + v.z; r.y += v.y + v.w; }

// One scatter-add step of a whole block: every thread calls step(dest, val) (dest < 0: adds nothing) and gets
// back the sum of the values sent to its own entry. Double-buffered by parity, so one barrier per step.
// PW: lanes of a warp with equal dest are summed with shuffles, and the group leader stores into its warp's
// slot of that entry (no atomics); the reader sums its entry's W slots (contiguous: 16-byte loads); leaders
// clear their slot when the buffer comes round again. Slots are swizzled by dest to spread the stores over the
// banks. Without PW (large N): shared-memory atomics into one buffer, cleared by the reader.
template <typename A, int WPW>
struct Scatter {
  static constexpr int W = WPW > 0 ? WPW : 1;
  static constexpr bool vec = (W * (int)sizeof(A)) % 16 == 0;
  A* buf;           // [2][Np][W]
  int Np, m, par;
  int old0, old1;   // PW: the slot this lane last wrote as leader in each parity's buffer (-1: none)
  __device__ void init(A* b, int np) {
    buf = b; Np = np; m = threadIdx.x; par = 0; old0 = old1 = -1;
#pragma unroll
    for (int i = 0; i < 2 * W; ++i) buf[((i / W) * Np + m) * W + (i % W)] = zero_v<A>();
  }
  __device__ __forceinline__ A step(int dest, A val) {
    A* base = buf + par * W * Np;
    if constexpr (WPW > 0) {
      const int lane = threadIdx.x & 31;
      const unsigned mask = __match_any_sync(0xffffffffu, dest);
      const int maxc = __reduce_max_sync(0xffffffffu, static_cast<unsigned>(__popc(mask)));
      A sum = val;
      unsigned others = mask & ~(1u << lane);
      for (int i = 1; i < maxc; ++i) {
        const int src = others ? __ffs(others) - 1 : lane;
        const A t = shfl_v(val, src);
        if (others) {
          sum = addv(sum, t);
          others &= others - 1;
        }
      }
      // This parity's buffer was read two steps ago (before the last barrier): the leaders of that step clear
      // their slots, then this step's leaders store (the warp's stores stay ordered across the __syncwarp).
      const int old = par ? old1 : old0;
      if (old >= 0) base[old] = zero_v<A>();
      __syncwarp();
      int slot = -1;
      if (dest >= 0 && lane == __ffs(mask) - 1) {
        const int w = threadIdx.x >> 5;
        slot = dest * W + (W > 1 ? (w ^ ((dest >> 2) & (W - 1))) : 0);
        base[slot] = sum;
      }
      if (par) old1 = slot;
      else old0 = slot;
    } else {
      if (dest >= 0) atomic_add_v(&base[dest], val);
    }
    __syncthreads();
    A r = zero_v<A>();
    A* row = base + m * W;
    if constexpr (vec) {
      float4* r4 = reinterpret_cast<float4*>(row);
#pragma unroll
      for (int i = 0; i < W * (int)sizeof(A) / 16; ++i) {
        add4(r, r4[i]);
        if constexpr (WPW == 0) r4[i] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    } else {
#pragma unroll
      for (int w = 0; w < W; ++w) {
        r = addv(r, row[w]);
        if constexpr (WPW == 0) row[w] = zero_v<A>();
      }
    }
    par ^= 1;
    return r;
  }
};

// ---------------------------------------------------------------- forward
template <int K, typename In, int WPW>
__global__ void __launch_bounds__(WPW ? 32 * WPW : 1024) pd_fwd_kernel(ScanArgs a) {
  using DT = typename Planes<In>::D;
  using VT = typename Planes<In>::V;
  using RD = Arr<K, DT>;   // D
  using RV = Arr<K, VT>;   // b, x
  using A = typename RV::A;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int s_fast;
  const int N = a.N, T = a.T, C = a.C;
  const int Np = blockDim.x;
  const int m = threadIdx.x;
  const bool act = m < N;
  int* flags = a.counter + 1;

  __shared__ uint64_t s_bar;
  const Chunk ch = claim_chunk(a, false, &s_bar);
  const int c = ch.c, q = ch.q, Tc = ch.Tc;
  const size_t row0 = ch.row0;
  long long* prof = ch.prof;   // optional timing probes

  // shared layout: scatter buffers [2][W][Np] A | D planes | b planes | P
  constexpr int W = WPW > 0 ? WPW : 1;
  Scatter<A, WPW> sc;
  sc.init(reinterpret_cast<A*>(smem), Np);
  unsigned char* sD = smem + align16(2 * W * Np * (int)sizeof(A));
  // (one size where D's type is the others': the forms with one type compile as they did before Mixed)
  const int plane_bytes = align16(T * N * RV::esize);
  const int dplane_bytes = kOneType<In> ? plane_bytes : align16(T * N * RD::esize);
  unsigned char* sB = sD + RD::planes * dplane_bytes;
  const Idx* sP = reinterpret_cast<const Idx*>(sB + RV::planes * plane_bytes);
  // elements between planes in shared memory
  const int pstride = plane_bytes / RV::esize;
  const int dstride = kOneType<In> ? pstride : dplane_bytes / RD::esize;

  {
    unsigned tx = 0;
    stage_array<K, DT>(sD, dplane_bytes, a.a0_re, a.a0_im, row0, Tc * N, &s_bar, tx);
    stage_array<K, VT>(sB, plane_bytes, a.a1_re, a.a1_im, row0, Tc * N, &s_bar, tx);
    stage_copy(const_cast<Idx*>(sP), a.P + row0, Tc * N * (int)sizeof(Idx), &s_bar, tx);
    stage_finish(&s_bar, tx);
    __syncthreads();
    sanitize_idx(const_cast<Idx*>(sP), Tc * N, N);
    if (threadIdx.x == 0) s_fast = (c == 0) ? 1 : ready(flags + static_cast<size_t>(q) * C + c - 1);
    __syncthreads();
  }
  const bool fast = s_fast;   // entering state known: no aggregate needed, publish the inclusive after the replay
  if (prof && threadIdx.x == 0) prof_staged(prof);
  auto Dk = [&](int k, int i) { return RD::sload(sD, k * N + i, dstride); };
  auto Bk = [&](int k, int i) { return RV::sload(sB, k * N + i, pstride); };
  auto Pk = [&](int k, int i) { return static_cast<int>(sP[k * N + i]); };

  const size_t cbase = (static_cast<size_t>(q) * C + c) * N;
  A* agg_d = static_cast<A*>(a.agg_d);
  A* agg_v = static_cast<A*>(a.agg_v);
  A* incl = static_cast<A*>(a.incl);

  A xin = zero_v<A>();
  if (fast) {
    if (act) xin = entering_state<A>(a, q, c, m);
  } else {
    // 1. aggregate of this chunk from a zero entering state: zero-state end y, and where each entering entry
    //    ends up (pi) with which factor (d) -- the latter a per-thread gather chain
    A y = zero_v<A>(), d = one_v<A>();
    int pi = m;
    if (act) {
      y = Bk(0, m);
      d = Dk(0, m);
      pi = Pk(0, m);
    }
    for (int k = 1; k < Tc; ++k) {
      int dest = -1;
      A val = zero_v<A>();
      if (act) {
        dest = Pk(k, m);
        val = cmul(Dk(k, m), y);
        d = cmul(Dk(k, pi), d);
        pi = Pk(k, pi);
      }
      const A r = sc.step(dest, val);
      if (act) y = addv(Bk(k, m), r);
    }
    if (act) {
      a.agg_pi[cbase + m] = pi;
      agg_d[cbase + m] = d;
      agg_v[cbase + m] = y;
    }
    publish_flag(flags + static_cast<size_t>(q) * C + c, 1);
    if (prof && threadIdx.x == 0) prof[2] = clock64();

    // 2. look back to the nearest inclusive state, then apply the aggregates in between
    const int* qflags = flags + static_cast<size_t>(q) * C;
    const int j = look_back(qflags, c - 1, -1, C);
    if (prof && threadIdx.x == 0) {
      prof[3] = clock64();
      prof[6] = c - 1 - j;
    }
    A st = zero_v<A>();
    if (act) st = entering_state<A>(a, q, j + 1, m);
    // aggregates j+1 .. c-1, LB at a time: their loads are issued together, then one barrier per aggregate
    for (int i0 = j + 1; i0 < c; i0 += LB) {
      int pb[LB];
      A db[LB], yb[LB];
#pragma unroll
      for (int u = 0; u < LB; ++u) {
        pb[u] = -1;
        db[u] = zero_v<A>();
        yb[u] = zero_v<A>();
        if (act && i0 + u < c) {
          const size_t ib = (static_cast<size_t>(q) * C + i0 + u) * N + m;
          pb[u] = __ldcg(a.agg_pi + ib);
          db[u] = ldcg_v(agg_d + ib);
          yb[u] = ldcg_v(agg_v + ib);
        }
      }
#pragma unroll
      for (int u = 0; u < LB; ++u) {
        if (i0 + u < c) {
          const A r = sc.step(pb[u], cmul(db[u], st));
          if (act) st = addv(yb[u], r);
        }
      }
    }
    xin = st;
    // inclusive state at this chunk's end: y + scatter(pi, d * xin)
    const A r = sc.step(act ? pi : -1, cmul(d, xin));
    if (act) incl[cbase + m] = addv(y, r);
    publish_flag(flags + static_cast<size_t>(q) * C + c, 2);
    if (prof && threadIdx.x == 0) prof[4] = clock64();
  }

  // 3. replay from xin, writing x
  A y = xin;
  for (int k = 0; k < Tc; ++k) {
    int dest = -1;
    A val = zero_v<A>();
    if (act) {
      dest = Pk(k, m);
      val = cmul(Dk(k, m), y);
    }
    const A r = sc.step(dest, val);
    if (act) {
      y = addv(Bk(k, m), r);
      RV::gstore(a.out_re, a.out_im, row0 + static_cast<size_t>(k) * N + m, y);
    }
  }
  if (fast) {
    if (act) incl[cbase + m] = y;
    publish_flag(flags + static_cast<size_t>(q) * C + c, 2);
  }
  if (prof && threadIdx.x == 0) prof[5] = clock64();
}

template <int K, typename In>
Kernel fwd_block_kernel(int bufs) {
  return bufs == 1 ? pd_fwd_kernel<K, In, 1> : bufs == 2 ? pd_fwd_kernel<K, In, 2>
       : bufs == 4 ? pd_fwd_kernel<K, In, 4> : bufs == 8 ? pd_fwd_kernel<K, In, 8> : pd_fwd_kernel<K, In, 0>;
}
#define PDK_INSTANTIATE(K, In) template Kernel fwd_block_kernel<K, In>(int);
PDK_FORMS(PDK_INSTANTIATE)

}  // namespace pdk

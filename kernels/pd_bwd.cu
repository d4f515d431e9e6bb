// The backward: one block per (sequence, chunk), last chunk first, one thread per state entry, the chunk staged
// in shared memory; the gather recurrence run with the three phases of pd_scan_common.cuh.
#include "pd_scan_kernels.cuh"

namespace pdk {

// ---------------------------------------------------------------- backward
template <int K, typename In>
__global__ void __launch_bounds__(1024) pd_bwd_kernel(ScanArgs a) {
  using DT = typename Planes<In>::D;
  using VT = typename Planes<In>::V;
  using RD = Arr<K, DT>;   // D
  using RV = Arr<K, VT>;   // g, x, grad_b, grad_D
  using A = typename RV::A;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int s_fast;
  const int N = a.N, T = a.T, C = a.C;
  const int Np = blockDim.x;
  const int m = threadIdx.x;
  const bool act = m < N;
  int* flags = a.counter + 1;

  __shared__ uint64_t s_bar;
  const Chunk ch = claim_chunk(a, true, &s_bar);   // last chunk first
  const int c = ch.c, q = ch.q, Tc = ch.Tc;
  const size_t row0 = ch.row0;

  // shared layout: buf[2][Np] A | D planes | g planes | x planes (slot k = x_{s0+k-1}) | P
  A* buf = reinterpret_cast<A*>(smem);
  unsigned char* sD = smem + align16(2 * Np * (int)sizeof(A));
  // (one size where D's type is the others': the forms with one type compile as they did before Mixed)
  const int plane_bytes = align16(T * N * RV::esize);
  const int dplane_bytes = kOneType<In> ? plane_bytes : align16(T * N * RD::esize);
  unsigned char* sG = sD + RD::planes * dplane_bytes;
  unsigned char* sX = sG + RV::planes * plane_bytes;
  const Idx* sP = reinterpret_cast<const Idx*>(sX + RV::planes * plane_bytes);
  const int pstride = plane_bytes / RV::esize;
  const int dstride = kOneType<In> ? pstride : dplane_bytes / RD::esize;

  {
    unsigned tx = 0;
    stage_array<K, DT>(sD, dplane_bytes, a.a0_re, a.a0_im, row0, Tc * N, &s_bar, tx);
    stage_array<K, VT>(sG, plane_bytes, a.a1_re, a.a1_im, row0, Tc * N, &s_bar, tx);
    // x rows s0-1 .. s0+Tc-2 into slots 0..Tc-1 (slot 0 of chunk 0 is x0, read separately)
    const int xs = (c == 0) ? 1 : 0;
    const size_t xrow = row0 - static_cast<size_t>(N) + static_cast<size_t>(xs) * N;
    stage_array<K, VT>(sX + xs * N * RV::esize, plane_bytes, a.a2_re, a.a2_im, xrow, (Tc - xs) * N, &s_bar, tx);
    stage_copy(const_cast<Idx*>(sP), a.P + row0, Tc * N * (int)sizeof(Idx), &s_bar, tx);
    stage_finish(&s_bar, tx);
    __syncthreads();
    sanitize_idx(const_cast<Idx*>(sP), Tc * N, N);
    if (threadIdx.x == 0) s_fast = (c == C - 1) ? 1 : ready(flags + static_cast<size_t>(q) * C + c + 1);
    __syncthreads();
  }
  const bool fast = s_fast;
  auto Dk = [&](int k, int i) { return RD::sload(sD, k * N + i, dstride); };
  auto Gk = [&](int k, int i) { return RV::sload(sG, k * N + i, pstride); };
  auto Pk = [&](int k, int i) { return static_cast<int>(sP[k * N + i]); };
  const A* x0 = static_cast<const A*>(a.x0);
  A x0m = zero_v<A>();
  if (c == 0 && act && x0) x0m = x0[static_cast<size_t>(q) * N + m];
  auto Xk = [&](int k, int i) { return (c == 0 && k == 0) ? x0m : RV::sload(sX, k * N + i, pstride); };

  const size_t cbase = (static_cast<size_t>(q) * C + c) * N;
  A* agg_d = static_cast<A*>(a.agg_d);
  A* agg_v = static_cast<A*>(a.agg_v);
  A* incl = static_cast<A*>(a.incl);

  A vin = zero_v<A>();   // carry into this chunk's last step: lam_{e} = g_e + vin
  if (fast) {
    if (c != C - 1 && act) vin = ldcg_v(incl + (static_cast<size_t>(q) * C + c + 1) * N + m);
  } else {
    // 1. aggregate: zero-carry exit value v and the gather map (pi, d) through the chunk
    A v = zero_v<A>(), d = one_v<A>();
    int pi = m;
    if (act) buf[((Tc - 1) & 1) * Np + m] = Gk(Tc - 1, m);
    __syncthreads();
    for (int k = Tc - 1; k >= 0; --k) {
      const int cur = k & 1;
      const int kk = Tc - 1 - k;   // map tracking runs forward in time
      if (act) {
        const A g = buf[cur * Np + Pk(k, m)];
        if (k > 0) buf[(cur ^ 1) * Np + m] = addv(Gk(k - 1, m), cmul(conjv(Dk(k, m)), g));
        else v = cmul(conjv(Dk(0, m)), g);
        d = cmul(d, conjv(Dk(kk, pi)));
        pi = Pk(kk, pi);
      }
      __syncthreads();
    }
    if (act) {
      a.agg_pi[cbase + m] = pi;
      agg_d[cbase + m] = d;
      agg_v[cbase + m] = v;
    }
    publish_flag(flags + static_cast<size_t>(q) * C + c, 1);

    // 2. look ahead (later chunks) to the nearest inclusive exit value, apply the aggregates in between
    const int* qflags = flags + static_cast<size_t>(q) * C;
    const int j = look_back(qflags, c + 1, +1, C);
    A st = zero_v<A>();
    if (act && j < C) st = ldcg_v(incl + (static_cast<size_t>(q) * C + j) * N + m);
    int step = 0;
    for (int i0 = j - 1; i0 > c; i0 -= LB) {
      int pb[LB];
      A db[LB], vb[LB];
#pragma unroll
      for (int u = 0; u < LB; ++u) {
        pb[u] = 0;
        db[u] = zero_v<A>();
        vb[u] = zero_v<A>();
        if (act && i0 - u > c) {
          const size_t ib = (static_cast<size_t>(q) * C + i0 - u) * N + m;
          pb[u] = __ldcg(a.agg_pi + ib);
          db[u] = ldcg_v(agg_d + ib);
          vb[u] = ldcg_v(agg_v + ib);
        }
      }
#pragma unroll
      for (int u = 0; u < LB; ++u) {
        if (i0 - u > c) {
          const int cur = (step + u) & 1;
          if (act) buf[cur * Np + m] = st;
          __syncthreads();
          if (act) st = addv(vb[u], cmul(db[u], buf[cur * Np + pb[u]]));
        }
      }
      step += min(LB, i0 - c);
    }
    vin = st;
    if (act) buf[(step & 1) * Np + m] = vin;
    __syncthreads();
    if (act) incl[cbase + m] = addv(v, cmul(d, buf[(step & 1) * Np + pi]));
    publish_flag(flags + static_cast<size_t>(q) * C + c, 2);
  }

  // 3. replay backwards in time from vin, writing grad_b and grad_D
  if (act) buf[((Tc - 1) & 1) * Np + m] = addv(Gk(Tc - 1, m), vin);
  __syncthreads();
  A vout = zero_v<A>();
  for (int k = Tc - 1; k >= 0; --k) {
    const int cur = k & 1;
    if (act) {
      const A lam = buf[cur * Np + m];
      const A g = buf[cur * Np + Pk(k, m)];
      const size_t o = row0 + static_cast<size_t>(k) * N + m;
      RV::gstore(a.out_re, a.out_im, o, lam);
      RV::gstore(a.out2_re, a.out2_im, o, cmul(conjv(Xk(k, m)), g));
      if (k > 0) buf[(cur ^ 1) * Np + m] = addv(Gk(k - 1, m), cmul(conjv(Dk(k, m)), g));
      else vout = cmul(conjv(Dk(0, m)), g);
    }
    __syncthreads();
  }
  if (c == 0 && act && a.gx0) static_cast<A*>(a.gx0)[static_cast<size_t>(q) * N + m] = vout;
  if (fast) {
    if (act) incl[cbase + m] = vout;
    publish_flag(flags + static_cast<size_t>(q) * C + c, 2);
  }
}

template <int K, typename In>
Kernel bwd_kernel() {
  return pd_bwd_kernel<K, In>;
}
#define PDK_INSTANTIATE(K, In) template Kernel bwd_kernel<K, In>();
PDK_FORMS(PDK_INSTANTIATE)

}  // namespace pdk

// Forward kernel 4 ("cluster"): inputs read once, outputs written once, no look-back.
// Included by pd_scan.cu inside namespace pdk, after pd_scan_gather.cuh (uses Arr, build_lists, bulk copies).
//
// Why: the look-back kernels either read their chunk twice (fold, then replay) or apply many predecessor
// aggregates per chunk; at B=32 the GPU holds a few hundred chunks at once, so every chunk waits on a long
// chain. Here one thread-block cluster of CS CTAs (on CS SMs) owns a sequence, CTA r takes chunks r, r+CS, ...,
// and the state passes from CTA to CTA through distributed shared memory (st.async, one hop per chunk).
// Inside a CTA, GA "compose" warps and GR "replay" warps; lane l of a warp owns entries l + 32 e, e < E = N / 32:
//   compose (needs the chunk's inputs only, so it runs ahead of the chain): sorts every step's sources by
//     destination once (gather lists, as the gather kernel), then the chunk's aggregate: where entry m of the
//     entering state ends (column map Q, with its own lists), its gain G (gathers along each entry's path) and
//     the end state Y for a zero entering state (one gather step per step);
//   replay: with the entering state x_in (in this CTA's inbox), the chunk's end state Y + sum over Q's lists of
//     G x_in is the next chunk's entering state, sent on at once (the chain costs one gather and one hop per
//     chunk); then the chunk is replayed step by step from x_in out of shared memory, writing the outputs.
//     Replay warp j takes the CTA's chunks k = j, j + GR, ... (inbox slot j); compose warp g the chunks g, g + GA.
// A step is: w[m] = D_t[m] x[m] into shared memory, __syncwarp, x[n] = b_t[n] + sum of w over n's list.
// No shared-memory atomics and no block barriers on the chains: on the H200 a 64-bit compare-and-swap add costs
// ~230 cycles with no collision and ~32k when all entries merge, a store + 4-warp barrier + load ~54
// (bench/scatter_step_micro.py); one warp per chain lets many chunks run at once on an SM.
// Inputs arrive by bulk copies (TMA) into an NS-deep ring of stages, each freed by the replay.

constexpr int CLH = 2;   // list sources per entry read ahead of a step's __syncwarp

template <int K, typename In>
struct ClusterLayout {
  int bars, inbox, wbuf, agg, Y, G, Q, qcnt, qoff, qsrc, agg_bytes;
  int stage, P, D, B, cnt, off, src, stage_bytes, total;
  // barriers | GR inbox slots [N] | per warp w [2][N] | NS aggregates (Y, G, Q and Q's lists) |
  // NS stages (P, D planes, b planes, the steps' lists)
  __host__ __device__ ClusterLayout(int N, int T, int NS, int GA, int GR) {
    using R = Arr<K, In>;
    const int asize = (int)sizeof(typename R::A);
    const int plane = align16(T * N * R::esize);
    bars = 0;
    inbox = align16((2 * NS + GR) * 8);
    wbuf = inbox + GR * align16(N * asize);
    agg = wbuf + (GA + GR) * align16(2 * N * asize);   // per warp
    Y = 0;
    G = align16(N * asize);
    Q = 2 * G;
    qcnt = Q + align16(N * 2);
    qoff = qcnt + align16(N * 2);
    qsrc = qoff + align16((N + 1) * 2);
    agg_bytes = qsrc + align16(N * 2);
    stage = agg + NS * agg_bytes;
    P = 0;
    D = align16(T * N * 2);
    B = D + R::planes * plane;
    cnt = B + R::planes * plane;
    off = cnt + align16(T * N * 2);
    src = off + align16(T * (N + 1) * 2);
    stage_bytes = src + align16(T * N * 2);
    total = stage + NS * stage_bytes;
  }
};

__device__ __forceinline__ void mbar_init_count(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// Wait for a phase completed by st.async writes of other CTAs of the cluster (acquire at cluster scope).
__device__ __forceinline__ void mbar_wait_cluster(uint64_t* bar, unsigned parity) {
  unsigned done = 0;
  do {
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
                 " selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
  } while (!done);
}
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ unsigned remote_addr(const void* local, unsigned rank) {
  unsigned r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(smem_u32(local)), "r"(rank));
  return r;
}
__device__ __forceinline__ void cluster_sync_all() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// Store into another CTA's shared memory, counted on that CTA's mbarrier (complete_tx).
__device__ __forceinline__ void send_async(unsigned raddr, float v, unsigned rbar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];\n" ::"r"(raddr),
               "r"(__float_as_uint(v)), "r"(rbar) : "memory");
}
__device__ __forceinline__ void send_async(unsigned raddr, float2 v, unsigned rbar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];\n" ::"r"(raddr),
               "f"(v.x), "f"(v.y), "r"(rbar) : "memory");
}

// One gather step of one warp (lane l owns entries l + 32 e): out[m] = b[m] + sum over m's list of w, where
// w[m] = val[m]. What does not depend on the chain (list bounds, first CLH sources, D and b) is read into a
// ListStep a step ahead; w is double-buffered by parity, so one __syncwarp per step.
template <typename A, int E>
struct ListStep {
  int lo[E], n[E], s[E][CLH];
  A d[E], b[E];
};
template <typename A, int E>
struct WarpGather {
  A* w;   // [2][N]
  int lane, par;
  __device__ void init(A* w_, int lane_) { w = w_; lane = lane_; par = 0; }
  template <typename DFn, typename BFn>
  __device__ __forceinline__ ListStep<A, E> prefetch(const Idx* off, const Idx* src, DFn d, BFn b) const {
    ListStep<A, E> g;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const int m = lane + 32 * e;
      g.lo[e] = off[m];
      g.n[e] = off[m + 1] - g.lo[e];
#pragma unroll
      for (int j = 0; j < CLH; ++j) g.s[e][j] = j < g.n[e] ? src[g.lo[e] + j] : 0;
      g.d[e] = d(m);
      g.b[e] = b(m);
    }
    return g;
  }
  __device__ __forceinline__ void step(const ListStep<A, E>& g, const Idx* src, A (&x)[E]) {
    A* wb = w + par * 32 * E;
    par ^= 1;
#pragma unroll
    for (int e = 0; e < E; ++e) wb[lane + 32 * e] = cmul(g.d[e], x[e]);
    __syncwarp();
    A v[E][CLH];
#pragma unroll
    for (int e = 0; e < E; ++e)
#pragma unroll
      for (int j = 0; j < CLH; ++j) v[e][j] = j < g.n[e] ? wb[g.s[e][j]] : zero_v<A>();
#pragma unroll
    for (int e = 0; e < E; ++e) {
      A acc = g.b[e];
#pragma unroll
      for (int j = 0; j < CLH; ++j) acc = addv(acc, v[e][j]);
      for (int i = g.lo[e] + CLH; i < g.lo[e] + g.n[e]; ++i) acc = addv(acc, wb[src[i]]);
      x[e] = acc;
    }
  }
};

template <int K, typename In, int E>
__global__ void __launch_bounds__(512) pd_fwd_cluster_kernel(ScanArgs a, int CS, int NS, int GA, int GR) {
  using R = Arr<K, In>;
  using A = typename R::A;
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int N = 32 * E;
  const int T = a.T, C = a.C, L = a.L, TN = a.T * N;
  const ClusterLayout<K, In> lay(N, T, NS, GA, GR);
  const int rank = static_cast<int>(cluster_rank());
  const int q = blockIdx.x / CS;
  const int wid = threadIdx.x >> 5, lane = threadIdx.x & 31;   // warps 0..GA-1 compose, GA..GA+GR-1 replay
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + lay.bars);   // stage k % NS loaded
  uint64_t* ready = full + NS;                                       // aggregate k % NS composed
  uint64_t* inbar = ready + NS;                                      // [GR] entering state arrived
  const int Kr = rank < C ? (C - 1 - rank) / CS + 1 : 0;          // chunks of this CTA
  constexpr int asize = (int)sizeof(A);

  auto stage_of = [&](int k) { return smem + lay.stage + (k % NS) * lay.stage_bytes; };
  auto agg_of = [&](int k) { return smem + lay.agg + (k % NS) * lay.agg_bytes; };
  auto inbox_of = [&](int k) { return reinterpret_cast<A*>(smem + lay.inbox + (k % GR) * align16(N * asize)); };
  // one thread: bulk-copy chunk k of this CTA into its stage (sizes are multiples of 16: N % 8 == 0)
  auto load = [&](int k) {
    const int s0 = (rank + k * CS) * T, Tc = min(T, L - s0);
    const size_t row0 = (static_cast<size_t>(q) * L + s0) * N;
    unsigned char* st = stage_of(k);
    uint64_t* bar = full + k % NS;
    const unsigned pb = Tc * N * 2, eb = Tc * N * R::esize;
    mbar_arrive_expect_tx(bar, pb + 2 * R::planes * eb);
    bulk_g2s(st + lay.P, a.P + row0, pb, bar);
    const int plane = (lay.B - lay.D) / R::planes;
    const void* src[4] = {a.a0_re, a.a0_im, a.a1_re, a.a1_im};
    for (int j = 0; j < 2; ++j)
      for (int pl = 0; pl < R::planes; ++pl)
        bulk_g2s(st + (j ? lay.B : lay.D) + pl * plane,
                 static_cast<const unsigned char*>(src[2 * j + pl]) + row0 * R::esize, eb, bar);
  };
  bool bad = false;
  auto idx = [&](int p) {   // out-of-range P (a contract violation) reads entry 0 and raises the error flag
    if (static_cast<unsigned>(p) >= static_cast<unsigned>(N)) { bad = true; return 0; }
    return p;
  };

  WarpGather<A, E> gg;
  gg.init(reinterpret_cast<A*>(smem + lay.wbuf + wid * align16(2 * N * asize)), lane);
  // entering states replay warp j receives: its chunks, less chunk 0 of the sequence (it starts from x0)
  const int j = wid - GA;
  int recv_left = (j >= 0 && j < Kr) ? (Kr - 1 - j) / GR + 1 - (rank == 0 && j == 0 ? 1 : 0) : 0;
  if (threadIdx.x == 0) {
    for (int s = 0; s < NS; ++s) {
      mbar_init_count(full + s, 1);
      mbar_init_count(ready + s, 32);
    }
    for (int g = 0; g < GR; ++g) mbar_init_count(inbar + g, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x == 0)
    for (int k = 0; k < min(NS, Kr); ++k) load(k);
  if (j >= 0 && lane == 0 && recv_left > 0) mbar_arrive_expect_tx(inbar + j, N * asize);
  cluster_sync_all();   // every CTA's barriers exist before any st.async reaches them

  // optional clock64 anatomy (a.prof, [S * CS, 8]): 0 compose waits for data, 1 compose work, 2 replay waits for
  // the aggregate, 3 replay waits for the entering state, 4 link, 5 replay steps, 6 lifetime, 7 chunks
  long long pr[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const long long t_start = clock64();
  if (wid < GA) {
    // ---------------- compose: lists, then the aggregate (Q, G, Y) of chunks k = wid, wid + GA, ...
    for (int k = wid; k < Kr; k += GA) {
      const int Tc = min(T, L - (rank + k * CS) * T);
      long long t0 = clock64();
      mbar_wait(full + k % NS, (k / NS) & 1);
      long long t1 = clock64();
      pr[0] += t1 - t0;
      unsigned char* st = stage_of(k);
      const Idx* sP = reinterpret_cast<const Idx*>(st + lay.P);
      const unsigned char* sD = st + lay.D;
      const unsigned char* sB = st + lay.B;
      Idx* off = reinterpret_cast<Idx*>(st + lay.off);
      Idx* src = reinterpret_cast<Idx*>(st + lay.src);
      build_lists(Tc, N, [&](int i) { return idx(sP[i]); }, reinterpret_cast<uint16_t*>(st + lay.cnt), off, src,
                  lane, 32, -1);
      int qi[E];
      A gain[E], y[E];
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const int m = lane + 32 * e;
        qi[e] = idx(sP[m]);
        gain[e] = R::sload(sD, m, TN);
        y[e] = R::sload(sB, m, TN);
      }
      auto stepin = [&](int t) {
        return gg.prefetch(off + t * (N + 1), src + t * N, [&](int m) { return R::sload(sD, t * N + m, TN); },
                           [&](int m) { return R::sload(sB, t * N + m, TN); });
      };
      ListStep<A, E> nx;
      if (Tc > 1) nx = stepin(1);
      for (int t = 1; t < Tc; ++t) {
        const ListStep<A, E> cur = nx;
        if (t + 1 < Tc) nx = stepin(t + 1);
#pragma unroll
        for (int e = 0; e < E; ++e) {
          const int pq = idx(sP[t * N + qi[e]]);
          gain[e] = cmul(R::sload(sD, t * N + qi[e], TN), gain[e]);
          qi[e] = pq;
        }
        gg.step(cur, src + t * N, y);
      }
      unsigned char* ag = agg_of(k);
      Idx* Q = reinterpret_cast<Idx*>(ag + lay.Q);
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const int m = lane + 32 * e;
        reinterpret_cast<A*>(ag + lay.Y)[m] = y[e];
        reinterpret_cast<A*>(ag + lay.G)[m] = gain[e];
        Q[m] = static_cast<Idx>(qi[e]);
      }
      __syncwarp();
      build_lists(1, N, [&](int i) { return static_cast<int>(Q[i]); }, reinterpret_cast<uint16_t*>(ag + lay.qcnt),
                  reinterpret_cast<Idx*>(ag + lay.qoff), reinterpret_cast<Idx*>(ag + lay.qsrc), lane, 32, -1);
      mbar_arrive(ready + k % NS);
      pr[1] += clock64() - t1;
    }
  } else if (j < GR) {
    // ---------------- link (entering state -> next CTA) and replay of chunks k = j, j + GR, ...
    const unsigned next = static_cast<unsigned>((rank + 1) % CS);
    unsigned in_par = 0;
    for (int k = j; k < Kr; k += GR) {
      const int c = rank + k * CS, s0 = c * T, Tc = min(T, L - s0);
      const size_t row0 = (static_cast<size_t>(q) * L + s0) * N;
      long long t0 = clock64();
      mbar_wait(ready + k % NS, (k / NS) & 1);
      mbar_wait(full + k % NS, (k / NS) & 1);
      long long t1 = clock64();
      pr[2] += t1 - t0;
      const unsigned char* ag = agg_of(k);
      const unsigned char* st = stage_of(k);
      const unsigned char* sD = st + lay.D;
      const unsigned char* sB = st + lay.B;
      const Idx* off = reinterpret_cast<const Idx*>(st + lay.off);
      const Idx* src = reinterpret_cast<const Idx*>(st + lay.src);
      const Idx* qoff = reinterpret_cast<const Idx*>(ag + lay.qoff);
      const Idx* qsrc = reinterpret_cast<const Idx*>(ag + lay.qsrc);
      const A* G = reinterpret_cast<const A*>(ag + lay.G);
      const A* Y = reinterpret_cast<const A*>(ag + lay.Y);
      auto stepin = [&](int t) {
        return gg.prefetch(off + t * (N + 1), src + t * N, [&](int m) { return R::sload(sD, t * N + m, TN); },
                           [&](int m) { return R::sload(sB, t * N + m, TN); });
      };
      ListStep<A, E> nx = stepin(0);   // the first step, read ahead of the entering state
      A* xs = inbox_of(k);
      if (c == 0) {
#pragma unroll
        for (int e = 0; e < E; ++e)
          xs[lane + 32 * e] = a.x0 ? static_cast<const A*>(a.x0)[static_cast<size_t>(q) * N + lane + 32 * e]
                                   : zero_v<A>();
        __syncwarp();
      } else {
        mbar_wait_cluster(inbar + j, in_par);
        in_par ^= 1;
        if (lane == 0 && --recv_left > 0) mbar_arrive_expect_tx(inbar + j, N * asize);
      }
      long long t2 = clock64();
      pr[3] += t2 - t1;
      A x[E];
#pragma unroll
      for (int e = 0; e < E; ++e) x[e] = xs[lane + 32 * e];
      if (c + 1 < C) {   // chunk c + 1 is the next CTA's chunk k (k + 1 when this is the last rank)
        const int slot = (rank + 1 == CS ? k + 1 : k) % GR;
        const unsigned rbar = remote_addr(inbar + slot, next);
#pragma unroll
        for (int e = 0; e < E; ++e) {
          const int m = lane + 32 * e;
          A xe = Y[m];
          for (int i = qoff[m]; i < qoff[m + 1]; ++i) {
            const int s = qsrc[i];
            xe = addv(xe, cmul(G[s], xs[s]));
          }
          send_async(remote_addr(inbox_of(slot) + m, next), xe, rbar);
        }
      }
      t1 = clock64();
      pr[4] += t1 - t2;
      for (int t = 0; t < Tc; ++t) {
        const ListStep<A, E> cur = nx;
        if (t + 1 < Tc) nx = stepin(t + 1);
        gg.step(cur, src + t * N, x);
#pragma unroll
        for (int e = 0; e < E; ++e) R::gstore(a.out_re, a.out_im, row0 + t * N + lane + 32 * e, x[e]);
      }
      __syncwarp();   // every read of this stage is done: refill it
      pr[5] += clock64() - t1;
      pr[7] += 1;
      if (lane == 0 && k + NS < Kr) {
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        load(k + NS);
      }
    }
  }
  if (bad) atomicOr(a.counter + 1, 1);
  if (a.prof && lane == 0) {
    pr[6] = wid == GA ? clock64() - t_start : 0;
    for (int i = 0; i < 8; ++i)
      if (pr[i]) atomicAdd(reinterpret_cast<unsigned long long*>(a.prof) + 8 * blockIdx.x + i, pr[i]);
  }
  cluster_sync_all();   // no CTA leaves while a st.async may still target its shared memory
}

template <int K, typename In>
int cluster_smem_bytes(int N, int T, int NS, int GA, int GR) { return ClusterLayout<K, In>(N, T, NS, GA, GR).total; }

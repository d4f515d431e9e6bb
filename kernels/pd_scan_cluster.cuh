// Forward kernel 4 ("cluster"): inputs read once, outputs written once, no look-back.
// Included by pd_scan.cu inside namespace pdk, after pd_scan_gather.cuh (uses Arr, build_lists, bulk copies).
//
// Why: the look-back kernels either read their chunk twice (fold, then replay) or apply many predecessor
// aggregates per chunk; at B=32 the GPU holds a few hundred chunks at once, so every chunk waits on a long
// chain. Here one thread-block cluster of CS CTAs (on CS SMs) owns a sequence, CTA r takes chunks r, r+CS, ...,
// and the state passes from CTA to CTA through distributed shared memory (st.async, one hop per chunk).
// Inside a CTA, GA "compose" groups and GR "replay" groups of N threads each (thread m = state entry m):
//   compose (needs the chunk's inputs only, so it runs ahead of the chain): sorts every step's sources by
//     destination once (gather lists, as the gather kernel), then the chunk's aggregate: where entry m of the
//     entering state ends (column map Q, with its own lists), its gain G (gathers along each entry's path) and
//     the end state Y for a zero entering state (one gather step per step);
//   replay: with the entering state x_in (in this CTA's inbox), the chunk's end state Y + sum over Q's lists of
//     G x_in is the next chunk's entering state, sent on at once (a segmented sum over Q's sorted sources and
//     one barrier: the chain costs that and one hop per chunk); then the chunk is replayed step by step from x_in out of shared memory, writing the
//     outputs. Replay group j takes the CTA's chunks k = j, j + GR, ... (inbox slot j).
// A step is: w[m] = D_t[m] x[m] into shared memory, one named barrier, x[n] = b_t[n] + sum of w over n's list.
// No shared-memory atomics on the chains: on the H200 a 64-bit compare-and-swap add costs ~230 cycles with no
// collision and ~32k when all entries merge, a store + barrier + load ~54 (bench/scatter_step_micro.py).
// Inputs arrive by bulk copies (TMA) into an NS-deep ring of stages, each freed by the replay.

constexpr int CLH = 4;   // list sources read ahead of a step's barrier

template <int K, typename In>
struct ClusterLayout {
  int bars, inbox, wbuf, lnk, agg, Y, G, Q, qcnt, qoff, qsrc, agg_bytes;
  int stage, P, D, B, cnt, off, src, stage_bytes, total;
  // barriers | GR inbox slots [N] | per group w [2][N] | per group the link's warp carries [8] A, [8] int |
  // NS aggregates (Y, G, Q and Q's lists) |
  // NS stages (P, D planes, b planes, the steps' lists)
  __host__ __device__ ClusterLayout(int N, int T, int NS, int GA, int GR) {
    using R = Arr<K, In>;
    const int asize = (int)sizeof(typename R::A);
    const int plane = align16(T * N * R::esize);
    bars = 0;
    inbox = align16((2 * NS + GR) * 8);
    wbuf = inbox + GR * align16(N * asize);
    lnk = wbuf + (GA + GR) * align16(2 * N * asize);
    agg = lnk + (GA + GR) * 128;
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

// One gather step of a group of N threads (thread m owns entry m): out[m] = base + sum over m's list of val.
// What does not depend on the chain (list bounds, first CLH sources, D and b) is read into a ListStep before the
// previous step's barrier; w is double-buffered by parity, so one barrier per step.
template <typename A>
struct ListStep {
  int lo, n, s[CLH];
  A d, b;
};
template <typename A>
struct LinkIn {   // thread i of the link: the i-th source s in destination order, its destination d = Q[s]
  int s, d;
  bool head, tail, empty;   // first / last of d's sources; no source flows into this thread's own entry
  A g, y;                   // G[s], Y[d]
};
__device__ __forceinline__ float shfl_up_v(float v, int o) { return __shfl_up_sync(0xffffffffu, v, o); }
__device__ __forceinline__ float2 shfl_up_v(float2 v, int o) {
  return make_float2(__shfl_up_sync(0xffffffffu, v.x, o), __shfl_up_sync(0xffffffffu, v.y, o));
}

template <typename A>
struct GroupGather {
  A* w;   // [2][N]
  int N, m, bar, par;
  __device__ void init(A* w_, int n, int m_, int bar_) { w = w_; N = n; m = m_; bar = bar_; par = 0; }
  __device__ __forceinline__ void sync() const { sync_group(bar, N); }
  // list m of (off, src); d, b of the step when given
  __device__ __forceinline__ ListStep<A> prefetch(const Idx* off, const Idx* src) const {
    ListStep<A> g;
    g.lo = off[m];
    g.n = off[m + 1] - g.lo;
#pragma unroll
    for (int j = 0; j < CLH; ++j) g.s[j] = j < g.n ? src[g.lo + j] : 0;
    return g;
  }
  __device__ __forceinline__ A step(const ListStep<A>& g, const Idx* src, A val, A base) {
    A* wb = w + par * N;
    par ^= 1;
    wb[m] = val;
    sync();
    A v[CLH];
#pragma unroll
    for (int j = 0; j < CLH; ++j) v[j] = j < g.n ? wb[g.s[j]] : zero_v<A>();
    A acc = base;
#pragma unroll
    for (int j = 0; j < CLH; ++j) acc = addv(acc, v[j]);
    for (int i = g.lo + CLH; i < g.lo + g.n; ++i) acc = addv(acc, wb[src[i]]);
    return acc;
  }
};

template <int K, typename In>
__global__ void __launch_bounds__(512, 1) pd_fwd_cluster_kernel(ScanArgs a, int CS, int NS, int GA, int GR) {
  using R = Arr<K, In>;
  using A = typename R::A;
  extern __shared__ __align__(16) unsigned char smem[];
  const int N = a.N, T = a.T, C = a.C, L = a.L, TN = a.T * a.N;
  const ClusterLayout<K, In> lay(N, T, NS, GA, GR);
  const int rank = static_cast<int>(cluster_rank());
  const int q = blockIdx.x / CS;
  const int grp = threadIdx.x / N, m = threadIdx.x % N;   // groups 0..GA-1 compose, GA..GA+GR-1 replay
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

  GroupGather<A> gg;
  gg.init(reinterpret_cast<A*>(smem + lay.wbuf + grp * align16(2 * N * asize)), N, m, 1 + grp);
  // entering states replay group j receives: its chunks, less chunk 0 of the sequence (it starts from x0)
  const int j = grp - GA;
  int recv_left = (j >= 0 && j < Kr) ? (Kr - 1 - j) / GR + 1 - (rank == 0 && j == 0 ? 1 : 0) : 0;
  if (threadIdx.x == 0) {
    for (int s = 0; s < NS; ++s) {
      mbar_init_count(full + s, 1);
      mbar_init_count(ready + s, N);
    }
    for (int g = 0; g < GR; ++g) mbar_init_count(inbar + g, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x == 0)
    for (int k = 0; k < min(NS, Kr); ++k) load(k);
  if (j >= 0 && m == 0 && recv_left > 0) mbar_arrive_expect_tx(inbar + j, N * asize);
  cluster_sync_all();   // every CTA's barriers exist before any st.async reaches them

  // optional clock64 anatomy (a.prof, [S * CS, 8]): 0 compose waits for data, 1 compose work, 2 replay waits for
  // the aggregate, 3 replay waits for the entering state, 4 link, 5 replay steps, 6 lifetime, 7 chunks
  long long pr[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const long long t_start = clock64();
  if (grp < GA) {
    // ---------------- compose: lists, then the aggregate (Q, G, Y) of chunks k = grp, grp + GA, ...
    for (int k = grp; k < Kr; k += GA) {
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
      build_lists(Tc, N, [&](int i) { return idx(sP[i]); }, reinterpret_cast<uint16_t*>(st + lay.cnt), off, src, m,
                  N, 1 + grp);
      int qi = idx(sP[m]);
      A gain = R::sload(sD, m, TN), y = R::sload(sB, m, TN);
      ListStep<A> nx;
      if (Tc > 1) {
        nx = gg.prefetch(off + (N + 1), src + N);
        nx.d = R::sload(sD, N + m, TN);
        nx.b = R::sload(sB, N + m, TN);
      }
      for (int t = 1; t < Tc; ++t) {
        const ListStep<A> cur = nx;
        if (t + 1 < Tc) {
          nx = gg.prefetch(off + (t + 1) * (N + 1), src + (t + 1) * N);
          nx.d = R::sload(sD, (t + 1) * N + m, TN);
          nx.b = R::sload(sB, (t + 1) * N + m, TN);
        }
        const int pq = idx(sP[t * N + qi]);
        gain = cmul(R::sload(sD, t * N + qi, TN), gain);
        qi = pq;
        y = gg.step(cur, src + t * N, cmul(cur.d, y), cur.b);
      }
      unsigned char* ag = agg_of(k);
      Idx* Q = reinterpret_cast<Idx*>(ag + lay.Q);
      reinterpret_cast<A*>(ag + lay.Y)[m] = y;
      reinterpret_cast<A*>(ag + lay.G)[m] = gain;
      Q[m] = static_cast<Idx>(qi);
      gg.sync();
      build_lists(1, N, [&](int i) { return static_cast<int>(Q[i]); }, reinterpret_cast<uint16_t*>(ag + lay.qcnt),
                  reinterpret_cast<Idx*>(ag + lay.qoff), reinterpret_cast<Idx*>(ag + lay.qsrc), m, N, 1 + grp);
      mbar_arrive(ready + k % NS);
      pr[1] += clock64() - t1;
    }
  } else {
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
      const A ye = reinterpret_cast<const A*>(ag + lay.Y)[m];
      LinkIn<A> link;   // the link's inputs, read ahead of the entering state
      {
        const Idx* Q = reinterpret_cast<const Idx*>(ag + lay.Q);
        link.s = qsrc[m];
        link.d = Q[link.s];
        link.head = m == 0 || Q[qsrc[m - 1]] != link.d;
        link.tail = m == N - 1 || Q[qsrc[m + 1]] != link.d;
        link.empty = qoff[m + 1] == qoff[m];
        link.g = G[link.s];
        link.y = reinterpret_cast<const A*>(ag + lay.Y)[link.d];
      }
      ListStep<A> nx = gg.prefetch(off, src);   // the first step, read ahead of the entering state
      nx.d = R::sload(sD, m, TN);
      nx.b = R::sload(sB, m, TN);
      A* xs = inbox_of(k);
      if (c == 0) {
        xs[m] = a.x0 ? static_cast<const A*>(a.x0)[static_cast<size_t>(q) * N + m] : zero_v<A>();
        gg.sync();
      } else {
        mbar_wait_cluster(inbar + j, in_par);
        in_par ^= 1;
        if (m == 0 && --recv_left > 0) mbar_arrive_expect_tx(inbar + j, N * asize);
      }
      long long t2 = clock64();
      pr[3] += t2 - t1;
      A x = xs[m];
      if (c + 1 < C) {   // chunk c + 1 is the next CTA's chunk k (k + 1 when this is the last rank)
        // Thread i takes the i-th source in destination order; a segmented sum over the group gives each
        // destination's total at its segment's last thread, in ~log2(32) shuffles plus one barrier however
        // many entries Q merges (a serial sum over the longest list cost up to ~2,000 cycles per link).
        const int lane = m & 31, wq = m >> 5;
        A v = cmul(link.g, xs[link.s]);
        const unsigned heads = __ballot_sync(0xffffffffu, link.head);
        const unsigned le = heads & (0xffffffffu >> (31 - lane));
        const int start = le ? 31 - __clz(le) : -1;   // -1: this segment began in an earlier warp
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const A t = shfl_up_v(v, o);
          if (lane - o >= max(start, 0)) v = addv(v, t);
        }
        A* carry = reinterpret_cast<A*>(smem + lay.lnk + grp * 128);
        int* has_head = reinterpret_cast<int*>(smem + lay.lnk + grp * 128 + 64);
        if (lane == 31) {
          carry[wq] = v;
          has_head[wq] = heads != 0;
        }
        gg.sync();
        if (start < 0)
          for (int w2 = wq - 1; w2 >= 0; --w2) {
            v = addv(v, carry[w2]);
            if (has_head[w2]) break;
          }
        const int slot = (rank + 1 == CS ? k + 1 : k) % GR;
        const unsigned rbar = remote_addr(inbar + slot, next);
        if (link.tail) send_async(remote_addr(inbox_of(slot) + link.d, next), addv(link.y, v), rbar);
        if (link.empty) send_async(remote_addr(inbox_of(slot) + m, next), ye, rbar);   // nothing flows into m
      }
      t1 = clock64();
      pr[4] += t1 - t2;
      for (int t = 0; t < Tc; ++t) {
        const ListStep<A> cur = nx;
        if (t + 1 < Tc) {
          nx = gg.prefetch(off + (t + 1) * (N + 1), src + (t + 1) * N);
          nx.d = R::sload(sD, (t + 1) * N + m, TN);
          nx.b = R::sload(sB, (t + 1) * N + m, TN);
        }
        x = gg.step(cur, src + t * N, cmul(cur.d, x), cur.b);
        R::gstore(a.out_re, a.out_im, row0 + t * N + m, x);
      }
      gg.sync();   // every read of this stage is done: refill it
      pr[5] += clock64() - t1;
      pr[7] += 1;
      if (m == 0 && k + NS < Kr) {
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        load(k + NS);
      }
    }
  }
  if (bad) atomicOr(a.counter + 1, 1);
  if (a.prof && m == 0) {
    pr[6] = grp == GA ? clock64() - t_start : 0;
    for (int i = 0; i < 8; ++i)
      if (pr[i]) atomicAdd(reinterpret_cast<unsigned long long*>(a.prof) + 8 * blockIdx.x + i, pr[i]);
  }
  cluster_sync_all();   // no CTA leaves while a st.async may still target its shared memory
}

template <int K, typename In>
int cluster_smem_bytes(int N, int T, int NS, int GA, int GR) { return ClusterLayout<K, In>(N, T, NS, GA, GR).total; }

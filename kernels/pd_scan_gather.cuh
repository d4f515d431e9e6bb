// Forward, one thread per state entry, the scatter done as a gather over lists built once per chunk.
// Included by pd_scan.cu inside namespace pdk (uses its staging, look-back and helper functions).
//
// Why: the block kernel stages its chunk in shared memory (inputs read from device memory once), but its
// scatter step (match, shuffles, per-warp slots) costs ~170 instructions per warp and step; the warp kernel's
// step is cheaper but it re-reads its long chunks from device memory in the replay. Here the chunk is staged as
// in the block kernel and, because the lists depend on P alone, every step's sources are sorted by destination
// ONCE after staging (CSR: src[k][off[k][n] .. off[k][n+1]) are the m with P_k[m] = n), for both chains.
// A chain step is then   w[m] = D_k[m] y[m]  (shared),  one barrier,  y[n] = b_k[n] + sum of w over n's list.
// The chunk's aggregate is published in the same gather form (lists of its column map pi), so the look-back
// applies each predecessor's aggregate with one such step, its loads issued LB at a time.
// Lists are int16 (N <= 1024); counting uses 32-bit shared atomics on packed 16-bit counters. Sources of one
// destination are summed in the order the atomics placed them (as in the warp kernel, not bitwise
// deterministic when several entries merge into one).

// shared memory: w [2][Np] A | lb_src [2][Np] Idx | own aggregate off [N+1], src [N] | cnt [T][N] |
//                off [T][N+1] | src [T][N] | staged D planes | b planes | P
template <int K, typename In>
struct GatherLayout {
  int w, lb_src, aoff, asrc, cnt, off, src, D, B, P, plane, total;
  __host__ __device__ GatherLayout(int N, int T, int Np) {
    using R = Arr<K, In>;
    const int asize = (int)sizeof(typename R::A);
    plane = align16(T * N * R::esize);
    w = 0;
    lb_src = w + align16(2 * Np * asize);
    aoff = lb_src + align16(2 * Np * 2);
    asrc = aoff + align16((N + 1) * 2);
    cnt = asrc + align16(N * 2);
    off = cnt + align16(T * N * 2);
    src = off + align16(T * (N + 1) * 2);
    D = src + align16(T * N * 2);
    B = D + R::planes * plane;
    P = B + R::planes * plane;
    total = P + align16(T * N * 2);
  }
};

// Increments 16-bit counter idx (two share a 32-bit word; counts stay <= 1024, so no carry); returns its old value.
__device__ __forceinline__ int count_inc(uint16_t* cnt, int idx) {
  const unsigned sh = (idx & 1) * 16;
  const unsigned v = atomicAdd(reinterpret_cast<unsigned*>(cnt) + (idx >> 1), 1u << sh);
  return static_cast<int>((v >> sh) & 0xFFFFu);
}

// Counting sort of lists * N (source, destination) pairs into CSR lists, one list per group of N pairs: pair i
// belongs to list k = i / N, its source is i % N and its destination dest(i) (already in [0, N)); afterwards
// src[k * N + off[k * (N + 1) + n] ...] up to the next offset are list k's sources of destination n. cnt is
// scratch of lists * N 16-bit counters; all threads call it.

template <typename DestFn>
__device__ __forceinline__ void build_lists(int lists, int N, DestFn dest, uint16_t* cnt, Idx* off, Idx* src) {
  const int tid = threadIdx.x, nt = blockDim.x, total = lists * N;
  for (int i = tid; i < (total + 1) / 2; i += nt) reinterpret_cast<unsigned*>(cnt)[i] = 0u;
  __syncthreads();
  for (int i = tid; i < total; i += nt) count_inc(cnt, (i / N) * N + dest(i));
  __syncthreads();
  // exclusive scan of each list's N counters, one warp per list; lane l owns a contiguous run of E counters.
  // The counters then become the write cursors.
  const int warp = tid >> 5, lane = tid & 31, nwarps = nt >> 5;
  const int E = (N + 31) / 32;
  for (int k = warp; k < lists; k += nwarps) {
    uint16_t* c = cnt + k * N;
    Idx* o = off + k * (N + 1);
    const int lo = lane * E, hi = min(lo + E, N);
    int s = 0;
    for (int n = lo; n < hi; ++n) s += c[n];
    const int inc = warp_inclusive_sum(s, lane);
    int run = inc - s;
    for (int n = lo; n < hi; ++n) {
      const int v = c[n];
      o[n] = static_cast<Idx>(run);
      c[n] = static_cast<uint16_t>(run);
      run += v;
    }
    if (lane == 31) o[N] = static_cast<Idx>(inc);
  }
  __syncthreads();
  for (int i = tid; i < total; i += nt) {
    const int k = i / N;
    src[k * N + count_inc(cnt, k * N + dest(i))] = static_cast<Idx>(i - k * N);
  }
  __syncthreads();
}

constexpr int LH = 4;   // sources of a list read ahead into registers (the rest are read after the barrier)

// Blocks of <= 256 threads may take 128 registers a thread (ptxas otherwise stops at 64 and spills).
#if defined(__CUDACC_VER_MAJOR__) && (__CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 4))
#define PDK_GATHER_MAXNREG(MAXT) __maxnreg__((MAXT) <= 256 ? 128 : 64)
#else
#define PDK_GATHER_MAXNREG(MAXT)
#endif

template <int K, typename In, int MAXT>   // MAXT: block size bound (256 leaves more registers to small states)
__global__ void __launch_bounds__(MAXT) PDK_GATHER_MAXNREG(MAXT) pd_fwd_gather_kernel(ScanArgs a) {
  using R = Arr<K, In>;
  using A = typename R::A;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int s_fast;
  __shared__ uint64_t s_bar, s_barP;
  const int N = a.N, T = a.T, C = a.C;
  const int Np = blockDim.x;
  const int m = threadIdx.x;
  const bool act = m < N;
  int* err = a.counter + 1;
  int* flags = a.counter + 2;
  const Chunk ch = claim_chunk(a, false, &s_bar, &s_barP);
  const int c = ch.c, q = ch.q, Tc = ch.Tc;
  const size_t row0 = ch.row0;
  long long* prof = ch.prof;

  const GatherLayout<K, In> lay(N, T, Np);
  A* wbuf = reinterpret_cast<A*>(smem + lay.w);
  Idx* lb_src = reinterpret_cast<Idx*>(smem + lay.lb_src);
  Idx* aoff = reinterpret_cast<Idx*>(smem + lay.aoff);
  Idx* asrc = reinterpret_cast<Idx*>(smem + lay.asrc);
  uint16_t* cnt = reinterpret_cast<uint16_t*>(smem + lay.cnt);
  Idx* off = reinterpret_cast<Idx*>(smem + lay.off);
  Idx* src = reinterpret_cast<Idx*>(smem + lay.src);
  unsigned char* sD = smem + lay.D;
  unsigned char* sB = smem + lay.B;
  Idx* sP = reinterpret_cast<Idx*>(smem + lay.P);
  const int pstride = lay.plane / R::esize;

  // P on its own mbarrier: the lists are built from it while D and b are still arriving
  unsigned tx = 0, txP = 0;
  {
    stage_copy(sP, a.P + row0, Tc * N * (int)sizeof(Idx), &s_barP, txP);
    stage_array<K, In>(sD, lay.plane, a.a0_re, a.a0_im, row0, Tc * N, &s_bar, tx);
    stage_array<K, In>(sB, lay.plane, a.a1_re, a.a1_im, row0, Tc * N, &s_bar, tx);
    stage_finish(&s_barP, txP);
    __syncthreads();
    sanitize_idx(sP, Tc * N, N, err);
    if (threadIdx.x == 0) s_fast = (c == 0) ? 1 : ready(flags + static_cast<size_t>(q) * C + c - 1);
    __syncthreads();
  }
  const bool fast = s_fast;
  // every step's lists at once: pair i = (step i / N, source i % N) goes to destination P_k[m]
  build_lists(Tc, N, [&](int i) { return static_cast<int>(sP[i]); }, cnt, off, src);
  stage_finish(&s_bar, tx);
  __syncthreads();
  if (prof && threadIdx.x == 0) prof_staged(prof);

  auto Dk = [&](int k, int i) { return R::sload(sD, k * N + i, pstride); };
  auto Bk = [&](int k, int i) { return R::sload(sB, k * N + i, pstride); };
  auto Pk = [&](int k, int i) { return static_cast<int>(sP[k * N + i]); };

  // One chain step: out[n] = base[n] + sum over n's list of val[m]. Everything that does not depend on the chain
  // (the list bounds, its first LH sources, D and b of the step) is read into a StepIn *before* the previous
  // step's barrier, so after the barrier only the w loads remain, issued together. Double-buffered by parity:
  // one barrier per step.
  struct StepIn {
    int lo, n, s[LH];
    A d, b;
  };
  auto step_in = [&](const Idx* o, const Idx* sl, int k) {
    StepIn g;
    g.lo = g.n = 0;
#pragma unroll
    for (int j = 0; j < LH; ++j) g.s[j] = 0;
    g.d = g.b = zero_v<A>();
    if (act) {
      g.lo = o[m];
      g.n = o[m + 1] - g.lo;
#pragma unroll
      for (int j = 0; j < LH; ++j)
        if (j < g.n) g.s[j] = sl[g.lo + j];
      if (k >= 0) {
        g.d = Dk(k, m);
        g.b = Bk(k, m);
      }
    }
    return g;
  };
  int par = 0;
  auto gstep = [&](const StepIn& g, const Idx* sl, A val, A base) -> A {
    A* w = wbuf + par * Np;
    par ^= 1;
    w[m] = val;
    __syncthreads();
    A v[LH];
#pragma unroll
    for (int j = 0; j < LH; ++j) v[j] = j < g.n ? w[g.s[j]] : zero_v<A>();
    A acc = base;
#pragma unroll
    for (int j = 0; j < LH; ++j) acc = addv(acc, v[j]);   // in list order (zeros past its end)
    for (int i = g.lo + LH; i < g.lo + g.n; ++i) acc = addv(acc, w[sl[i]]);
    return acc;
  };
  auto offk = [&](int k) { return off + k * (N + 1); };
  auto srck = [&](int k) { return src + k * N; };

  const size_t cbase = (static_cast<size_t>(q) * C + c) * N;
  const size_t lbase = (static_cast<size_t>(q) * C + c) * (2 * N + 2);   // int16 lists of an aggregate
  Idx* agg_lists = reinterpret_cast<Idx*>(a.agg_pi);
  A* agg_d = static_cast<A*>(a.agg_d);
  A* agg_v = static_cast<A*>(a.agg_v);
  A* incl = static_cast<A*>(a.incl);

  A xin = zero_v<A>();
  if (fast) {
    if (act) xin = entering_state<A>(a, q, c, m);
  } else {
    // 1. aggregate from a zero entering state: zero-state end y (the chain), and where each entering entry ends
    //    up (pi) with which factor (d): a per-thread gather chain beside it
    A y = zero_v<A>(), d = one_v<A>();
    int pi = m;
    if (act) {
      y = Bk(0, m);
      d = Dk(0, m);
      pi = Pk(0, m);
    }
    StepIn g = step_in(offk(1 % Tc), srck(1 % Tc), 1 % Tc);
    for (int k = 1; k < Tc; ++k) {
      const StepIn cur = g;
      if (k + 1 < Tc) g = step_in(offk(k + 1), srck(k + 1), k + 1);
      A dk = zero_v<A>();
      int pk = 0;
      if (act) {
        dk = Dk(k, pi);
        pk = Pk(k, pi);
      }
      y = gstep(cur, srck(k), cmul(cur.d, y), cur.b);
      d = cmul(dk, d);
      pi = pk;
    }
    // publish the aggregate in gather form: lists of pi, d by source, y by destination (one list: thread m
    // handles pair m, since the block has >= N threads, so `pi` is pair m's destination)
    build_lists(1, N, [&](int) { return pi; }, cnt, aoff, asrc);
    if (act) {
      agg_lists[lbase + m] = aoff[m];
      agg_lists[lbase + N + 1 + m] = asrc[m];
      agg_d[cbase + m] = d;
      agg_v[cbase + m] = y;
    }
    if (m == 0) agg_lists[lbase + N] = aoff[N];
    publish_flag(flags + static_cast<size_t>(q) * C + c, 1);
    if (prof && threadIdx.x == 0) prof[2] = clock64();

    // 2. look back to the nearest inclusive state; apply the aggregates in between, LB loads at a time
    const int jb = look_back(flags + static_cast<size_t>(q) * C, c - 1, -1, C);
    if (prof && threadIdx.x == 0) {
      prof[3] = clock64();
      prof[6] = c - 1 - jb;
    }
    A st = zero_v<A>();
    if (act) st = entering_state<A>(a, q, jb + 1, m);
    for (int i0 = jb + 1; i0 < c; i0 += LB) {
      int lo[LB], hi[LB];
      Idx sm[LB];
      A db[LB], yb[LB];
#pragma unroll
      for (int u = 0; u < LB; ++u) {
        lo[u] = hi[u] = 0;
        sm[u] = 0;
        db[u] = yb[u] = zero_v<A>();
        if (act && i0 + u < c) {
          const size_t cb = (static_cast<size_t>(q) * C + i0 + u);
          const Idx* g = agg_lists + cb * (2 * N + 2);
          lo[u] = __ldcg(g + m);
          hi[u] = __ldcg(g + m + 1);
          sm[u] = __ldcg(g + N + 1 + m);
          db[u] = ldcg_v(agg_d + cb * N + m);
          yb[u] = ldcg_v(agg_v + cb * N + m);
        }
      }
#pragma unroll
      for (int u = 0; u < LB; ++u) {
        if (i0 + u < c) {   // uniform over the block
          A* w = wbuf + par * Np;
          Idx* ls = lb_src + par * Np;
          par ^= 1;
          ls[m] = sm[u];
          w[m] = cmul(db[u], st);
          __syncthreads();
          A acc = yb[u];
          for (int i = lo[u]; i < hi[u]; ++i) acc = addv(acc, w[ls[i]]);
          if (act) st = acc;
        }
      }
    }
    xin = st;
    // inclusive state at this chunk's end: y + (pi, d) applied to xin, with this chunk's own lists
    const A inc = gstep(step_in(aoff, asrc, -1), asrc, act ? cmul(d, xin) : zero_v<A>(), y);
    if (act) incl[cbase + m] = inc;
    publish_flag(flags + static_cast<size_t>(q) * C + c, 2);
    if (prof && threadIdx.x == 0) prof[4] = clock64();
  }

  // 3. replay from xin out of shared memory, writing x
  A y = xin;
  StepIn g = step_in(offk(0), srck(0), 0);
  for (int k = 0; k < Tc; ++k) {
    const StepIn cur = g;
    if (k + 1 < Tc) g = step_in(offk(k + 1), srck(k + 1), k + 1);
    y = gstep(cur, srck(k), cmul(cur.d, y), cur.b);
    if (act) R::gstore(a.out_re, a.out_im, row0 + static_cast<size_t>(k) * N + m, y);
  }
  if (fast) {
    if (act) incl[cbase + m] = y;
    publish_flag(flags + static_cast<size_t>(q) * C + c, 2);
  }
  if (prof && threadIdx.x == 0) prof[5] = clock64();
}

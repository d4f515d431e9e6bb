// The warp forward: one warp per (sequence, chunk), the scatter done as a gather over per-step lists, O(N) shared
// memory, inputs streamed from device memory; the same three phases as the block kernels (pd_scan_common.cuh).
// It is the faster forward for N <= 256, and the launch policy (llm_surgery/ops/pd_scan/launch_policy.py) picks
// between the two by size (docs/kernels.md). Its replay re-reads the chunk, except where the chunk's composed
// map collapses: then phase 1 writes the zero-state outputs and logs the entering state's path on the collapsed
// support, and the replay stops after 16 steps and repairs from the log. Its look-back crosses runs of collapsed
// chunks through links, a few numbers a chunk (complex fp32, see link_words). Its chunks come from a table
// (ScanArgs::starts): in one wave the launch policy makes them grow along the sequence, so that the early chunks
// look back and replay while the later ones still stream.
#include "pd_scan_kernels.cuh"

namespace pdk {

// ---------------------------------------------------------------- warp-level helpers
__device__ __forceinline__ void red_add(float* p, float v) {
  asm volatile("red.relaxed.gpu.global.add.f32 [%0], %1;" ::"l"(p), "f"(v) : "memory");
}
__device__ __forceinline__ void red_add_v2(float2* p, float2 v) {   // sm_90, as the rest of this file
  asm volatile("red.relaxed.gpu.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(v.x), "f"(v.y) : "memory");
}
template <bool B> struct Flag { static constexpr bool value = B; };   // a compile-time switch for a lambda
template <int B>   // a 4- or 8-byte global -> shared copy (cached at all levels)
__device__ __forceinline__ void cp_async_small(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(dst))),
               "l"(src), "n"(B));
}
// Sum of v over lanes 0..lane of the (full) warp.
__device__ __forceinline__ int warp_inclusive_sum(int v, int lane) {
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int t = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += t;
  }
  return v;
}
// acc plus the v of every lane on a list through the lanes: lane l's list starts at lane `head` and goes on at each
// lane's `next` (32: the end); the lanes walk their lists side by side, one shuffle round a hop
template <typename A>
__device__ __forceinline__ A shfl_list_sum(A acc, A v, int head, int next) {
  int h = head;
  while (__any_sync(0xffffffffu, h < 32)) {
    const A t = shfl_v(v, h & 31);
    const int nx = __shfl_sync(0xffffffffu, next, h & 31);
    if (h < 32) {
      acc = addv(acc, t);
      h = nx;
    }
  }
  return acc;
}
__device__ __forceinline__ float shfl_up_v(float v, int d) { return __shfl_up_sync(0xffffffffu, v, d); }
__device__ __forceinline__ float2 shfl_up_v(float2 v, int d) {
  return make_float2(__shfl_up_sync(0xffffffffu, v.x, d), __shfl_up_sync(0xffffffffu, v.y, d));
}
// Thread-level wait until a flag is set (non-zero); returns it. The caller fences before reading what it guards.
__device__ __forceinline__ int wait_flag(const int* flag) {
  int f;
  while ((f = *reinterpret_cast<const volatile int*>(flag)) == 0) __nanosleep(64);
  return f;
}

// ---------------------------------------------------------------- forward, one warp per chunk (N <= 32 E)
// The scatter as a gather, one warp per (sequence, chunk), lane j-th entries m = lane + 32 j (E per lane).
// A step: every lane has threaded its sources into per-destination lists (head[P[m]] <- m's slot with integer
// atomicExch, the slot's link <- the previous head) and writes its slots' w[m] = D[m] x[m]; one __syncwarp;
// then each lane sums, for its own destinations n, b[n] + w over n's list. No float atomics and no block
// barrier; the lists depend on P alone, so a step's lists are built during the step before (after its
// __syncwarp, into the other parity's buffers), off the recurrence's chain. A slot holds {w, link} together,
// written with one 16-byte store (the link waits in a register from the build), and links are byte offsets, so
// a list hop is one shared load. A lane walks its E lists side by side, so a step's chain is the longest list
// rather than the sum of E; every list ends in a null slot {0, itself} that ended lists keep loading (one
// broadcast address, no branch per list). Buffers alternate by parity and stay O(N), so many
// warps fit on an SM, which is what hides the latency of a sequential recurrence. P, D, b are read from global
// memory (prefetched two steps ahead); the replay reads them again.
// Entries N..32E-1 are padding: D = b = 0 and P = a live entry, so they add exact zeros and need no guards
// in shared memory.
// A chunk's aggregate (column map pi, factor d, zero-state end y) merges entries heavily (random maps compose to
// a few destinations), so it is published with its sources sorted by destination, and applying it is a
// segmented sum across the warp: constant work however many entries merge (a list walk would be serial).
template <typename A>
struct alignas(2 * sizeof(A)) WarpSlot {   // list slot {w, link} or phase 1 row {D_k, P_k} (fp32 inputs)
  A v;
  int link;
};
__host__ __device__ __forceinline__ int warp_entries(int N) {   // E: entries per lane, a power of two
  const int e = (N + 31) / 32;
  return e <= 1 ? 1 : e <= 2 ? 2 : e <= 4 ? 4 : 8;
}
// The repair: phase 1 logs the entering state's support from the first step kc in [REPAIR_EARLIEST, REPAIR_LATEST]
// (and <= T - 8) at which it has collapsed to <= 32 entries, and the replay stops there (chunks of REPAIR_MIN_T to
// REPAIR_MAX_T steps: a log entry keeps its step, 0-511, in 9 bits; many-wave chunks run up
// to 512). A check at step 16 alone did worse:
// checking from step 5 halved the replay at N=128 (0-4% faster), and up to step 32 logs the 4-6% of N=256 chunks
// that collapse later, whose full replays had set the kernel's end (7-30% faster; docs/kernels.md).
constexpr int REPAIR_EARLIEST = 5;
constexpr int REPAIR_LATEST = 32;
constexpr int REPAIR_MIN_T = 24;
constexpr int REPAIR_MAX_T = 512;
// flags [M], state [M], support [32] x2, the lanes' segments, mates and factors [32] x3, the merge tree (64
// segments: head, next, level, factor; 2 counts and padding)
__host__ __device__ __forceinline__ int warp_repair_bytes(int M, int asize) {
  return M * 4 + M * asize + 32 * (asize + 4) + 32 * (asize + 8) + 64 * (12 + asize) + 16;
}
__host__ __device__ constexpr int warp_list_bytes(int M, int asize) {
  return 2 * M * 4 + (4 * M + 1) * 2 * asize;   // heads [2][M], slots [2][M], rows [2][M] (aliased), null slot
}
// The look-back's links. Random maps compose to few entries: a chunk's aggregate sends its sources to k distinct
// entries (its image; ranks r in entry order, positions p_r), and its inclusive state is y + sum_r e_{p_r} s_r with
// s_r the sum of d(m) x_in[m] over the sources m sent to rank r. For two such chunks in a row the sums follow
// s'_r = u_r + sum of d'(p_r') s_r' over the predecessor's ranks r' whose position p_r' chunk i sends to rank r,
// where u (chunk i's sums of chunk i-1's zero-state end y) is known once both have their aggregates. So every
// chunk with k <= 32 publishes u and, per rank of its predecessor, where it goes with which factor, as soon as
// its predecessor's aggregate is out, and a look-back crosses a run of such chunks with one application, then
// per chunk a few shuffles across the ranks, then one scatter of k sums, where it applied every aggregate to the
// whole state (~2.5k cycles each; the chunks late in a one-wave sequence applied up to 62, docs/kernels.md).
// A chunk's record, in 4-byte words: [0] k (0: more than 32 entries), [4 + r] p_r, [36 + r] a word: the first
// predecessor rank sent to rank r (bits 0-5; 32: none), the next predecessor rank sent where rank r of the
// predecessor goes (bits 8-13; 32: none), k (bits 16-21); then A values: [68 ..] the factor of the predecessor's
// rank r, then u_r. Its link flag (0 not yet, 1 published, 2 none) says whether the part past the positions is
// there (none: more than 32 entries here or in the predecessor, or no aggregate there).
__host__ __device__ constexpr int link_words(int asize) { return 68 + 64 * asize / 4; }
template <typename A>
struct LinkIn {   // one chunk's link as lane r holds it: its word, the factor of the predecessor's rank r, u_r
  int w;
  A v, u;
};

__host__ __device__ __forceinline__ int warp_smem_bytes(int N, int asize) {
  const int M = 32 * warp_entries(N);
  return warp_list_bytes(M, asize) + 16 + warp_repair_bytes(M, asize);   // + the repair's scratch
}

// Ask for the line holding byte `lane * 128` of a row of `bytes` bytes (<= 4 KB) to be brought into L2: a warp
// covers the row with one instruction, and the later register loads of that row find it there.
__device__ __forceinline__ void l2_prefetch_row(const void* row, int bytes, int lane) {
  if (lane * 128 < bytes + 127)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(static_cast<const char*>(row) + min(lane * 128, bytes - 1)));
}

// Ask for `bytes` of contiguous memory to be brought into L2: one line a lane per instruction
__device__ __forceinline__ void l2_prefetch_range(const void* p, int bytes, int lane) {
  for (int o = lane * 128; o < bytes; o += 32 * 128)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(static_cast<const char*>(p) + o));
}

// A slot written whole, padding included: one 16-byte (real A: 8-byte) shared store, where the two fields as
// written separately took two stores and twice the shared-memory wavefronts
// (the padding word is left undefined: zeroing it cost a move per store)
__device__ __forceinline__ void put_slot(WarpSlot<float2>* p, float2 v, int link) {
  asm volatile("{\n .reg .b32 u;\n st.shared.v4.b32 [%0], {%1, %2, %3, u};\n}" ::"r"(smem_u32(p)),
               "r"(__float_as_int(v.x)), "r"(__float_as_int(v.y)), "r"(link) : "memory");
}
__device__ __forceinline__ void put_slot(WarpSlot<float>* p, float v, int link) {
  *reinterpret_cast<int2*>(p) = make_int2(__float_as_int(v), link);
}

template <typename A, int E>
struct WarpStepIn {   // inputs of one step for a lane's E entries
  int p[E];
  A d[E], b[E];
};

// A bf16 element of a step's row as fp32, 0 where !pred: one predicated load. Written as `pred ? load : 0`,
// the compiler put split bf16's loads behind branches, each waiting for the one before (phase 1 2x slower).
__device__ __forceinline__ float ldg_bf16_if(const __nv_bfloat16* p, bool pred) {
  unsigned v = 0;
  asm("{\n .reg .pred q;\n setp.ne.b32 q, %2, 0;\n @q ld.global.nc.u16 %0, [%1];\n}"
      : "+r"(v) : "l"(p), "r"((int)pred));
  return __uint_as_float(v << 16);
}

// Sorted form of a chunk's aggregate, as lane `lane` holds it: sorted positions k = lane E + i, key
// (dest << 16 | source) (0xffff0000 past N: destination 0xffff, source 0, factor 0), and the source's factor.
template <typename A, int E>
struct SortedAgg {
  int key[E];
  A d[E];
};

// out[n] = y[n] + sum over m with pi[m] = n of d[m] st[m], with (pi, d) in sorted form. stv, res: [M] scratch.
template <typename A, int E>
__device__ __forceinline__ void apply_sorted(const SortedAgg<A, E>& g, const A (&y)[E], const A (&st)[E],
                                             A (&out)[E], A* stv, A* res, int lane) {
#pragma unroll
  for (int j = 0; j < E; ++j) {
    stv[lane + 32 * j] = st[j];
    res[lane + 32 * j] = zero_v<A>();
  }
  __syncwarp();
  A v[E];
  int dst[E];
#pragma unroll
  for (int i = 0; i < E; ++i) {
    dst[i] = static_cast<int>(static_cast<unsigned>(g.key[i]) >> 16);
    v[i] = cmul(g.d[i], stv[g.key[i] & 0xffff]);   // past N: source 0 with factor 0
  }
#pragma unroll
  for (int i = 1; i < E; ++i)
    if (dst[i] == dst[i - 1]) v[i] = addv(v[i], v[i - 1]);
  // across lanes: s_l = tail_l + (lane l's keys all continue lane l-1's last run ? s_{l-1} : 0)
  const int prev_last = __shfl_up_sync(0xffffffffu, dst[E - 1], 1);
  const bool open = lane > 0 && dst[0] == dst[E - 1] && dst[0] == prev_last;
  A s = v[E - 1];
  bool chain = open;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const A so = shfl_up_v(s, o);
    const bool co = __shfl_up_sync(0xffffffffu, chain, o);
    if (lane >= o && chain) {
      s = addv(s, so);
      chain = co;
    }
  }
  A cin = shfl_up_v(s, 1);   // sum of the run that lane l's first keys continue
  if (lane == 0 || dst[0] != prev_last) cin = zero_v<A>();
  const int next_first = __shfl_down_sync(0xffffffffu, dst[0], 1);
#pragma unroll
  for (int i = 0; i < E; ++i) {
    const bool end = (i + 1 < E) ? dst[i + 1] != dst[i] : (lane == 31 || next_first != dst[i]);
    const A tot = dst[i] == dst[0] ? addv(v[i], cin) : v[i];
    if (end && dst[i] != 0xffff) res[dst[i]] = tot;
  }
  __syncwarp();
#pragma unroll
  for (int j = 0; j < E; ++j) out[j] = addv(y[j], res[lane + 32 * j]);
  __syncwarp();   // stv, res are reused by the next application
}

// 16 warps per SM at E <= 4 (128 registers each; split float32 fits since its inputs stopped being copied between
// pipeline buffers), 8 at E = 8
template <int K, typename In, int E>
__global__ void __launch_bounds__(32, (E <= 4 ? 16 : 8)) pd_fwd_warp_kernel(ScanArgs a) {
  using DT = typename Planes<In>::D;
  using VT = typename Planes<In>::V;
  using RD = Arr<K, DT>;   // D
  using RV = Arr<K, VT>;   // b, x
  using A = typename RV::A;
  using Slot = WarpSlot<A>;
  constexpr int M = 32 * E;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int s_fast;
  const int N = a.N, C = a.C;
  const int lane = threadIdx.x;
  const int pad = lane % N;   // where padding entries point
  int* flags = a.counter + 1;
  int* head = reinterpret_cast<int*>(smem);                     // [2][M]: byte offset of a list's first slot
  constexpr int slots_at = 2 * M * 4;
  Slot* slots = reinterpret_cast<Slot*>(smem + slots_at);       // [2][M]
  Slot* rows = slots + 2 * M;   // [2][M]: phase 1's gathers P_k[pi], D_k[pi] (bf16 D: packed, see put_row)
  // after phase 1, the rows' space is scratch for the sorted aggregate and its applications
  int* s_cnt = reinterpret_cast<int*>(rows);                    // [M] counts, then (aliased) res
  A* s_res = reinterpret_cast<A*>(rows);
  int* s_key = reinterpret_cast<int*>(reinterpret_cast<unsigned char*>(rows) + M * (int)max(sizeof(A), sizeof(int)));
  A* s_d = reinterpret_cast<A*>(s_key + M);
  A* s_st = s_d + M;
  const int NUL = slots_at + 4 * M * (int)sizeof(Slot);   // the null slot {0, NUL}: every list ends there
  // the repair's scratch (see REPAIR_EARLIEST)
  constexpr bool kLogY = sizeof(VT) == 2;   // bf16 outputs: the repair stores y + c, rounded once (no bf16 adds)
  // real bf16's phase 1 slowed down with log code that it did not run (docs/kernels.md): it
  // runs in two copies of the step loop, with and without the log (see there)
  constexpr bool kRealBf16 = K == REAL && sizeof(VT) == 2;
  int* s_img = reinterpret_cast<int*>(smem + align16(NUL + (int)sizeof(Slot)));   // [M] image flags
  A* s_xv = reinterpret_cast<A*>(s_img + M);   // [M] the replayed state at step kc - 1
  A* s_y0 = s_xv + M;                          // [32] zero-state y at the support, step kc - 1
  int* s_sp0 = reinterpret_cast<int*>(s_y0 + 32);   // [32] the support at step kc - 1
  // the merge tree of the support's segments (see log_step), per segment: its first child and next sibling
  // (-1: none), its level (leaves 0) and the factor its path gathered until it merged; then the segment count
  // and the top level
  int* t_head = s_sp0 + 32;
  int* t_next = t_head + 64;
  int* t_lev = t_next + 64;
  A* t_f = reinterpret_cast<A*>(t_lev + 64);
  int* t_cnt = reinterpret_cast<int*>(t_f + 64);
  // lane r's segment, the lanes in it, and the factor gathered since it began (in shared memory: in registers
  // they made phase 1 spill at E=4)
  A* s_segf = reinterpret_cast<A*>(t_cnt + 2 + 2);
  int* s_seg = reinterpret_cast<int*>(s_segf + 32);
  unsigned* s_mates = reinterpret_cast<unsigned*>(s_seg + 32);
  for (int i = lane; i < 2 * M; i += 32) head[i] = NUL;
  if (lane == 0) put_slot(reinterpret_cast<Slot*>(smem + NUL), zero_v<A>(), NUL);
  const Chunk ch = claim_chunk(a, false, nullptr, true);   // its barrier also publishes the heads
  const int c = ch.c, q = ch.q, Tc = ch.Tc;
  const size_t row0 = ch.row0;
  long long* prof = ch.prof;
  if (lane == 0) s_fast = (c == 0) ? 1 : ready(flags + static_cast<size_t>(q) * C + c - 1);
  __syncthreads();
  const bool fast = s_fast;
  if (prof && lane == 0) prof_staged(prof);
  auto live = [&](int j) { return 32 * j + lane < N; };
  // P checked where it is first used (so that a prefetch stays a pure load): clamped into the state
  using StepIn = WarpStepIn<A, E>;
  // element j of a step's row (0 past N) in planes of type T (`type`'s): planes already offset to the lane's first
  // entry of the row
  auto gload = [&](auto type, const void* re, const void* im, int j) -> A {
    using T = decltype(type);
    const bool lv = live(j);
    if constexpr (sizeof(T) == 2) {
      const auto* r = static_cast<const __nv_bfloat16*>(re) + 32 * j;
      if constexpr (K == SPLIT)
        return make_float2(ldg_bf16_if(r, lv), ldg_bf16_if(static_cast<const __nv_bfloat16*>(im) + 32 * j, lv));
      else return ldg_bf16_if(r, lv);
    } else if constexpr (K == REAL) return lv ? __ldg(static_cast<const float*>(re) + 32 * j) : 0.f;
    else if constexpr (K == SPLIT)
      return lv ? make_float2(__ldg(static_cast<const float*>(re) + 32 * j),
                              __ldg(static_cast<const float*>(im) + 32 * j))
                : zero_v<A>();
    else return lv ? __ldg(static_cast<const float2*>(re) + 32 * j) : zero_v<A>();
  };
  auto dplane = [&](const void* base, size_t i) -> const void* {
    return static_cast<const unsigned char*>(base) + i * RD::esize;
  };
  auto vplane = [&](const void* base, size_t i) -> const void* {
    return static_cast<const unsigned char*>(base) + i * RV::esize;
  };
  // A step's inputs are loaded while the step before runs, into the registers of the inputs that step has used
  // up (no copies between pipeline buffers); its P a step earlier still, for the lists built one step ahead.
  // this lane's first entry of the chunk's first row; row k is k N elements on (an int: T N < 2^31)
  const Idx* row_p = a.P + row0 + lane;
  const void *row_d = dplane(a.a0_re, row0 + lane), *row_b = vplane(a.a1_re, row0 + lane);
  const void *row_di = K == SPLIT ? dplane(a.a0_im, row0 + lane) : nullptr;
  const void *row_bi = K == SPLIT ? vplane(a.a1_im, row0 + lane) : nullptr;
  auto load_p = [&](int k, int (&p)[E]) {
    const Idx* pp = row_p + k * N;
#pragma unroll
    for (int j = 0; j < E; ++j) p[j] = live(j) ? static_cast<int>(__ldg(pp + 32 * j)) : pad;
  };
  // each input plane's elements [i0, i0 + n) (whole rows) handed to pf(pointer, bytes), which asks L2 for them
  auto prefetch_inputs = [&](size_t i0, int n, auto&& pf) {
    pf(a.P + i0, n * 2);
    pf(dplane(a.a0_re, i0), n * RD::esize);
    pf(vplane(a.a1_re, i0), n * RV::esize);
    if constexpr (K == SPLIT) {
      pf(dplane(a.a0_im, i0), n * RD::esize);
      pf(vplane(a.a1_im, i0), n * RV::esize);
    }
  };
  auto load_db = [&](int k, StepIn& s) {
    // bf16 rows of N <= 128 are prefetched into L2 three steps before their loads (measured 4-17% faster; the
    // fp32 forms, whose rows are twice as large, ran up to 60% slower with it, and bf16 at N = 256 50% slower;
    // Mixed rows, with float32 D, go as the fp32 forms' do)
    constexpr int l2_ahead = (sizeof(DT) == 2 && E <= 4) ? 3 : 0;
    // (only in launches without a repair log: chunks that are logged read each row once, and there the prefetch
    // cost 3%)
    if (l2_ahead > 0 && a.rcap == 0 && k + l2_ahead < Tc) {
      prefetch_inputs(row0 + static_cast<size_t>(k + l2_ahead) * N, N,
                      [&](const void* p, int bytes) { l2_prefetch_row(p, bytes, lane); });
    }
    const int i0 = k * N;
    const void *dre = dplane(row_d, i0), *dim = K == SPLIT ? dplane(row_di, i0) : nullptr;
    const void *bre = vplane(row_b, i0), *bim = K == SPLIT ? vplane(row_bi, i0) : nullptr;
#pragma unroll
    for (int j = 0; j < E; ++j) {
      s.d[j] = gload(DT{}, dre, dim, j);
      s.b[j] = gload(VT{}, bre, bim, j);
    }
  };
  auto slot_off = [&](int bp, int m) { return slots_at + (bp * M + m) * (int)sizeof(Slot); };
  int par = 0;
  // the lists of a step whose destinations are `dest` (clamped here, in place), into parity bp's buffers; the
  // old heads the atomics return are the links of this lane's slots, stored with the slots' values
  auto build = [&](int bp, int (&dest)[E], int (&old)[E]) {
    int* hd = head + bp * M;
#pragma unroll
    for (int j = 0; j < E; ++j) {
      dest[j] = min(static_cast<unsigned>(dest[j]), static_cast<unsigned>(N - 1));
      old[j] = atomicExch(&hd[dest[j]], slot_off(bp, lane + 32 * j));
    }
  };
  int lk[E];   // links of the slots the next scatter_step call fills (the old heads its lists' build returned)
  // step k of n: out <- b_k + scatter(P_k, val), and the following step's lists built (from pn = P_{k+1}); the
  // step's inputs are used up once the walk starts (callers read cur before), so cur then takes step k + 1's
  // and pn P_{k+2}
  auto scatter_step = [&](const A (&val)[E], StepIn& cur, A (&out)[E], int (&pn)[E], int k, int n) {
    int* hd = head + par * M;
#pragma unroll
    for (int j = 0; j < E; ++j) put_slot(slots + par * M + lane + 32 * j, val[j], lk[j]);
    __syncwarp();
    if (k + 1 < n) build(par ^ 1, pn, lk);
    // the E lists walked side by side (E loads in flight); an ended list keeps loading the null slot
    int h[E];
    A acc[E];
#pragma unroll
    for (int j = 0; j < E; ++j) {
      h[j] = hd[lane + 32 * j];
      hd[lane + 32 * j] = NUL;
    }
    // the first round of the walk apart, so that it adds b_k where a copy of b_k would start the sums
    bool more = false;
#pragma unroll
    for (int j = 0; j < E; ++j) {
      const Slot s = *reinterpret_cast<const Slot*>(smem + h[j]);
      acc[j] = addv(cur.b[j], s.v);
      h[j] = s.link;
      more |= h[j] != NUL;
    }
#pragma unroll
    for (int j = 0; j < E; ++j) cur.p[j] = pn[j];
    load_db(min(k + 1, n - 1), cur);   // past the end: a row of the chunk again (no branch around the loads)
    load_p(min(k + 2, n - 1), pn);
    while (more) {
      more = false;
#pragma unroll
      for (int j = 0; j < E; ++j) {
        const Slot s = *reinterpret_cast<const Slot*>(smem + h[j]);
        acc[j] = addv(acc[j], s.v);
        h[j] = s.link;
        more |= h[j] != NUL;
      }
    }
#pragma unroll
    for (int j = 0; j < E; ++j) out[j] = acc[j];
    par ^= 1;
  };

  const size_t cbase = (static_cast<size_t>(q) * C + c) * N;
  A* agg_d = static_cast<A*>(a.agg_d);
  A* agg_v = static_cast<A*>(a.agg_v);
  A* incl = static_cast<A*>(a.incl);
  // the look-back's links (see link_words): the complex fp32 forms at 65-128 entries (E = 4) only, where they
  // were measured faster. Compiled into the others they moved the step loop's register allocation: phase 1 up to
  // 22% slower with bf16, real float32 up to 6% slower at L <= 2048 and no faster at L=16384, and the complex
  // step loops at E = 1, 2, 8 grew by 1-12% in SASS, not timed (docs/kernels.md)
  constexpr bool kLinks = sizeof(VT) == 4 && K != REAL && E == 4;
  int* lflags = flags + static_cast<size_t>(a.S) * C + static_cast<size_t>(q) * C;   // this sequence's link flags
  constexpr int LW = link_words(sizeof(A));
  auto lrec = [&](int i) { return static_cast<int*>(a.link) + (static_cast<size_t>(q) * C + i) * LW; };
  // after phase 1, until the replay, the lists' slots are scratch for this chunk's link: per source its image
  // rank (s_g) and factor (s_dd), per rank its position (s_pos)
  int* s_g = reinterpret_cast<int*>(slots);
  A* s_dd = reinterpret_cast<A*>(s_g + M);
  int* s_pos = reinterpret_cast<int*>(s_dd + M);

  A x[E];
#pragma unroll
  for (int j = 0; j < E; ++j) x[j] = zero_v<A>();
  StepIn cur;   // step k's inputs while step k runs, then (from the walk on) step k + 1's
  int pn[E];    // P_{k+1} (the lists built during step k), then P_{k+2}
  A val[E];
  // steps 0 .. n - 1 in order: step(k, cur, pn, n), which calls scatter_step(val, cur, out, pn, k, n)
  auto steps_begin = [&](int n) {
    load_p(0, cur.p);
    load_db(0, cur);
    if (n > 1) load_p(1, pn);
    build(par, cur.p, lk);   // the first step's lists
  };
  auto for_each_step = [&](int n, auto&& step) {
    steps_begin(n);
    for (int k = 0; k < n; ++k) step(k, cur, pn, n);
  };
  // The repair. A chunk whose composed map has collapsed onto at most 32 entries by step kc - 1 (the first such step
  // from REPAIR_EARLIEST - 1 to REPAIR_LATEST - 1; random maps: ~2N/t entries after t steps) writes its zero-state
  // outputs y_t from step kc on in phase 1, and logs where the entering state's part c goes on that support. The
  // support's entries follow their paths; where paths meet they merge into a new segment, so that c at an entry of a
  // step is its segment's c at the segment's start times the factor gathered since (g): the log keeps, per step and
  // support entry, the step, the position, the segment and g (bf16 outputs: and y there, in fp32), and a merge tree
  // in shared memory keeps which segments merged into which with which factors. After the look-back, 3. replays only
  // the first kc steps, evaluates the tree a level at a time (a few dozen segments), and then adds c to every logged
  // entry at once (no input is read twice, and no chain runs through the steps: the step-by-step repair cost ~80k
  // cycles a chunk, each step a chain of shuffles queued behind the other warps'). A log that fills up (a.rcap
  // entries) sends the chunk back to the full replay.
  // lg = the log's length << 16 | kc << 8 | the support's size at the check; lg > 0: the chunk is logged
  int lg = 0;
  // Image tracking. Once the chunk's composed map has collapsed onto <= 32 entries (the check after step
  // kc - 1), every source follows the path of its image entry, so phase 1 follows the image alone:
  // lane r holds entry r's position (tpos) and the factor its path has gathered since the check (tf), one
  // gather a step instead of E; pi then holds each source's image rank and d its factor up to the check.
  bool trk = false;
  int tpos = 0;
  A tf = one_v<A>();
  // the log's planes (a.rcap entries per chunk, recomputed where used rather than held in registers): factors
  // (A), link words (int), and with bf16 outputs the zero-state y at each step's destinations (A)
  auto log_plane = [&]() { return static_cast<size_t>(a.S) * C * a.rcap; };   // entries of one plane
  auto log_at = [&]() { return (static_cast<size_t>(q) * C + c) * a.rcap; };   // this chunk's first entry
  auto log_d = [&]() { return static_cast<A*>(a.rlog) + log_at(); };
  auto log_w = [&]() { return reinterpret_cast<int*>(static_cast<A*>(a.rlog) + log_plane()) + log_at(); };
  auto log_y = [&]() {
    return reinterpret_cast<A*>(reinterpret_cast<int*>(static_cast<A*>(a.rlog) + log_plane()) + log_plane()) +
           log_at();
  };
  // after phase 1's step kc - 1: the image of pi, and whether the log takes this chunk
  auto collapse_check = [&](int (&pim)[E], const A (&yv)[E], int kc) {
#pragma unroll
    for (int j = 0; j < E; ++j) s_img[lane + 32 * j] = 0;
    __syncwarp();
#pragma unroll
    for (int j = 0; j < E; ++j)
      if (live(j)) s_img[pim[j]] = 1;
    __syncwarp();
    unsigned bits[E];
    int cnt = 0;
#pragma unroll
    for (int j = 0; j < E; ++j) {
      bits[j] = __ballot_sync(0xffffffffu, live(j) && s_img[lane + 32 * j]);
      cnt += __popc(bits[j]);
    }
    if (cnt > 32) return;
    int base = 0;
    __syncwarp();   // every lane has read the flags: they become the image entries' ranks
#pragma unroll
    for (int j = 0; j < E; ++j) {
      if ((bits[j] >> lane) & 1u) {
        const int r = base + __popc(bits[j] & ((1u << lane) - 1u));
        s_sp0[r] = lane + 32 * j;
        s_y0[r] = yv[j];
        s_img[lane + 32 * j] = r;
      }
      base += __popc(bits[j]);
    }
    t_head[lane] = t_head[lane + 32] = -1;   // each support entry a segment of its own, a leaf
    t_lev[lane] = t_lev[lane + 32] = 0;
    if (lane == 0) {
      t_cnt[0] = cnt;
      t_cnt[1] = 0;
    }
    __syncwarp();
    s_seg[lane] = lane;
    s_mates[lane] = 1u << lane;
    s_segf[lane] = one_v<A>();
    trk = true;
    tpos = lane < cnt ? s_sp0[lane] : 0;
#pragma unroll
    for (int j = 0; j < E; ++j) pim[j] = live(j) ? s_img[pim[j]] : 0;
    if (a.rcap > 0 && Tc <= REPAIR_MAX_T) lg = cnt | kc << 8;
  };
  // phase 1's logged step k (y = y_k; the lanes' support entries have moved with factor dv): write y_k, merge
  // the segments whose paths meet, log an entry per support position
  auto log_step = [&](int k, A dv, const A (&yv)[E]) {
#pragma unroll
    for (int j = 0; j < E; ++j)
      if (live(j)) RV::gstore(a.out_re, a.out_im, row0 + static_cast<size_t>(k) * N + lane + 32 * j, yv[j]);
    const int cnt = lg & 63, loff = lg >> 16;
    const bool src = lane < cnt;
    const unsigned below = (1u << lane) - 1u;
    A g = cmul(dv, s_segf[lane]);
    int seg = s_seg[lane];
    const unsigned peers = __match_any_sync(0xffffffffu, src ? tpos : -1 - lane);   // lanes past cnt: alone
    // lanes at one position stay together, so a position's lanes grow past the lane's segment only by a merge
    const unsigned mates = s_mates[lane];
    const bool merge = src && peers != mates;
    if (__any_sync(0xffffffffu, merge)) {   // at most 31 times a chunk
      const int first = __ffs(peers) - 1;
      const unsigned opens = __ballot_sync(0xffffffffu, merge && first == lane);
      const int nseg = t_cnt[0];
      const int S = __shfl_sync(0xffffffffu, nseg + __popc(opens & below), first);   // the new segment
      __syncwarp();
      if (merge && __ffs(mates) - 1 == lane) {   // one lane per merging segment: its edge into S
        t_f[seg] = g;
        t_next[seg] = atomicExch(&t_head[S], seg);
        atomicMax(&t_lev[S], t_lev[seg] + 1);
      }
      if (lane == 0) t_cnt[0] = nseg + __popc(opens);
      __syncwarp();
      if (merge && first == lane) atomicMax(&t_cnt[1], t_lev[S]);
      if (merge) {
        seg = S;
        g = one_v<A>();
        s_seg[lane] = S;
        s_mates[lane] = peers;
      }
    }
    s_segf[lane] = g;
    const bool lead = src && __ffs(peers) - 1 == lane;
    const unsigned leads = __ballot_sync(0xffffffffu, lead);
    if (loff + __popc(leads) > a.rcap) {   // the log is full: give up, the replay runs the whole chunk
      lg = 0;
      return;
    }
    const int i = loff + __popc(leads & below);
    if (lead) {
      log_d()[i] = g;
      log_w()[i] = k | tpos << 9 | seg << 20;
    }
    if constexpr (kLogY) {   // y at the lane's position, from the lane that holds it
      A yd = zero_v<A>();
#pragma unroll
      for (int j = 0; j < E; ++j) {
        const A t = shfl_v(yv[j], tpos & 31);
        if ((tpos >> 5) == j) yd = t;
      }
      if (lead) log_y()[i] = yd;
    }
    lg += __popc(leads) << 16;
  };
  // out[i] += v as a reduction (REDG: fire and forget; atomicAdd compiles to an ATOMG that costs the repair ~3x)
  auto red_out = [&](size_t i, A v) {
    if constexpr (K == CPLX) {
      red_add_v2(static_cast<float2*>(a.out_re) + i, v);
    } else if constexpr (K == SPLIT) {
      red_add(static_cast<float*>(a.out_re) + i, v.x);
      red_add(static_cast<float*>(a.out_im) + i, v.y);
    } else {
      red_add(static_cast<float*>(a.out_re) + i, v);
    }
  };
  // 3b. after the replay of steps 0 .. kc - 1 (state xs): c at every segment's start, then every entry
  auto repair = [&](const A (&xs)[E]) {
    const int cnt0 = lg & 63, ne = lg >> 16;
    // the log is staged into the lists' space (free now) a piece at a time (one device-memory latency a piece),
    // the first piece while the tree is evaluated
    constexpr int a_planes = kLogY ? 2 : 1;   // A-sized planes of the log: factors, (bf16) y
    constexpr int lbytes = warp_list_bytes(M, sizeof(A)) - 64 * (int)sizeof(A);
    constexpr int cap = lbytes / (a_planes * (int)sizeof(A) + 4);   // entries a piece (>= 64)
    A* sd = reinterpret_cast<A*>(smem);
    A* sy = sd + cap;   // bf16 outputs only
    int* sw = reinterpret_cast<int*>(sd + a_planes * cap);
    A* s_c = reinterpret_cast<A*>(smem + lbytes);   // [64]: c at each segment's start
    auto stage = [&](int oa) {
      for (int i = lane; i < min(cap, ne - oa); i += 32) {
        cp_async_small<sizeof(A)>(sd + i, log_d() + oa + i);
        cp_async_small<4>(sw + i, log_w() + oa + i);
        if constexpr (kLogY) cp_async_small<sizeof(A)>(sy + i, log_y() + oa + i);
      }
    };
    __syncwarp();   // the replay's lists are no longer read (its walks end lane by lane)
    stage(0);
#pragma unroll
    for (int j = 0; j < E; ++j) s_xv[lane + 32 * j] = xs[j];
    const int nseg = t_cnt[0], top = t_cnt[1];
    const int sm = cnt0 + lane;   // the lane's merged segment: its children's c times their factors
    const int lev = sm < nseg ? t_lev[sm] : 0, first = sm < nseg ? t_head[sm] : -1;
    __syncwarp();
    if (lane < cnt0) s_c[lane] = subv(s_xv[s_sp0[lane]], s_y0[lane]);   // a leaf: x - y at the check
    for (int lv = 1; lv <= top; ++lv) {
      __syncwarp();
      if (lev == lv) {
        A acc = zero_v<A>();
        for (int ch = first; ch >= 0; ch = t_next[ch]) acc = addv(acc, cmul(t_f[ch], s_c[ch]));
        s_c[sm] = acc;
      }
    }
    for (int oa = 0; oa < ne; oa += cap) {
      if (oa > 0) {
        __syncwarp();   // the previous piece is no longer read
        stage(oa);
      }
      cp_async_wait_all();
      __syncwarp();
      for (int i = lane; i < min(cap, ne - oa); i += 32) {
        const int w = sw[i];
        const A cn = cmul(sd[i], s_c[w >> 20]);
        const size_t o = row0 + static_cast<size_t>(w & 511) * N + ((w >> 9) & 2047);
        // bf16: y + c rounded once (adding c to a rounded y would round twice, badly where they cancel)
        if constexpr (kLogY) RV::gstore(a.out_re, a.out_im, o, addv(sy[i], cn));
        else red_out(o, cn);
      }
    }
  };
  if (fast) {
#pragma unroll
    for (int j = 0; j < E; ++j)
      if (live(j)) x[j] = entering_state<A>(a, q, c, lane + 32 * j);
  } else {
    // 1. aggregate from a zero entering state: zero-state end y (the chain) and, per entering entry, where it
    //    ends up (pi) with which factor (d) (per-lane gathers, independent of the chain: they overlap it)
    A y[E], d[E];
    int pi[E];
#pragma unroll
    for (int j = 0; j < E; ++j) {
      y[j] = zero_v<A>();
      d[j] = live(j) ? one_v<A>() : zero_v<A>();
      pi[j] = live(j) ? lane + 32 * j : pad;
    }
    // phase 1's row {D_k, P_k} of entry i in parity rp. bf16 D keeps its bf16 bits (exact), so a row takes 8
    // bytes (split) or 4 (real) where a {D, P} slot takes 16 or 8: the rows' stores and gathers cost half the
    // shared-memory wavefronts (split bf16 3-4% faster, real bf16 ~2%; docs/kernels.md)
    auto put_row = [&](int rp, int i, A dv, int p) {
      if constexpr (sizeof(DT) == 2 && K == SPLIT)
        reinterpret_cast<uint2*>(rows)[rp * M + i] =
            make_uint2(__byte_perm(__float_as_uint(dv.x), __float_as_uint(dv.y), 0x7632), p);
      else if constexpr (sizeof(DT) == 2)
        reinterpret_cast<unsigned*>(rows)[rp * M + i] = (__float_as_uint(dv) & 0xffff0000u) | static_cast<unsigned>(p);
      else put_slot(rows + rp * M + i, dv, p);
    };
    auto get_row = [&](int rp, int i) -> Slot {
      Slot r;
      if constexpr (sizeof(DT) == 2 && K == SPLIT) {
        const uint2 u = reinterpret_cast<const uint2*>(rows)[rp * M + i];
        r.v = make_float2(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u));
        r.link = static_cast<int>(u.y);
      } else if constexpr (sizeof(DT) == 2) {
        const unsigned u = reinterpret_cast<const unsigned*>(rows)[rp * M + i];
        r.v = __uint_as_float(u & 0xffff0000u);
        r.link = static_cast<int>(u & 0xffffu);
      } else r = rows[rp * M + i];
      return r;
    };
    auto p1_step = [&](int k, StepIn& cur, int (&pn)[E], int n, auto logging) {
      const int rp = par;   // the parity scatter_step is about to use: its __syncwarp covers these rows
#pragma unroll
      for (int j = 0; j < E; ++j) {
        put_row(rp, lane + 32 * j, cur.d[j], cur.p[j]);
        val[j] = cmul(cur.d[j], y[j]);
      }
      scatter_step(val, cur, y, pn, k, n);
      if (trk) {
        const Slot r = get_row(rp, tpos);
        tf = cmul(r.v, tf);
        tpos = r.link;
        if constexpr (decltype(logging)::value) {
          if (lg > 0) log_step(k, r.v, y);
        }
      } else {
#pragma unroll
        for (int j = 0; j < E; ++j) {
          const Slot r = get_row(rp, pi[j]);
          d[j] = cmul(r.v, d[j]);
          pi[j] = r.link;
        }
      }
      if (!trk && k >= REPAIR_EARLIEST - 1 && k < REPAIR_LATEST && k + 8 < Tc && Tc >= REPAIR_MIN_T)
        collapse_check(pi, y, k + 1);   // until it collapses
    };
    // real bf16: two copies of the step loop, one with the log and one without, so that the log's code stays out
    // of the loop of the chunks that keep none (at L=2048 it ran 12% slower with the code inline but not run);
    // the other forms keep one loop (two made them spill at E=4)
    steps_begin(Tc);
    int k = 0;
    if constexpr (kRealBf16)
      for (; k < Tc && lg == 0; ++k) p1_step(k, cur, pn, Tc, Flag<false>{});
    for (; k < Tc; ++k) p1_step(k, cur, pn, Tc, Flag<true>{});
    if (trk) {   // back to one (pi, d) per source: its image entry's end position, its factor times the entry's
#pragma unroll
      for (int j = 0; j < E; ++j) {
        const int r = pi[j];
        pi[j] = __shfl_sync(0xffffffffu, tpos, r);
        d[j] = cmul(shfl_v(tf, r), d[j]);
      }
    }
    __syncwarp();   // every lane's last gathers from the rows are done: their space becomes scratch
    // sort the sources by destination (counting sort) and publish (key, d) in sorted order, y by destination
#pragma unroll
    for (int j = 0; j < E; ++j) s_cnt[lane + 32 * j] = 0;
    __syncwarp();
    int rank[E];
#pragma unroll
    for (int j = 0; j < E; ++j) rank[j] = live(j) ? atomicAdd(&s_cnt[pi[j]], 1) : 0;
    __syncwarp();
    int cnt[E], run = 0, nz = 0;
#pragma unroll
    for (int i = 0; i < E; ++i) {
      cnt[i] = s_cnt[lane * E + i];
      run += cnt[i];
      nz += cnt[i] > 0;
    }
    // one scan for the sort's offsets (low half) and the image's ranks (high half): both sum to <= N <= 256
    const int both = warp_inclusive_sum(run | nz << 16, lane) - (run | nz << 16);
    int off = both & 0xffff, rk = both >> 16;
    // entries the aggregate sends its sources to (with no links, 33: "too many")
    const int kimg = kLinks ? __shfl_sync(0xffffffffu, rk + nz, 31) : 33;
    int* s_rank = reinterpret_cast<int*>(s_st);   // free until the look-back
    if (kimg <= 32) {
#pragma unroll
      for (int i = 0; i < E; ++i)
        if (cnt[i] > 0) {
          s_rank[lane * E + i] = rk;
          s_pos[rk] = lane * E + i;
          lrec(c)[4 + rk] = lane * E + i;
          ++rk;
        }
    }
    if (kLinks && lane == 0) lrec(c)[0] = kimg <= 32 ? kimg : 0;
    __syncwarp();
#pragma unroll
    for (int i = 0; i < E; ++i) {
      s_cnt[lane * E + i] = off;
      off += cnt[i];
    }
    if (kimg <= 32) {
#pragma unroll
      for (int j = 0; j < E; ++j)
        if (live(j)) {
          s_g[lane + 32 * j] = s_rank[pi[j]];
          s_dd[lane + 32 * j] = d[j];
        }
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < E; ++i) {   // positions past N: no entry
      s_key[lane * E + i] = static_cast<int>(0xffff0000u);
      s_d[lane * E + i] = zero_v<A>();
    }
    __syncwarp();
#pragma unroll
    for (int j = 0; j < E; ++j) {
      const int m = lane + 32 * j;
      if (live(j)) {
        const int pos = s_cnt[pi[j]] + rank[j];
        s_key[pos] = (pi[j] << 16) | m;
        s_d[pos] = d[j];
      }
    }
    __syncwarp();
    SortedAgg<A, E> own;
#pragma unroll
    for (int i = 0; i < E; ++i) {
      const int k = lane * E + i;
      own.key[i] = s_key[k];
      own.d[i] = s_d[k];
      if (k < N) {
        a.agg_pi[cbase + k] = own.key[i];
        agg_d[cbase + k] = own.d[i];
      }
    }
#pragma unroll
    for (int j = 0; j < E; ++j)
      if (live(j)) agg_v[cbase + lane + 32 * j] = y[j];
    publish_flag(flags + static_cast<size_t>(q) * C + c, 1);
    if (prof && lane == 0) prof[2] = clock64();

    auto lvals = [&](int i) { return reinterpret_cast<A*>(lrec(i) + 68); };   // [2][32]: factors, u
    // links only with chunks of 16 steps or more: shorter chunks' look-backs are short, and the link costs an
    // application (measured: L=128, 8-step chunks, 10% slower with links)
    const bool links = kLinks && a.T >= 16;
    auto load_agg = [&](int i, SortedAgg<A, E>& g) {
      const size_t rb = (static_cast<size_t>(q) * C + i) * N;
#pragma unroll
      for (int ii = 0; ii < E; ++ii) {
        const int k = lane * E + ii;
        g.key[ii] = static_cast<int>(0xffff0000u);
        g.d[ii] = zero_v<A>();
        if (k < N) {
          g.key[ii] = __ldcg(a.agg_pi + rb + k);
          g.d[ii] = ldcg_v(agg_d + rb + k);
        }
      }
    };
    auto load_y = [&](int i, A (&yv)[E]) {
#pragma unroll
      for (int j = 0; j < E; ++j)
        yv[j] = live(j) ? ldcg_v(agg_v + (static_cast<size_t>(q) * C + i) * N + lane + 32 * j) : zero_v<A>();
    };
    A zy[E], dump[E];   // a zero y, and outputs nobody reads (the applications below that want only s_res)
#pragma unroll
    for (int j = 0; j < E; ++j) zy[j] = zero_v<A>();

    // this chunk's link from chunk c - 1's aggregate, for the look-backs of the chunks after it
    if (links && c > 0) {
      int lst = 2;
      if (kimg <= 32) {
        int fp = 0;
        if (lane == 0) fp = wait_flag(flags + static_cast<size_t>(q) * C + c - 1);
        fp = __shfl_sync(0xffffffffu, fp, 0);
        __threadfence();
        const int kp = (fp & 1) ? __ldcg(lrec(c - 1)) : 0;   // chunk c - 1's k (0: no aggregate or too many)
        if (kp > 0) {
          A yp[E];
          load_y(c - 1, yp);
          const int pp = lane < kp ? __ldcg(lrec(c - 1) + 4 + lane) : 0;
          apply_sorted(own, zy, yp, dump, s_st, s_res, lane);
          const A u = lane < kimg ? s_res[s_pos[lane]] : zero_v<A>();
          // the predecessor's rank r' (lane r') goes to this chunk's rank `row` with factor v. Its word: the first
          // source of rank `lane` (32: none), the next source after r' with the same rank (32: none), and k.
          const int row = lane < kp ? s_g[pp] : 32 + lane;
          const A v = lane < kp ? s_dd[pp] : zero_v<A>();
          const unsigned peers = __match_any_sync(0xffffffffu, row);
          const unsigned above = peers & (0xfffffffeu << lane);
          int* s_head = s_key;   // free once the own aggregate is in registers
          s_head[lane] = 32;
          __syncwarp();
          if (lane < kp && __ffs(peers) - 1 == lane) s_head[row] = lane;
          __syncwarp();
          lrec(c)[36 + lane] = s_head[lane] | (lane < kp && above ? __ffs(above) - 1 : 32) << 8 | kimg << 16;
          lvals(c)[lane] = v;
          if (lane < kimg) lvals(c)[32 + lane] = u;
          lst = 1;
        }
      }
      if (lst == 1) {
        publish_flag(lflags + c, 1);
      } else {   // nothing to fence
        __syncwarp();
        if (lane == 0) atomicExch(lflags + c, 2);
      }
    }

    // 2. look back to the nearest inclusive state and carry it to this chunk: a run of chunks with links in their
    //    image sums, any other chunk by applying its aggregate to the whole state
    const int jb = look_back(flags + static_cast<size_t>(q) * C, c - 1, -1, C);
    if (prof && lane == 0) {
      prof[3] = clock64();
      prof[6] = c - 1 - jb;
    }
    A st[E];
#pragma unroll
    for (int j = 0; j < E; ++j) st[j] = live(j) ? entering_state<A>(a, q, jb + 1, lane + 32 * j) : zero_v<A>();
    unsigned lvalid = 0;   // bit t: chunk lb + t has a link; known for chunks lb .. lb + ln - 1
    int lb = 0, ln = 0;
    // whether chunk i (< c, asked in increasing order) has a link: waits for its flag
    auto has_link = [&](int i) -> bool {
      if (!links || kimg > 32) return false;   // a guard: only a chunk with links asks
      if (i >= lb + ln) {
        lb = i;
        ln = min(32, c - i);
        int f = 1;
        if (lane < ln) f = wait_flag(lflags + i + lane);
        __syncwarp();
        __threadfence();
        lvalid = __ballot_sync(0xffffffffu, lane < ln && f == 1);
      }
      return (lvalid >> (i - lb)) & 1u;
    };
    auto load_link = [&](int i, LinkIn<A>& l) {
      l.w = __ldcg(lrec(i) + 36 + lane);
      l.v = ldcg_v(lvals(i) + lane);
      l.u = ldcg_v(lvals(i) + 32 + lane);
    };
    // image sums s (lane r: s_r) of one chunk -> of the next, through its link: lane r' sends v = d' s_r', lane r
    // adds the v of its sources (a list through the words, usually one long) to u_r
    auto link_step = [&](const LinkIn<A>& l, A s) -> A {
      const A v = cmul(l.v, s);   // 0 past the predecessor's k: s and the factor are 0 there
      const A acc = shfl_list_sum(l.u, v, l.w & 63, (l.w >> 8) & 63);
      return lane < (l.w >> 16) ? acc : zero_v<A>();
    };
    // without links (not a complex fp32 form, short chunks, or a chunk that has no small image itself: where maps
    // do not merge no chunk has one, and nobody waits for their flags) the aggregates are applied two at a time,
    // their loads issued together. This loop stays separate: through load_agg/load_y it moved the
    // registers of the forms without links (E <= 2) and their step loops grew by up to 9%.
    if (!links || kimg > 32) {
      constexpr int LBW = E >= 8 ? 1 : (E >= 4 ? 2 : 4);
      for (int i0 = jb + 1; i0 < c; i0 += LBW) {
        SortedAgg<A, E> gb[LBW];
        A yb[LBW][E];
#pragma unroll
        for (int u = 0; u < LBW; ++u) {
          const size_t rb = (static_cast<size_t>(q) * C + i0 + u) * N;
#pragma unroll
          for (int i = 0; i < E; ++i) {
            const int k = lane * E + i;
            gb[u].key[i] = static_cast<int>(0xffff0000u);
            gb[u].d[i] = zero_v<A>();
            if (k < N && i0 + u < c) {
              gb[u].key[i] = __ldcg(a.agg_pi + rb + k);
              gb[u].d[i] = ldcg_v(agg_d + rb + k);
            }
          }
#pragma unroll
          for (int j = 0; j < E; ++j) {
            yb[u][j] = zero_v<A>();
            if (live(j) && i0 + u < c) yb[u][j] = ldcg_v(agg_v + rb + lane + 32 * j);
          }
        }
#pragma unroll
        for (int u = 0; u < LBW; ++u)
          if (i0 + u < c) apply_sorted(gb[u], yb[u], st, st, s_st, s_res, lane);
      }
    } else {
      for (int i = jb + 1; i < c;) {
        if (i + 1 < c && has_link(i + 1)) {
          // chunk i's image sums of its entering state st (one application), then the links i + 1, i + 2, ...
          // (each link's loads issued two steps ahead)
          const int ki = __ldcg(lrec(i));
          const int pr = lane < ki ? __ldcg(lrec(i) + 4 + lane) : 0;
          SortedAgg<A, E> g;
          load_agg(i, g);
          LinkIn<A> l0, l1, l2;
          load_link(i + 1, l0);
          bool v1 = i + 2 < c && has_link(i + 2);
          if (v1) load_link(i + 2, l1);
          apply_sorted(g, zy, st, dump, s_st, s_res, lane);
          A s = lane < ki ? s_res[pr] : zero_v<A>();
          __syncwarp();
          int cur = i;
          while (true) {
            const bool v2 = v1 && cur + 3 < c && has_link(cur + 3);
            if (v2) load_link(cur + 3, l2);
            s = link_step(l0, s);
            ++cur;
            if (!v1) break;
            l0 = l1;
            l1 = l2;
            v1 = v2;
          }
          // chunk cur's inclusive state: y + its image sums scattered to their positions
          const int kc = l0.w >> 16;
          A yv[E];
          load_y(cur, yv);
          const int pe = lane < kc ? __ldcg(lrec(cur) + 4 + lane) : 0;
#pragma unroll
          for (int j = 0; j < E; ++j) s_res[lane + 32 * j] = zero_v<A>();
          __syncwarp();
          if (lane < kc) s_res[pe] = s;
          __syncwarp();
#pragma unroll
          for (int j = 0; j < E; ++j) st[j] = addv(yv[j], s_res[lane + 32 * j]);
          __syncwarp();
          i = cur + 1;
        } else {
          SortedAgg<A, E> g;
          A yv[E];
          load_agg(i, g);
          load_y(i, yv);
          apply_sorted(g, yv, st, st, s_st, s_res, lane);
          ++i;
        }
      }
    }
    // inclusive state at this chunk's end: y + scatter(pi, d * xin); x <- xin
    A inc[E];
    apply_sorted(own, y, st, inc, s_st, s_res, lane);
#pragma unroll
    for (int j = 0; j < E; ++j) {
      x[j] = st[j];
      if (live(j)) incl[cbase + lane + 32 * j] = inc[j];
    }
    publish_flag(flags + static_cast<size_t>(q) * C + c, 3);   // inclusive, and it has an aggregate
    if (prof && lane == 0) prof[4] = clock64();
  }

  // 3. replay from the entering state, writing x: every step, or with a log only the steps before kc
  const bool logged = lg > 0;
  const int kc = (lg >> 8) & 255;   // a logged chunk's first logged step
  // A logged chunk's tail is a chain of waits on device memory, which the other chunks' streaming keeps busy:
  // its replay's rows are brought into L2 before it starts, and its log a few steps before the repair stages it.
  if (logged)
    prefetch_inputs(row0, kc * N, [&](const void* p, int bytes) { l2_prefetch_range(p, bytes, lane); });
  for_each_step(logged ? kc : Tc, [&](int k, StepIn& cur, int (&pn)[E], int n) {
    if (logged && k == kc - 4) {
      const int ne = lg >> 16;   // the log's entries
      l2_prefetch_range(log_d(), ne * (int)sizeof(A), lane);
      l2_prefetch_range(log_w(), ne * 4, lane);
      if constexpr (kLogY) l2_prefetch_range(log_y(), ne * (int)sizeof(A), lane);
    }
#pragma unroll
    for (int j = 0; j < E; ++j) val[j] = cmul(cur.d[j], x[j]);
    scatter_step(val, cur, x, pn, k, n);
#pragma unroll
    for (int j = 0; j < E; ++j)
      if (live(j)) RV::gstore(a.out_re, a.out_im, row0 + static_cast<size_t>(k) * N + lane + 32 * j, x[j]);
  });
  if (logged) {
    if (prof && lane == 0) prof[8] = clock64();
    repair(x);
  }
  if (fast) {
#pragma unroll
    for (int j = 0; j < E; ++j)
      if (live(j)) incl[cbase + lane + 32 * j] = x[j];
    publish_flag(flags + static_cast<size_t>(q) * C + c, 2);
  }
  if (prof && lane == 0) prof[5] = clock64();
}

template <int K, typename In>
Kernel fwd_warp_kernel(int E) {
  return E == 1 ? pd_fwd_warp_kernel<K, In, 1> : E == 2 ? pd_fwd_warp_kernel<K, In, 2>
       : E == 4 ? pd_fwd_warp_kernel<K, In, 4> : pd_fwd_warp_kernel<K, In, 8>;
}
#define PDK_INSTANTIATE(K, In) template Kernel fwd_warp_kernel<K, In>(int);
PDK_FORMS(PDK_INSTANTIATE)

int fwd_warp_entries(int N) { return warp_entries(N); }
int fwd_warp_smem_bytes(int N, int asize) { return warp_smem_bytes(N, asize); }

}  // namespace pdk

// Host side of the PD-scan kernels: shared-memory sizes, occupancy, and the launch of the kernel the caller
// chose (the choice itself is llm_surgery/ops/pd_scan/launch_policy.py's). Implements pd_scan.cuh's functions.
#include <cstdio>
#include "pd_scan_kernels.cuh"

namespace pdk {

constexpr int WARP_MAX_N = 256;   // the warp kernel keeps E = N / 32 <= 8 entries per lane in registers
// The forward kernel, chosen by llm_surgery/ops/pd_scan/launch_policy.py (algo_code, ALGOS; a test compares):
// taken as given, never re-chosen here
constexpr int ALGO_BLOCK = 1;   // one block per chunk, shared-memory scatter, any N <= 1024
constexpr int ALGO_WARP = 2;    // one warp per chunk, per-step gather lists, N <= WARP_MAX_N

template <int K, typename In>
int smem_bytes(int N, int T, int Np, bool bwd, int algo) {
  using RD = Arr<K, typename Planes<In>::D>;
  using RV = Arr<K, typename Planes<In>::V>;
  const int asize = (int)sizeof(typename RV::A);
  if (!bwd && algo == ALGO_WARP) return fwd_warp_smem_bytes(N, asize);
  const int varrays = bwd ? 2 : 1;   // D, and b (forward) or g and x (backward)
  const int bufs = bwd ? 1 : (fwd_warp_buffers(N, asize) > 0 ? fwd_warp_buffers(N, asize) : 1);
  if (!bwd) Np = fwd_block(N, asize);
  return align16(2 * bufs * Np * asize) + RD::planes * align16(T * N * RD::esize) +
         varrays * RV::planes * align16(T * N * RV::esize) + align16(T * N * (int)sizeof(Idx));
}

// Warps of the warp forward kernel an SM holds at once (registers, shared memory), from the CUDA occupancy API
template <int K, typename In>
int warp_blocks_per_sm(int N) {
  int n = 0;
  const int sm = smem_bytes<K, In>(N, 1, 32, false, ALGO_WARP);
  const Kernel kern = fwd_warp_kernel<K, In>(fwd_warp_entries(N));
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kern, 32, sm) != cudaSuccess) return 0;
  return n;
}

template <int K, typename In>
const char* launch(const ScanArgs& a, bool bwd, cudaStream_t stream) {
  static thread_local char msg[512];
  constexpr int asize = (int)sizeof(typename AccT<K>::T);
  if (!bwd && a.algo != ALGO_BLOCK && !(a.algo == ALGO_WARP && a.N <= WARP_MAX_N)) {   // a code the policy never sends
    snprintf(msg, sizeof(msg), "forward kernel code %d at N=%d: 1 (block) or 2 (warp, N <= %d)", a.algo, a.N,
             WARP_MAX_N);
    return msg;
  }
  const int algo = bwd ? ALGO_BLOCK : a.algo;   // the backward has one kernel
  const int Np = bwd ? (a.N + 31) / 32 * 32 : (algo == ALGO_WARP ? 32 : fwd_block(a.N, asize));
  const int sm = smem_bytes<K, In>(a.N, a.T, Np, bwd, algo);
  const int wpw = fwd_warp_buffers(a.N, asize);
  const int E = fwd_warp_entries(a.N);
  // variants: 0 backward, 1..4 block forward with 1, 2, 4, 8 per-warp buffers, 5 block forward with atomics,
  // 6..9 warp forward with E = 1, 2, 4, 8 entries per lane
  const int v = bwd ? 0
              : algo == ALGO_WARP ? (E == 1 ? 6 : E == 2 ? 7 : E == 4 ? 8 : 9)
                          : (wpw == 1 ? 1 : wpw == 2 ? 2 : wpw == 4 ? 3 : wpw == 8 ? 4 : 5);
  Kernel kern = v == 0 ? bwd_kernel<K, In>() : v <= 5 ? fwd_block_kernel<K, In>(wpw) : fwd_warp_kernel<K, In>(E);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    snprintf(msg, sizeof(msg), "CUDA error pending before the pd_scan launch (from earlier work): %s",
             cudaGetErrorString(e));
    return msg;
  }
  // per device and variant: the dynamic shared-memory limit already set (static shared memory counts too)
  static int raised[64][10] = {};
  int dev = 0;
  cudaGetDevice(&dev);
  int& done = raised[dev & 63][v];
  if (sm > done) {
    e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, sm);
    if (e != cudaSuccess) {
      cudaGetLastError();   // reset it, or the caller's next CUDA call would fail on this refusal
      snprintf(msg, sizeof(msg), "cudaFuncSetAttribute(max dynamic smem %d B): %s", sm, cudaGetErrorString(e));
      return msg;
    }
    done = sm;
  }
  kern<<<a.S * a.C, Np, sm, stream>>>(a);
  e = cudaGetLastError();
  if (e != cudaSuccess) {
    cudaFuncAttributes fa{};
    cudaFuncGetAttributes(&fa, kern);
    snprintf(msg, sizeof(msg),
             "launch of variant %d (layout %d, bwd %d): %s; grid %d, block %d, smem %d B; kernel: %d regs, "
             "max threads %d, max dyn smem %d B, local %zu B",
             v, K, (int)bwd, cudaGetErrorString(e), a.S * a.C, Np, sm, fa.numRegs, fa.maxThreadsPerBlock,
             fa.maxDynamicSharedSizeBytes, fa.localSizeBytes);
    return msg;
  }
  return nullptr;
}

}  // namespace pdk

// layout: 0 real, 1 split, 2 interleaved complex64; form: 0 float32, 1 bfloat16 (layouts 0, 1), 2 Mixed (split)
#define PDK_DISPATCH(layout, form, F, ...)                                                                   \
  ((layout) == REAL && (form) == 0    ? F<REAL, float>(__VA_ARGS__)                                          \
   : (layout) == REAL && (form) == 1  ? F<REAL, __nv_bfloat16>(__VA_ARGS__)                                  \
   : (layout) == SPLIT && (form) == 0 ? F<SPLIT, float>(__VA_ARGS__)                                         \
   : (layout) == SPLIT && (form) == 1 ? F<SPLIT, __nv_bfloat16>(__VA_ARGS__)                                 \
   : (layout) == SPLIT && (form) == 2 ? F<SPLIT, Mixed>(__VA_ARGS__)                                         \
                                      : F<CPLX, float>(__VA_ARGS__))

static bool known_form(int layout, int form) {
  return (layout == pdk::REAL && (form == 0 || form == 1)) || (layout == pdk::SPLIT && form >= 0 && form <= 2) ||
         (layout == pdk::CPLX && form == 0);
}

int pd_scan_warp_blocks_per_sm(int layout, int form, int N) {
  using namespace pdk;
  if (N > WARP_MAX_N || !known_form(layout, form)) return 0;
  return PDK_DISPATCH(layout, form, warp_blocks_per_sm, N);
}

int pd_scan_smem_bytes(int layout, int form, int N, int T, int bwd, int algo) {
  using namespace pdk;
  if (!known_form(layout, form)) return 0;
  const int Np = (N + 31) / 32 * 32;
  return PDK_DISPATCH(layout, form, smem_bytes, N, T, Np, bwd, algo);
}

const char* pd_scan_launch(int layout, int form, int bwd, const pdk::ScanArgs& a, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  using namespace pdk;
  if (!known_form(layout, form)) return "pd_scan: unsupported layout/dtype combination";
  return PDK_DISPATCH(layout, form, launch, a, bwd, stream);
}

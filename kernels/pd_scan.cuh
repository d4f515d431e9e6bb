// Shared between the CUDA kernels (pd_scan_common.cuh, pd_scan_launch.cu) and the Python binding (pd_scan_bind.cpp):
// plain C types only.
#pragma once
#include <cstdint>

namespace pdk {
using Idx = int16_t;

struct ScanArgs {
  // forward: a0 = D, a1 = b, out = x.   backward: a0 = D, a1 = g (grad_x), a2 = x, out = grad_b, out2 = grad_D
  const Idx* P;
  const void *a0_re, *a0_im, *a1_re, *a1_im, *a2_re, *a2_im;
  void *out_re, *out_im, *out2_re, *out2_im;
  const void* x0;   // fp32 (float or float2 interleaved), [S, N], may be null
  void* gx0;        // backward: fp32 grad_x0 [S, N], may be null
  int* counter;     // [1 + S*C]: ticket counter, then flags; the warp forward: S*C link flags after them
  int* agg_pi;      // [S*C*N]: the chunk aggregates' column maps (the warp forward keeps them as sorted
                    // (dest << 16 | source) keys)
  void* agg_d;      // [S*C*N] A
  void* agg_v;      // [S*C*N] A  (forward: zero-state end y; backward: zero-carry exit v)
  void* incl;       // [S*C*N] A  inclusive state
  long long* prof;  // optional [S*C, PROBES] clock64 probes of the forward (null: off)
  void* rlog;       // warp forward's repair log: [S*C*rcap] A (factors), then [S*C*rcap] int (links, positions),
                    // then (bf16 outputs) [S*C*rcap] A (zero-state y at each step's destinations)
  void* link;       // warp forward's look-back links: [S*C] records of link_words(sizeof(A)) 4-byte words
  const int* starts;   // warp forward: [C+1] first step of each chunk (T: the longest); the others: null, chunks
                       // of T steps
  int S, L, N, T, C;
  int rcap;         // repair-log entries per chunk (0: the warp forward replays every chunk in full)
  int algo;         // forward: 1 block-per-chunk scatter kernel, 2 warp-per-chunk gather kernel (launch_policy.py
                    // chooses)
};

}  // namespace pdk

// layout: 0 real, 1 split re/im planes, 2 interleaved complex64; form: 0 float32 planes, 1 bfloat16 planes (layouts
// 0 and 1), 2 float32 D with bfloat16 b, x, g, grad_b, grad_D (layout 1). Unknown combinations: 0 bytes, 0 warps, an
// error from the launch.
int pd_scan_smem_bytes(int layout, int form, int N, int T, int bwd, int algo);
// Blocks (warps) of the warp forward kernel one SM holds at once; 0 for N beyond that kernel or on error.
int pd_scan_warp_blocks_per_sm(int layout, int form, int N);
// Launches the forward (bwd = 0) or backward kernel on `stream` (a cudaStream_t); returns an error or nullptr.
const char* pd_scan_launch(int layout, int form, int bwd, const pdk::ScanArgs& a, void* stream);

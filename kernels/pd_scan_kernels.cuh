// The kernel files' entry points for the launcher (pd_scan_launch.cu). Each kernel file is its own translation
// unit: it instantiates its __global__ templates through these accessors (for the forms PDK_FORMS lists), and the
// launcher launches the returned pointers.
#pragma once
#include "pd_scan_common.cuh"

namespace pdk {
using Kernel = void (*)(ScanArgs);

// X(K, In) for every (layout, plane types) the kernels are built for (Mixed: float32 D, bfloat16 others; Planes)
#define PDK_FORMS(X) \
  X(REAL, float) X(REAL, __nv_bfloat16) X(SPLIT, float) X(SPLIT, __nv_bfloat16) X(SPLIT, Mixed) X(CPLX, float)

// pd_fwd_block.cu: the block forward with `bufs` per-warp scatter buffers (1, 2, 4, 8; 0: shared-memory atomics)
template <int K, typename In> Kernel fwd_block_kernel(int bufs);
// pd_fwd_warp.cu: the warp forward with E entries per lane (1, 2, 4, 8), E for a state of N entries, and its
// shared memory (independent of the chunk length)
template <int K, typename In> Kernel fwd_warp_kernel(int E);
int fwd_warp_entries(int N);
int fwd_warp_smem_bytes(int N, int asize);
// pd_bwd.cu: the backward
template <int K, typename In> Kernel bwd_kernel();
}  // namespace pdk

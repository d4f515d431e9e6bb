// Python binding of the PD-scan kernels: raw device pointers in, no torch headers (fast to build).
// Argument checking and allocation happen in llm_surgery/ops/pd_scan/cuda.py.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "pd_scan.cuh"

// p: P, D_re, D_im, b/g_re, b/g_im, x_re, x_im, out_re, out_im, out2_re, out2_im, x0, gx0,
//    counter, agg_pi, agg_d, agg_v, incl, prof, rlog, link, starts   (0 = null);   dims: S, L, N, T, C, algo, rcap
static void launch(int layout, int form, int bwd, const std::vector<uint64_t>& p, const std::vector<int>& dims,
                   uint64_t stream) {
  if (p.size() != 22 || dims.size() != 7)
    throw std::invalid_argument("pd_scan launch: expected 22 pointers and 7 dims");
  auto ptr = [&](int i) { return reinterpret_cast<void*>(static_cast<uintptr_t>(p[i])); };
  pdk::ScanArgs a;
  a.P = static_cast<const pdk::Idx*>(ptr(0));
  a.a0_re = ptr(1); a.a0_im = ptr(2); a.a1_re = ptr(3); a.a1_im = ptr(4); a.a2_re = ptr(5); a.a2_im = ptr(6);
  a.out_re = ptr(7); a.out_im = ptr(8); a.out2_re = ptr(9); a.out2_im = ptr(10);
  a.x0 = ptr(11); a.gx0 = ptr(12);
  a.counter = static_cast<int*>(ptr(13)); a.agg_pi = static_cast<int*>(ptr(14));
  a.agg_d = ptr(15); a.agg_v = ptr(16); a.incl = ptr(17);
  a.prof = static_cast<long long*>(ptr(18));
  a.rlog = ptr(19);
  a.link = ptr(20);
  a.starts = static_cast<const int*>(ptr(21));
  a.S = dims[0]; a.L = dims[1]; a.N = dims[2]; a.T = dims[3]; a.C = dims[4]; a.algo = dims[5];
  a.rcap = dims[6];
  const char* err = pd_scan_launch(layout, form, bwd, a, reinterpret_cast<void*>(static_cast<uintptr_t>(stream)));
  if (err) throw std::runtime_error(std::string("pd_scan CUDA launch failed: ") + err);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "llm_surgery PD-SSM scan kernels (raw-pointer interface; use llm_surgery.ops.pd_scan.cuda)";
  m.def("launch", &launch);
  m.def("smem_bytes", &pd_scan_smem_bytes);
  m.def("warp_blocks_per_sm", &pd_scan_warp_blocks_per_sm);
}

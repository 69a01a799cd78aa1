// FP8 K-grouped weight gradient (grouped_gemm_fp8.cuh, GroupedWgradFp8Problem): cooperative
// 128x128x128 CTA tile, 1x2x1 cluster (the fprop GEMM's measured best), 128x1 scales on both
// operands.
#ifndef NDEBUG
#define NDEBUG
#endif
#include "ffi/kernels/grouped_gemm_fp8.cuh"

namespace megamoe::grouped {
namespace {
using WgradGemm = fp8::Fp8Gemm<fp8::Cooperative128x128Cluster1x2, fp8::WgradScales>;
}  // namespace

size_t GroupedWgradFp8WorkspaceBytes(int num_groups, int sm_count) {
  return fp8::WorkspaceBytes<WgradGemm>(num_groups, sm_count);
}

std::string RunGroupedWgradFp8(const GroupedWgradFp8Problem& p, void* ws, size_t ws_bytes,
                               int sm_count, cudaStream_t stream) {
  if (p.ca % 128 != 0 || p.cb % 128 != 0 || p.length % 128 != 0) {
    return "FP8 grouped wgrad needs Ca, Cb and length multiples of 128, got Ca=" +
           std::to_string(p.ca) + " Cb=" + std::to_string(p.cb) + " length=" +
           std::to_string(p.length);
  }
  return fp8::RunWgrad<WgradGemm>(p, ws, ws_bytes, sm_count, stream);
}

}  // namespace megamoe::grouped

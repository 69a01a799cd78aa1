// The fprop grouped GEMM (see grouped_gemm.h): one CUTLASS sm90 instantiation.
// CUTLASS asserts inside the wgmma consumer loop become function calls that serialise wgmma
// (ptxas C7510): compile these instantiations without them whatever the build type.
#ifndef NDEBUG
#define NDEBUG
#endif
#include "ffi/kernels/grouped_gemm_sm90.cuh"

namespace megamoe::grouped {
namespace {
using Config = sm90::GroupedGemm<GemmKind::kFprop, cute::Shape<cute::_128, cute::_256, cute::_64>,
                                 cute::Shape<cute::_2, cute::_1, cute::_1>, cutlass::bfloat16_t>;
}  // namespace

size_t GroupedGemmFpropWorkspaceBytes(int num_groups, int sm_count) {
  return sm90::WorkspaceBytes<Config>(num_groups, sm_count);
}

std::string RunGroupedGemmFprop(const GroupedGemmProblem& p, void* workspace,
                                size_t workspace_bytes, int sm_count, cudaStream_t stream) {
  return sm90::Run<Config, GemmKind::kFprop>(p, workspace, workspace_bytes, sm_count, stream);
}

}  // namespace megamoe::grouped

// Dispatch of the grouped GEMMs to their instantiations (one .cu per layout, compiled apart).
#include "ffi/kernels/grouped_gemm.h"

namespace megamoe::grouped {

size_t GroupedGemmFpropWorkspaceBytes(int, int);
size_t GroupedGemmDgradWorkspaceBytes(int, int);
size_t GroupedGemmWgradWorkspaceBytes(int, int);
std::string RunGroupedGemmFprop(const GroupedGemmProblem&, void*, size_t, int, cudaStream_t);
std::string RunGroupedGemmDgrad(const GroupedGemmProblem&, void*, size_t, int, cudaStream_t);
std::string RunGroupedGemmWgrad(const GroupedGemmProblem&, void*, size_t, int, cudaStream_t);

size_t GroupedGemmWorkspaceBytes(GemmKind kind, int num_groups, int sm_count) {
  switch (kind) {
    case GemmKind::kFprop: return GroupedGemmFpropWorkspaceBytes(num_groups, sm_count);
    case GemmKind::kDgrad: return GroupedGemmDgradWorkspaceBytes(num_groups, sm_count);
    case GemmKind::kWgrad: return GroupedGemmWgradWorkspaceBytes(num_groups, sm_count);
  }
  return 0;
}

std::string RunGroupedGemm(const GroupedGemmProblem& p, void* workspace, size_t workspace_bytes,
                           int sm_count, cudaStream_t stream) {
  switch (p.kind) {
    case GemmKind::kFprop: return RunGroupedGemmFprop(p, workspace, workspace_bytes, sm_count, stream);
    case GemmKind::kDgrad: return RunGroupedGemmDgrad(p, workspace, workspace_bytes, sm_count, stream);
    case GemmKind::kWgrad: return RunGroupedGemmWgrad(p, workspace, workspace_bytes, sm_count, stream);
  }
  return "unknown grouped GEMM kind";
}

}  // namespace megamoe::grouped

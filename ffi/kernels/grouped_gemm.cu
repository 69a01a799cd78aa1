// Dispatch of the grouped GEMMs to their CUTLASS instantiations (one .cu per layout and tile
// schedule, compiled apart). The schedule variant of each GEMM kind has a measured default and can
// be overridden for benchmarking with MEGAMOE_GROUPED_GEMM_VARIANT, read once per process:
// "1" (every kind) or "fprop:0,dgrad:2,wgrad:1".
//   0  cooperative, 128x256x64 CTA tile, 2x1x1 cluster
//   1  cooperative, 256x128x64 CTA tile, 2x1x1 cluster
//   2  ping-pong,   128x128x64 CTA tile, 2x1x1 cluster
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "ffi/kernels/grouped_gemm.h"

namespace megamoe::grouped {

#define MEGAMOE_DECLARE_GROUPED_GEMM(KIND, VARIANT)                                         \
  size_t GroupedGemm##KIND##V##VARIANT##WorkspaceBytes(int, int);                           \
  std::string RunGroupedGemm##KIND##V##VARIANT(const GroupedGemmProblem&, void*, size_t, int, \
                                               cudaStream_t);
MEGAMOE_DECLARE_GROUPED_GEMM(Fprop, 0)
MEGAMOE_DECLARE_GROUPED_GEMM(Fprop, 1)
MEGAMOE_DECLARE_GROUPED_GEMM(Fprop, 2)
MEGAMOE_DECLARE_GROUPED_GEMM(Dgrad, 0)
MEGAMOE_DECLARE_GROUPED_GEMM(Dgrad, 1)
MEGAMOE_DECLARE_GROUPED_GEMM(Dgrad, 2)
MEGAMOE_DECLARE_GROUPED_GEMM(Wgrad, 0)
MEGAMOE_DECLARE_GROUPED_GEMM(Wgrad, 1)
MEGAMOE_DECLARE_GROUPED_GEMM(Wgrad, 2)

namespace {

using WsFn = size_t (*)(int, int);
using RunFn = std::string (*)(const GroupedGemmProblem&, void*, size_t, int, cudaStream_t);
constexpr int kVariants = 3;
constexpr WsFn kWorkspace[3][kVariants] = {
    {GroupedGemmFpropV0WorkspaceBytes, GroupedGemmFpropV1WorkspaceBytes,
     GroupedGemmFpropV2WorkspaceBytes},
    {GroupedGemmDgradV0WorkspaceBytes, GroupedGemmDgradV1WorkspaceBytes,
     GroupedGemmDgradV2WorkspaceBytes},
    {GroupedGemmWgradV0WorkspaceBytes, GroupedGemmWgradV1WorkspaceBytes,
     GroupedGemmWgradV2WorkspaceBytes}};
constexpr RunFn kRun[3][kVariants] = {
    {RunGroupedGemmFpropV0, RunGroupedGemmFpropV1, RunGroupedGemmFpropV2},
    {RunGroupedGemmDgradV0, RunGroupedGemmDgradV1, RunGroupedGemmDgradV2},
    {RunGroupedGemmWgradV0, RunGroupedGemmWgradV1, RunGroupedGemmWgradV2}};

// Default variant per kind (fprop, dgrad, wgrad).
constexpr int kDefaultVariant[3] = {0, 0, 0};

int Variant(GemmKind kind) {
  static std::once_flag once;
  static int chosen[3] = {kDefaultVariant[0], kDefaultVariant[1], kDefaultVariant[2]};
  std::call_once(once, [] {
    const char* env = std::getenv("MEGAMOE_GROUPED_GEMM_VARIANT");
    if (env == nullptr || *env == '\0') return;
    if (env[1] == '\0' && env[0] >= '0' && env[0] < '0' + kVariants) {
      chosen[0] = chosen[1] = chosen[2] = env[0] - '0';
      return;
    }
    const char* names[3] = {"fprop:", "dgrad:", "wgrad:"};
    for (int k = 0; k < 3; ++k) {
      const char* at = std::strstr(env, names[k]);
      if (at != nullptr) {
        const char c = at[std::strlen(names[k])];
        if (c >= '0' && c < '0' + kVariants) chosen[k] = c - '0';
      }
    }
  });
  return chosen[static_cast<int>(kind)];
}

}  // namespace

size_t GroupedGemmWorkspaceBytes(GemmKind kind, int num_groups, int sm_count) {
  return kWorkspace[static_cast<int>(kind)][Variant(kind)](num_groups, sm_count);
}

std::string RunGroupedGemm(const GroupedGemmProblem& p, void* workspace, size_t workspace_bytes,
                           int sm_count, cudaStream_t stream) {
  return kRun[static_cast<int>(p.kind)][Variant(p.kind)](p, workspace, workspace_bytes, sm_count,
                                                         stream);
}

}  // namespace megamoe::grouped

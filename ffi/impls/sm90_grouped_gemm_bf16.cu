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

#include "ffi/gemm/grouped_gemm.h"

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

// Default variant per kind (fprop, dgrad, wgrad), from benchmarks/RESULTS.md (H200, 131,072
// rows): cooperative 128x256 is fastest for fprop and dgrad at every measured shape; for wgrad
// ping-pong wins with many small groups (128 experts), cooperative with few large ones (16).
int DefaultVariant(GemmKind kind, int num_groups) {
  if (kind == GemmKind::kWgrad) return num_groups >= 64 ? 2 : 0;
  return 0;
}

int Variant(GemmKind kind, int num_groups) {
  static std::once_flag once;
  static int chosen[3] = {-1, -1, -1};  // -1: the default
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
  const int v = chosen[static_cast<int>(kind)];
  return v >= 0 ? v : DefaultVariant(kind, num_groups);
}

}  // namespace

size_t GroupedGemmWorkspaceBytes(GemmKind kind, int num_groups, int sm_count) {
  return kWorkspace[static_cast<int>(kind)][Variant(kind, num_groups)](num_groups, sm_count);
}

std::string RunGroupedGemm(const GroupedGemmProblem& p, void* workspace, size_t workspace_bytes,
                           int sm_count, cudaStream_t stream) {
  return kRun[static_cast<int>(p.kind)][Variant(p.kind, p.num_groups)](p, workspace,
                                                                       workspace_bytes, sm_count,
                                                                       stream);
}

}  // namespace megamoe::grouped

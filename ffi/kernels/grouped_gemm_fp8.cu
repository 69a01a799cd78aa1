// Dispatch of the FP8 grouped GEMM to its schedule variants (grouped_gemm_fp8_v<N>.cu). The
// default is the measured best (benchmarks/RESULTS.md); MEGAMOE_FP8_GEMM_VARIANT=<N> overrides
// it for benchmarking, read once per process:
//   0  cooperative, 128x128x128 CTA tile, 1x2x1 cluster
//   1  cooperative, 128x128x128 CTA tile, 2x1x1 cluster
//   2  ping-pong,    64x128x128 CTA tile, 1x2x1 cluster
#include <algorithm>
#include <cstdlib>
#include <mutex>

#include "ffi/kernels/grouped_fp8.h"

namespace megamoe::grouped {

#define MEGAMOE_DECLARE_GROUPED_GEMM_FP8(VARIANT)                                             \
  size_t GroupedGemmFp8V##VARIANT##WorkspaceBytes(int, int);                                  \
  std::string RunGroupedGemmFp8V##VARIANT(const GroupedGemmFp8Problem&, void*, size_t, int,   \
                                          cudaStream_t);
MEGAMOE_DECLARE_GROUPED_GEMM_FP8(0)
MEGAMOE_DECLARE_GROUPED_GEMM_FP8(1)
MEGAMOE_DECLARE_GROUPED_GEMM_FP8(2)
#undef MEGAMOE_DECLARE_GROUPED_GEMM_FP8

namespace {

constexpr int kVariants = 3;
constexpr size_t (*kWorkspace[kVariants])(int, int) = {
    GroupedGemmFp8V0WorkspaceBytes, GroupedGemmFp8V1WorkspaceBytes,
    GroupedGemmFp8V2WorkspaceBytes};
constexpr std::string (*kRun[kVariants])(const GroupedGemmFp8Problem&, void*, size_t, int,
                                         cudaStream_t) = {
    RunGroupedGemmFp8V0, RunGroupedGemmFp8V1, RunGroupedGemmFp8V2};

int Variant() {
  static std::once_flag once;
  static int chosen = 0;
  std::call_once(once, [] {
    const char* env = std::getenv("MEGAMOE_FP8_GEMM_VARIANT");
    if (env != nullptr && env[0] >= '0' && env[0] < '0' + kVariants && env[1] == '\0') {
      chosen = env[0] - '0';
    }
  });
  return chosen;
}

}  // namespace

size_t GroupedGemmFp8WorkspaceBytes(int num_groups, int sm_count) {
  size_t bytes = 0;
  for (auto fn : kWorkspace) bytes = std::max(bytes, fn(num_groups, sm_count));
  return bytes;
}

std::string RunGroupedGemmFp8(const GroupedGemmFp8Problem& problem, void* workspace,
                              size_t workspace_bytes, int sm_count, cudaStream_t stream) {
  return kRun[Variant()](problem, workspace, workspace_bytes, sm_count, stream);
}

}  // namespace megamoe::grouped

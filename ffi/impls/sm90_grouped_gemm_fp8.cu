// Dispatch of the FP8 grouped GEMMs to their schedule variants (sm90_grouped_gemm_fp8_v<N>.cu,
// sm90_grouped_wgrad_fp8_v<N>.cu). The defaults are the measured best (benchmarks/RESULTS.md);
// MEGAMOE_FP8_GEMM_VARIANT=<N> / MEGAMOE_FP8_WGRAD_VARIANT=<N> override them for benchmarking,
// read once per process:
//   rows x weights  0  cooperative, 128x128x128 CTA tile, 1x2x1 cluster
//                   1  cooperative, 128x128x128 CTA tile, 2x1x1 cluster
//                   2  ping-pong,    64x128x128 CTA tile, 1x2x1 cluster
//   wgrad           0  cooperative, 128x128x128 CTA tile, 1x2x1 cluster
//                   1  ping-pong,    64x128x128 CTA tile, 1x2x1 cluster
#include <algorithm>
#include <cstdlib>

#include "ffi/gemm/grouped_gemm_fp8.h"

namespace megamoe::grouped {

#define MEGAMOE_DECLARE_GROUPED_GEMM_FP8(VARIANT)                                             \
  size_t GroupedGemmFp8V##VARIANT##WorkspaceBytes(int, int);                                  \
  std::string RunGroupedGemmFp8V##VARIANT(const GroupedGemmFp8Problem&, void*, size_t, int,   \
                                          cudaStream_t);
MEGAMOE_DECLARE_GROUPED_GEMM_FP8(0)
MEGAMOE_DECLARE_GROUPED_GEMM_FP8(1)
MEGAMOE_DECLARE_GROUPED_GEMM_FP8(2)
#undef MEGAMOE_DECLARE_GROUPED_GEMM_FP8
#define MEGAMOE_DECLARE_GROUPED_WGRAD_FP8(VARIANT)                                            \
  size_t GroupedWgradFp8V##VARIANT##WorkspaceBytes(int, int);                                 \
  std::string RunGroupedWgradFp8V##VARIANT(const GroupedWgradFp8Problem&, void*, size_t, int, \
                                           cudaStream_t);
MEGAMOE_DECLARE_GROUPED_WGRAD_FP8(0)
MEGAMOE_DECLARE_GROUPED_WGRAD_FP8(1)
#undef MEGAMOE_DECLARE_GROUPED_WGRAD_FP8

namespace {

constexpr int kVariants = 3;
constexpr size_t (*kWorkspace[kVariants])(int, int) = {
    GroupedGemmFp8V0WorkspaceBytes, GroupedGemmFp8V1WorkspaceBytes,
    GroupedGemmFp8V2WorkspaceBytes};
constexpr std::string (*kRun[kVariants])(const GroupedGemmFp8Problem&, void*, size_t, int,
                                         cudaStream_t) = {
    RunGroupedGemmFp8V0, RunGroupedGemmFp8V1, RunGroupedGemmFp8V2};

constexpr int kWgradVariants = 2;
constexpr size_t (*kWgradWorkspace[kWgradVariants])(int, int) = {
    GroupedWgradFp8V0WorkspaceBytes, GroupedWgradFp8V1WorkspaceBytes};
constexpr std::string (*kWgradRun[kWgradVariants])(const GroupedWgradFp8Problem&, void*, size_t,
                                                   int, cudaStream_t) = {
    RunGroupedWgradFp8V0, RunGroupedWgradFp8V1};

// The variant named by environment variable `name` (one digit below `count`), else 0.
int VariantFromEnv(const char* name, int count) {
  const char* env = std::getenv(name);
  if (env != nullptr && env[0] >= '0' && env[0] < '0' + count && env[1] == '\0') {
    return env[0] - '0';
  }
  return 0;
}

int Variant() {
  static const int chosen = VariantFromEnv("MEGAMOE_FP8_GEMM_VARIANT", kVariants);
  return chosen;
}

int WgradVariant() {
  static const int chosen = VariantFromEnv("MEGAMOE_FP8_WGRAD_VARIANT", kWgradVariants);
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

size_t GroupedWgradFp8WorkspaceBytes(int num_groups, int sm_count) {
  size_t bytes = 0;
  for (auto fn : kWgradWorkspace) bytes = std::max(bytes, fn(num_groups, sm_count));
  return bytes;
}

std::string RunGroupedWgradFp8(const GroupedWgradFp8Problem& problem, void* workspace,
                               size_t workspace_bytes, int sm_count, cudaStream_t stream) {
  if (problem.ca % 128 != 0 || problem.cb % 128 != 0 || problem.length % 128 != 0) {
    return "FP8 grouped wgrad needs Ca, Cb and length multiples of 128, got Ca=" +
           std::to_string(problem.ca) + " Cb=" + std::to_string(problem.cb) + " length=" +
           std::to_string(problem.length);
  }
  return kWgradRun[WgradVariant()](problem, workspace, workspace_bytes, sm_count, stream);
}

}  // namespace megamoe::grouped

// The bf16 grouped GEMMs of the expert MLP (gemm/grouped_gemm.h) on sm_90a: the grouped-GEMM
// runner over every GEMM kind x tile-schedule variant (heuristics/sm90_gemm_schedules.cuh), the
// variant of a call picked by heuristics/gemm_variants.h. Compiled as several translation units
// (common/shards.h), each registering its instances in the dispatch table.
//
// CUTLASS asserts inside the wgmma consumer loop become function calls that serialise wgmma
// (ptxas C7510): compile the instances without them whatever the build type.
#ifndef NDEBUG
#define NDEBUG
#endif
#include <algorithm>
#include <array>
#include <tuple>

#include "ffi/common/shards.h"
#include "ffi/gemm/grouped_gemm.h"
#include "ffi/gemm/grouped_gemm_runner.cuh"
#include "ffi/gemm/sm90_collective.cuh"
#include "ffi/heuristics/gemm_variants.h"
#include "ffi/heuristics/sm90_gemm_schedules.cuh"

namespace megamoe::grouped {

namespace bf16_instances {
inline constexpr int kKinds = 3;
inline constexpr int kVariants = heuristics::kBf16GemmVariants;
inline constexpr int kCount = kKinds * kVariants;
}  // namespace bf16_instances

namespace {

using bf16_instances::kVariants;

// Operand layout tags of the three GEMMs of the MLP (see grouped_gemm.h).
template <GemmKind Kind>
struct KindLayouts;
template <>
struct KindLayouts<GemmKind::kFprop> {  // A [rows, K] K-major, B [K, N] N-major
  using A = cutlass::layout::RowMajor;
  using B = cutlass::layout::RowMajor;
};
template <>
struct KindLayouts<GemmKind::kDgrad> {  // A [rows, K] K-major, B [N, K] K-major
  using A = cutlass::layout::RowMajor;
  using B = cutlass::layout::ColumnMajor;
};
template <>
struct KindLayouts<GemmKind::kWgrad> {  // A [T, M] M-major, B [T, N] N-major
  using A = cutlass::layout::ColumnMajor;
  using B = cutlass::layout::RowMajor;
};

// The traits of one bf16 instance (gemm/grouped_gemm_runner.cuh): bf16 operands and result.
template <GemmKind Kind, class Schedule>
struct Bf16Gemm
    : gemm::Sm90GroupedGemm<cutlass::bfloat16_t, typename KindLayouts<Kind>::A*, 8,
                            cutlass::bfloat16_t, typename KindLayouts<Kind>::B*, 8,
                            cutlass::bfloat16_t, 8, Schedule> {
  static constexpr bool kBlockScaled = false;
  static constexpr const char* kName = "grouped GEMM";
};

// Group g's problem, from the device offsets: fprop/dgrad rows [off[g], off[g+1]) of A times
// B[g] (or B[g]^T); wgrad A_g^T B_g over the group's rows into D[g] (an empty group gets no
// tiles, M = 0: its output is zeroed by the caller).
template <class G, GemmKind Kind>
__global__ void PrepareBf16Gemm(GroupedGemmProblem p, gemm::GroupArgs<G> args) {
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= p.num_groups) return;
  using T = gemm::GroupTypes<G>;
  const auto* a = static_cast<const typename T::ElementA*>(p.a);
  const auto* b = static_cast<const typename T::ElementB*>(p.b);
  auto* d = static_cast<typename T::ElementD*>(p.d);
  const int64_t r0 = p.offsets[g];
  const int64_t rows = p.offsets[g + 1] - r0;
  if constexpr (Kind == GemmKind::kWgrad) {
    args.Set(g, rows > 0 ? int(p.m) : 0, int(p.n), int(rows), a + r0 * p.m, p.m, b + r0 * p.n,
             p.n, d + int64_t(g) * p.m * p.n, p.n);
  } else {
    args.Set(g, int(rows), int(p.n), int(p.k), a + r0 * p.k, p.k, b + int64_t(g) * p.k * p.n,
             Kind == GemmKind::kFprop ? p.n : p.k, d + r0 * p.n, p.n);
  }
}

// Instance i: kind i / kVariants, schedule variant i % kVariants.
template <int I>
gemm::CompiledGemm<GroupedGemmProblem> CompileInstance() {
  constexpr GemmKind kKind = static_cast<GemmKind>(I / kVariants);
  using G = Bf16Gemm<kKind,
                     std::tuple_element_t<I % kVariants, heuristics::sm90::Bf16GemmSchedules>>;
  return gemm::Compile<G, GroupedGemmProblem, PrepareBf16Gemm<G, kKind>>();
}

}  // namespace

// Every shard's instances, by instance index (one table across the translation units).
inline std::array<gemm::CompiledGemm<GroupedGemmProblem>, bf16_instances::kCount>&
Bf16GemmInstances() {
  static std::array<gemm::CompiledGemm<GroupedGemmProblem>, bf16_instances::kCount> table;
  return table;
}

namespace {
const bool kRegistered = [] {
  ForEachInstanceOfThisShard<bf16_instances::kCount>([](auto i) {
    Bf16GemmInstances()[decltype(i)::value] = CompileInstance<decltype(i)::value>();
  });
  return true;
}();
}  // namespace

#if MEGAMOE_SHARD == 0  // the entry points, once
namespace {
// The variant to run; *error: the override's error text, if any (the default variant is
// returned then, so that the workspace is sized for a compiled one).
const gemm::CompiledGemm<GroupedGemmProblem>& Chosen(GemmKind kind, int num_groups,
                                                     std::string* error) {
  int v = 0;
  *error = heuristics::Bf16GemmVariant(kind, num_groups, &v);
  return Bf16GemmInstances()[static_cast<int>(kind) * kVariants + v];
}
}  // namespace

size_t GroupedGemmWorkspaceBytes(GemmKind kind, int num_groups, int sm_count) {
  std::string error;  // refused by RunGroupedGemm
  const auto& gemm = Chosen(kind, num_groups, &error);
  return gemm.workspace_bytes != nullptr ? gemm.workspace_bytes(num_groups, sm_count) : 0;
}

size_t GroupedGemmMaxWorkspaceBytes(int num_groups, int sm_count) {
  size_t bytes = 0;
  for (GemmKind k : {GemmKind::kFprop, GemmKind::kDgrad, GemmKind::kWgrad}) {
    bytes = std::max(bytes, GroupedGemmWorkspaceBytes(k, num_groups, sm_count));
  }
  return bytes;
}

std::string RunGroupedGemm(const GroupedGemmProblem& p, void* workspace, size_t workspace_bytes,
                           int sm_count, cudaStream_t stream) {
  std::string error;
  const auto& gemm = Chosen(p.kind, p.num_groups, &error);
  if (!error.empty()) return "grouped GEMM: " + error;
  if (gemm.run == nullptr) return "grouped GEMM: this variant is not compiled into the build";
  return gemm.run(p, workspace, workspace_bytes, sm_count, stream);
}
#endif

}  // namespace megamoe::grouped

// The blockwise-scaled FP8 grouped GEMMs (gemm/grouped_gemm_fp8.h) on sm_90a: CUTLASS's ptr-array
// kernel with per-128-K promotion of the fp32 accumulators (FP8Blockwise kernel schedules), D
// bf16, run by the grouped-GEMM runner over every tile-schedule variant
// (heuristics/sm90_gemm_schedules.cuh; the variant of a call: heuristics/gemm_variants.h). Two
// problems:
//   rows x weights  A = rows e4m3 [rows, K] with 1x128 scales (K-major, [rows, K/128]),
//                   B = weights e4m3 [E, N, K] (K-major) with 128x128 scales [E, K/128, N/128].
//   wgrad           A, B = weight-gradient operands e4m3 [Ca | Cb, length] (K = the group's padded
//                   rows, K-major) with 128x1 scales [length/128, Ca | Cb] (M- / N-major).
// Compiled as several translation units (common/shards.h), each registering its instances.
//
// CUTLASS asserts inside the wgmma consumer loop become function calls that serialise wgmma
// (ptxas C7510): compile the instances without them whatever the build type.
#ifndef NDEBUG
#define NDEBUG
#endif
#include <algorithm>
#include <array>
#include <tuple>

#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "ffi/common/shards.h"
#include "ffi/gemm/grouped_gemm_fp8.h"
#include "ffi/gemm/grouped_gemm_runner.cuh"
#include "ffi/gemm/sm90_collective.cuh"
#include "ffi/heuristics/gemm_variants.h"
#include "ffi/heuristics/sm90_gemm_schedules.cuh"

namespace megamoe::grouped {

namespace fp8_instances {
inline constexpr int kGemmVariants = heuristics::kFp8GemmVariants;
inline constexpr int kWgradVariants = heuristics::kFp8WgradVariants;
inline constexpr int kCount = kGemmVariants + kWgradVariants;
}  // namespace fp8_instances

namespace {

// Scale layouts. The kernel rebuilds each group's scale layouts from its (M, N, K) (it ignores
// the layouts passed in), packed per group, so the scales must be laid out so that a group's are
// one contiguous, packed slice:
//   rows x weights: K-major SFA, a group's rows [r0, r0 + M) of the [rows, K/128] matrix; SFB
//     [K/128, N/128] per expert.
//   wgrad: M-/N-major SFA/SFB, a group's K blocks [k0, k0 + K/128) of [length/128, Ca | Cb].
using RowsTimesWeightsScales = cutlass::detail::Sm90BlockwiseScaleConfig<
    1, 128, 128, cute::GMMA::Major::K, cute::GMMA::Major::MN>;
using WgradScales = cutlass::detail::Sm90BlockwiseScaleConfig<1, 1, 128, cute::GMMA::Major::MN,
                                                              cute::GMMA::Major::MN>;

template <class Scales>
using ScaleLayoutA = decltype(Scales::deduce_layoutSFA());
template <class Scales>
using ScaleLayoutB = decltype(Scales::deduce_layoutSFB());

// The traits of one FP8 instance (gemm/grouped_gemm_runner.cuh): e4m3 A [M, K] and B [N, K],
// both K-major, with fp32 block scales; D bf16.
template <class Schedule, class Scales>
struct Fp8Gemm : gemm::Sm90GroupedGemm<
                     cutlass::float_e4m3_t,
                     cute::tuple<cutlass::layout::RowMajor*, ScaleLayoutA<Scales>*>, 16,
                     cutlass::float_e4m3_t,
                     cute::tuple<cutlass::layout::ColumnMajor*, ScaleLayoutB<Scales>*>, 16,
                     cutlass::bfloat16_t, 8, Schedule> {
  static constexpr bool kBlockScaled = true;
  static constexpr const char* kName = "FP8 grouped GEMM";
  using ElementSF = float;
  using ScaleConfig = Scales;
  using LayoutSFA = ScaleLayoutA<Scales>;
  using LayoutSFB = ScaleLayoutB<Scales>;
};

// Rows of group g (A, 1x128 scales) times expert g's weights (B, 128x128 scales).
template <class G>
__global__ void PrepareRowsTimesWeights(GroupedGemmFp8Problem p, gemm::GroupArgs<G> args) {
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= p.num_groups) return;
  const int64_t r0 = p.offsets[g];
  const int rows = int(p.offsets[g + 1] - r0);
  const int64_t kbs = p.k / 128, nbs = p.n / 128;
  args.Set(g, rows, int(p.n), int(p.k), static_cast<const uint8_t*>(p.a) + r0 * p.lda, p.lda,
           static_cast<const uint8_t*>(p.b) + int64_t(g) * p.n * p.k, p.k,
           static_cast<typename gemm::GroupTypes<G>::ElementD*>(p.d) + r0 * p.n, p.n);
  args.SetScales(g, rows, int(p.n), int(p.k), p.a_scale + r0 * kbs,
                 p.b_scale + int64_t(g) * kbs * nbs);
}

// Group g's padded columns of both operands; an empty group gets no tiles (M = 0).
template <class G>
__global__ void PrepareWgrad(GroupedWgradFp8Problem p, gemm::GroupArgs<G> args) {
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= p.num_groups) return;
  const bool empty = p.offsets[g + 1] == p.offsets[g];
  const int64_t c0 = p.padded[g];
  const int k = int(p.padded[g + 1] - c0);
  const int m = empty ? 0 : int(p.ca);
  args.Set(g, m, int(p.cb), k, static_cast<const uint8_t*>(p.a) + c0, p.length,
           static_cast<const uint8_t*>(p.b) + c0, p.length,
           static_cast<typename gemm::GroupTypes<G>::ElementD*>(p.d) + int64_t(g) * p.ca * p.cb,
           p.cb);
  args.SetScales(g, m, int(p.cb), k, p.a_scale + c0 / 128 * p.ca, p.b_scale + c0 / 128 * p.cb);
}

// Instance i < kGemmVariants: rows x weights variant i; then the wgrad variants.
template <int I>
auto CompileInstance() {
  if constexpr (I < fp8_instances::kGemmVariants) {
    using G = Fp8Gemm<std::tuple_element_t<I, heuristics::sm90::Fp8GemmSchedules>,
                      RowsTimesWeightsScales>;
    return gemm::Compile<G, GroupedGemmFp8Problem, PrepareRowsTimesWeights<G>>();
  } else {
    using G = Fp8Gemm<std::tuple_element_t<I - fp8_instances::kGemmVariants,
                                           heuristics::sm90::Fp8WgradSchedules>,
                      WgradScales>;
    return gemm::Compile<G, GroupedWgradFp8Problem, PrepareWgrad<G>>();
  }
}

}  // namespace

// Every shard's instances, by variant (one table per problem across the translation units).
inline std::array<gemm::CompiledGemm<GroupedGemmFp8Problem>, fp8_instances::kGemmVariants>&
Fp8GemmInstances() {
  static std::array<gemm::CompiledGemm<GroupedGemmFp8Problem>, fp8_instances::kGemmVariants> t;
  return t;
}
inline std::array<gemm::CompiledGemm<GroupedWgradFp8Problem>, fp8_instances::kWgradVariants>&
Fp8WgradInstances() {
  static std::array<gemm::CompiledGemm<GroupedWgradFp8Problem>, fp8_instances::kWgradVariants> t;
  return t;
}

namespace {
const bool kRegistered = [] {
  ForEachInstanceOfThisShard<fp8_instances::kCount>([](auto i) {
    constexpr int kI = decltype(i)::value;
    if constexpr (kI < fp8_instances::kGemmVariants) {
      Fp8GemmInstances()[kI] = CompileInstance<kI>();
    } else {
      Fp8WgradInstances()[kI - fp8_instances::kGemmVariants] = CompileInstance<kI>();
    }
  });
  return true;
}();

// The most workspace any variant needs: a handler's scratch then serves whichever one runs.
template <class Table>
size_t MaxWorkspaceBytes(const Table& table, int num_groups, int sm_count) {
  size_t bytes = 0;
  for (const auto& gemm : table) {
    if (gemm.workspace_bytes != nullptr) {
      bytes = std::max(bytes, gemm.workspace_bytes(num_groups, sm_count));
    }
  }
  return bytes;
}
}  // namespace

#if MEGAMOE_SHARD == 0  // the entry points, once
size_t GroupedGemmFp8WorkspaceBytes(int num_groups, int sm_count) {
  return MaxWorkspaceBytes(Fp8GemmInstances(), num_groups, sm_count);
}

std::string RunGroupedGemmFp8(const GroupedGemmFp8Problem& problem, void* workspace,
                              size_t workspace_bytes, int sm_count, cudaStream_t stream) {
  if (problem.k % 128 != 0 || problem.n % 128 != 0) {
    return "FP8 grouped GEMM needs K and N multiples of 128, got K=" +
           std::to_string(problem.k) + " N=" + std::to_string(problem.n);
  }
  int variant = 0;
  if (std::string err = heuristics::Fp8GemmVariant(&variant); !err.empty())
    return "FP8 grouped GEMM: " + err;
  const auto& gemm = Fp8GemmInstances()[variant];
  if (gemm.run == nullptr) return "FP8 grouped GEMM: this variant is not compiled into the build";
  return gemm.run(problem, workspace, workspace_bytes, sm_count, stream);
}

size_t GroupedWgradFp8WorkspaceBytes(int num_groups, int sm_count) {
  return MaxWorkspaceBytes(Fp8WgradInstances(), num_groups, sm_count);
}

std::string RunGroupedWgradFp8(const GroupedWgradFp8Problem& problem, void* workspace,
                               size_t workspace_bytes, int sm_count, cudaStream_t stream) {
  if (problem.ca % 128 != 0 || problem.cb % 128 != 0 || problem.length % 128 != 0) {
    return "FP8 grouped wgrad needs Ca, Cb and length multiples of 128, got Ca=" +
           std::to_string(problem.ca) + " Cb=" + std::to_string(problem.cb) + " length=" +
           std::to_string(problem.length);
  }
  int variant = 0;
  if (std::string err = heuristics::Fp8WgradVariant(&variant); !err.empty())
    return "FP8 grouped wgrad: " + err;
  const auto& gemm = Fp8WgradInstances()[variant];
  if (gemm.run == nullptr) return "FP8 grouped wgrad: this variant is not compiled into the build";
  return gemm.run(problem, workspace, workspace_bytes, sm_count, stream);
}
#endif

}  // namespace megamoe::grouped

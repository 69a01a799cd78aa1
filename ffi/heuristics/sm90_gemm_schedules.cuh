// The tile schedules the sm90 grouped GEMMs are compiled with, in the numbering of the variants
// heuristics/gemm_variants.h picks from (and the environment overrides name): CTA tile,
// cluster, kernel and epilogue schedule of gemm/sm90_collective.cuh.
#pragma once

#include <tuple>

#include "cute/tensor.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "ffi/heuristics/gemm_variants.h"

namespace megamoe::heuristics::sm90 {

using cute::_1;
using cute::_2;
using cute::_64;
using cute::_128;
using cute::_256;
using cute::Shape;

// --- bf16 (K tile 64) ---------------------------------------------------------------------------
struct Cooperative128x256x64Cluster2x1 {
  using TileShape = Shape<_128, _256, _64>;
  using ClusterShape = Shape<_2, _1, _1>;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
struct Cooperative256x128x64Cluster2x1 {
  using TileShape = Shape<_256, _128, _64>;
  using ClusterShape = Shape<_2, _1, _1>;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
struct Pingpong128x128x64Cluster2x1 {
  using TileShape = Shape<_128, _128, _64>;
  using ClusterShape = Shape<_2, _1, _1>;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

// Variants 0, 1, 2 of MEGAMOE_GROUPED_GEMM_VARIANT (every kind: fprop, dgrad, wgrad).
using Bf16GemmSchedules = std::tuple<Cooperative128x256x64Cluster2x1,
                                     Cooperative256x128x64Cluster2x1,
                                     Pingpong128x128x64Cluster2x1>;

// --- blockwise FP8 (K tile 128, the scale block; accumulators promoted every 128 of K) -----------
struct Fp8Cooperative128x128Cluster1x2 {
  using TileShape = Shape<_128, _128, _128>;
  using ClusterShape = Shape<_1, _2, _1>;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
struct Fp8Cooperative128x128Cluster2x1 {
  using TileShape = Shape<_128, _128, _128>;
  using ClusterShape = Shape<_2, _1, _1>;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
// 64-row tiles: half the padding of a group's last, partial M tile (with ~1,000 rows per expert
// the 128-row tile computes ~6% padding); the epilogue of one warp group overlaps the other's
// mainloop.
struct Fp8Pingpong64x128Cluster1x2 {
  using TileShape = Shape<_64, _128, _128>;
  using ClusterShape = Shape<_1, _2, _1>;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

// Variants of MEGAMOE_FP8_GEMM_VARIANT (rows x weights) and MEGAMOE_FP8_WGRAD_VARIANT.
using Fp8GemmSchedules = std::tuple<Fp8Cooperative128x128Cluster1x2,
                                    Fp8Cooperative128x128Cluster2x1,
                                    Fp8Pingpong64x128Cluster1x2>;
using Fp8WgradSchedules = std::tuple<Fp8Cooperative128x128Cluster1x2, Fp8Pingpong64x128Cluster1x2>;

static_assert(std::tuple_size_v<Bf16GemmSchedules> == kBf16GemmVariants);
static_assert(std::tuple_size_v<Fp8GemmSchedules> == kFp8GemmVariants);
static_assert(std::tuple_size_v<Fp8WgradSchedules> == kFp8WgradVariants);

}  // namespace megamoe::heuristics::sm90

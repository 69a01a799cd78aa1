// The CUTLASS 3.x type recipe of an sm90 ptr-array grouped GEMM: a persistent TMA + wgmma
// warp-specialised kernel, fp32 accumulation, D = acc (no source C), the mainloop's pipeline
// stages sized from what the epilogue leaves of shared memory. The bf16 and FP8 grouped GEMMs
// (impls/sm90_grouped_gemm_*.cu) are this recipe with their operand types; a fused kernel can
// take its CollectiveMainloop and CollectiveEpilogue from it.
//
//   ElementA/B, GmemLayoutA/B, kAlignA/B  what CUTLASS's mainloop builder takes (GmemLayout is a
//                                         layout tag pointer, or a tuple of it and a scale-factor
//                                         layout pointer for blockwise-scaled FP8)
//   ElementD, kAlignD                     the row-major result
//   Schedule                              TileShape, ClusterShape, KernelSchedule and
//                                         EpilogueSchedule (heuristics/sm90_gemm_schedules.cuh)
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

namespace megamoe::gemm {

template <class ElementA, class GmemLayoutA, int kAlignA, class ElementB, class GmemLayoutB,
          int kAlignB, class ElementD, int kAlignD, class Schedule>
struct Sm90GroupedGemm {
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
  using ElementAcc = float;
  using LayoutD = cutlass::layout::RowMajor;
  using TileShape = typename Schedule::TileShape;
  using ClusterShape = typename Schedule::ClusterShape;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, ElementAcc,
      void, LayoutD*, kAlignD,  // no source C
      ElementD, LayoutD*, kAlignD,
      typename Schedule::EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, ElementAcc, void, ElementAcc>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, GmemLayoutA, kAlignA,
      ElementB, GmemLayoutB, kAlignB, ElementAcc, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Schedule::KernelSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop,
                                                      CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

}  // namespace megamoe::gemm

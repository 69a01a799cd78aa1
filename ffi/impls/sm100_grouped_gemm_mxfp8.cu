// MXFP8 grouped GEMM for Blackwell (sm_100a): e4m3 operands with E8M0 scales per 32 elements of
// K (OCP MX), CUTLASS's ptr-array block-scaled tcgen05 kernel, bf16 out, fp32 accumulation, run
// by the grouped-GEMM runner (gemm/grouped_gemm_runner.cuh).
// COMPILED ONLY: there is no Blackwell GPU on this project's machines, so this instantiation has
// never run; recipe "mxfp8" is served by the reference emulation (jax_megamoe.fp8) and
// backends.cuda reports it unavailable. Not wired to an FFI handler: the quantisation into
// CUTLASS's interleaved scale-factor layout (Sm1xxBlkScaledConfig) and the prepare kernel that
// writes each group's arguments are not written yet.
// Interface (no header yet, nothing calls it): GroupedGemmMxfp8Sm100WorkspaceBytes and
// RunGroupedGemmMxfp8Sm100 below.
#ifndef NDEBUG
#define NDEBUG
#endif
#include <cstdint>
#include <string>

#include <cuda_runtime.h>

#include "cutlass/arch/config.h"
#include "cutlass/cutlass.h"

#if defined(CUTLASS_ARCH_MMA_SM100_SUPPORTED)
#include "cute/tensor.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "ffi/gemm/grouped_gemm_runner.cuh"

namespace megamoe::grouped::sm100 {

using namespace cute;

// The traits of the instance (gemm/grouped_gemm_runner.cuh).
struct Mxfp8Gemm {
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  using ElementA = cutlass::mx_float8_t<cutlass::float_e4m3_t>;
  using ElementB = cutlass::mx_float8_t<cutlass::float_e4m3_t>;
  using ElementD = cutlass::bfloat16_t;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = cutlass::layout::RowMajor;
  using MmaTileShape = Shape<_128, _128, _128>;
  using ClusterShape = Shape<_1, _1, _1>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm100, cutlass::arch::OpClassTensorOp, MmaTileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, 8, ElementD,
      LayoutD*, 8, cutlass::epilogue::PtrArrayTmaWarpSpecialized1Sm>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm100, cutlass::arch::OpClassBlockScaledTensorOp, ElementA, LayoutA*, 16,
      ElementB, LayoutB*, 16, float, MmaTileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecialized1SmMxf8f6f4Sm100>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop,
                                                      CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static constexpr bool kBlockScaled = true;
  static constexpr const char* kName = "MXFP8 grouped GEMM";
  using ElementSF = typename Kernel::ElementSF;
  using ScaleConfig = typename CollectiveMainloop::Sm1xxBlkScaledConfig;
  using LayoutSFA = typename CollectiveMainloop::InternalLayoutSFA;
  using LayoutSFB = typename CollectiveMainloop::InternalLayoutSFB;
};

}  // namespace megamoe::grouped::sm100

namespace megamoe::grouped {

// Bytes of workspace: the per-group argument arrays (gemm::GroupArgsLayout<sm100::Mxfp8Gemm>),
// then CUTLASS's workspace.
size_t GroupedGemmMxfp8Sm100WorkspaceBytes(int num_groups, int sm_count) {
  return gemm::WorkspaceBytes<sm100::Mxfp8Gemm>(num_groups, sm_count);
}

// One enqueue of the sm_100a kernel on argument arrays the caller has written into the
// workspace on the device beforehand (gemm::GroupArgs<sm100::Mxfp8Gemm>: Set and SetScales per
// group). Returns "" or what failed.
std::string RunGroupedGemmMxfp8Sm100(int num_groups, void* workspace, size_t workspace_bytes,
                                     int sm_count, cudaStream_t stream) {
  auto written_by_the_caller = [](const gemm::GroupArgs<sm100::Mxfp8Gemm>&, cudaStream_t) {};
  return gemm::Run<sm100::Mxfp8Gemm>(num_groups, written_by_the_caller, workspace,
                                     workspace_bytes, sm_count, stream);
}

}  // namespace megamoe::grouped
#endif  // CUTLASS_ARCH_MMA_SM100_SUPPORTED

// MXFP8 grouped GEMM for Blackwell (sm_100a): e4m3 operands with E8M0 scales per 32 elements of
// K (OCP MX), CUTLASS's ptr-array block-scaled tcgen05 kernel, bf16 out, fp32 accumulation.
// COMPILED ONLY: there is no Blackwell GPU on this project's machines, so this instantiation has
// never run; recipe "mxfp8" is served by the reference emulation (jax_megamoe.fp8) and
// backends.cuda reports it unavailable. Not wired to an FFI handler: the quantisation into
// CUTLASS's interleaved scale-factor layout (Sm1xxBlkScaledConfig) is not written yet.
// Interface (no header yet, nothing calls it): RunGroupedGemmMxfp8Sm100 below.
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

namespace megamoe::grouped::sm100 {

using namespace cute;

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
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using LayoutSFA = typename Kernel::CollectiveMainloop::InternalLayoutSFA;
  using LayoutSFB = typename Kernel::CollectiveMainloop::InternalLayoutSFB;
  using ElementSF = typename Kernel::ElementSF;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
};

}  // namespace megamoe::grouped::sm100

namespace megamoe::grouped {

// Per-group argument arrays (device pointers, filled by the caller on the device) and one
// enqueue of the sm_100a kernel. Returns "" or what failed.
std::string RunGroupedGemmMxfp8Sm100(
    int num_groups, sm100::Mxfp8Gemm::Shape3* shapes,
    const typename sm100::Mxfp8Gemm::Kernel::ElementA** ptr_a, sm100::Mxfp8Gemm::StrideA* stride_a,
    const typename sm100::Mxfp8Gemm::Kernel::ElementB** ptr_b, sm100::Mxfp8Gemm::StrideB* stride_b,
    const sm100::Mxfp8Gemm::ElementSF** ptr_sfa, sm100::Mxfp8Gemm::LayoutSFA* layout_sfa,
    const sm100::Mxfp8Gemm::ElementSF** ptr_sfb, sm100::Mxfp8Gemm::LayoutSFB* layout_sfb,
    cutlass::bfloat16_t** ptr_d, sm100::Mxfp8Gemm::StrideD* stride_d, void* workspace,
    size_t workspace_bytes, int sm_count, cudaStream_t stream) {
  using G = sm100::Mxfp8Gemm;
  cutlass::KernelHardwareInfo hw;
  cudaGetDevice(&hw.device_id);
  hw.sm_count = sm_count;
  typename G::Gemm::Arguments args;
  decltype(args.epilogue.thread) fusion;
  fusion.alpha = 1.0f;
  fusion.beta = 0.0f;
  args = typename G::Gemm::Arguments{cutlass::gemm::GemmUniversalMode::kGrouped,
                                     {num_groups, shapes, nullptr},
                                     {ptr_a, stride_a, ptr_b, stride_b, ptr_sfa, layout_sfa,
                                      ptr_sfb, layout_sfb},
                                     {fusion, nullptr, stride_d, ptr_d, stride_d},
                                     hw};
  if (G::Gemm::get_workspace_size(args) > workspace_bytes) return "MXFP8 workspace too small";
  G::Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return "MXFP8: cannot implement";
  if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) {
    return "MXFP8: initialize failed";
  }
  if (gemm.run(stream) != cutlass::Status::kSuccess) return "MXFP8: run failed";
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? std::string() : std::string(cudaGetErrorString(err));
}

}  // namespace megamoe::grouped
#endif  // CUTLASS_ARCH_MMA_SM100_SUPPORTED

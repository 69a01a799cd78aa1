// XLA FFI handlers (CUDA) of the grouped SwiGLU MLP: bind, validate, enqueue the kernels.
// Every buffer comes from XLA (scratch included, as the `workspace` result): no allocation, no
// host synchronisation, group sizes never leave the device.
#include <cuda_runtime.h>

#include "ffi/common/checks.h"
#include "ffi/common/device_info.h"
#include "ffi/gemm/grouped_gemm.h"
#include "ffi/handlers/grouped_mlp_op.h"
#include "ffi/handlers/scratch.h"
#include "ffi/heuristics/moe_dgrad_core.h"
#include "ffi/impls/grouped_swiglu.h"
#include "ffi/impls/moe_dgrad.h"
#include "ffi/impls/grouped_zero_fill.h"
#include "ffi/registry.h"
#include "ffi/scheduler/group_offsets.h"

namespace megamoe::grouped {
namespace {

int SmCount() { return CurrentDeviceSmCount(); }

// Scratch: group offsets, then one grouped GEMM's scratch (the GEMMs run one after another on
// the stream and reuse it).
ScratchNeed MlpScratchNeed(int64_t e, int sm_count) {
  return {e + 1, GroupedGemmMaxWorkspaceBytes(int(e), sm_count)};
}

ffi::Error CheckCudaDims(const MlpDims& d) {
  if (d.dtype != ffi::DataType::BF16) {
    return InvalidArgument("x_sorted has dtype ", DataTypeName(d.dtype),
                           "; the CUDA grouped MLP takes bfloat16 (float32 runs the reference)");
  }
  if (d.h % 8 != 0) return InvalidArgument("hidden size H=", d.h, " must be a multiple of 8");
  if (d.f % 8 != 0) return InvalidArgument("ffn size F=", d.f, " must be a multiple of 8");
  if (d.e > 65535) return InvalidArgument("E=", d.e, " local experts, at most 65535");
  return ffi::Error::Success();
}

ffi::Error GroupedMlpFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer group_sizes,
                             ffi::AnyBuffer w_gate_up, ffi::AnyBuffer w_down,
                             ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> gate_up,
                             ffi::Result<ffi::AnyBuffer> h, ffi::Result<ffi::AnyBuffer> workspace) {
  MlpDims d;
  MEGAMOE_RETURN_IF_ERROR(ReadMlpDims(x, group_sizes, w_gate_up, w_down, &d));
  MEGAMOE_RETURN_IF_ERROR(CheckCudaDims(d));
  MEGAMOE_RETURN_IF_ERROR(CheckMlpFwdResults(d, y, gate_up, h));
  Scratch ws;
  MEGAMOE_RETURN_IF_ERROR(SplitScratch(workspace, MlpScratchNeed(d.e, SmCount()), &ws));
  const int e = int(d.e), sm = SmCount();
  if (d.n == 0) return ffi::Error::Success();

  MEGAMOE_RETURN_IF_KERNEL_ERROR(GroupOffsets(
      static_cast<const int32_t*>(group_sizes.untyped_data()), e, d.n, ws.offsets, stream));
  GroupedGemmProblem l1{GemmKind::kFprop, e, ws.offsets, x.untyped_data(),
                        w_gate_up.untyped_data(), gate_up->untyped_data(), 0, 2 * d.f, d.h};
  MEGAMOE_RETURN_IF_KERNEL_ERROR(RunGroupedGemm(l1, ws.gemm, ws.gemm_bytes, sm, stream));
  MEGAMOE_RETURN_IF_KERNEL_ERROR(SwigluForward(gate_up->untyped_data(), h->untyped_data(), d.n,
                                               d.f, ws.offsets, e, stream));
  GroupedGemmProblem l2{GemmKind::kFprop, e, ws.offsets, h->untyped_data(),
                        w_down.untyped_data(), y->untyped_data(), 0, d.h, d.f};
  MEGAMOE_RETURN_IF_KERNEL_ERROR(RunGroupedGemm(l2, ws.gemm, ws.gemm_bytes, sm, stream));
  MEGAMOE_RETURN_IF_KERNEL_ERROR(
      ZeroPaddingRows(y->untyped_data(), d.n, d.h, ws.offsets, e, stream));
  return ffi::Error::Success();
}

ffi::Error GroupedMlpBwdImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                             ffi::AnyBuffer group_sizes, ffi::AnyBuffer w_gate_up,
                             ffi::AnyBuffer w_down, ffi::AnyBuffer gate_up, ffi::AnyBuffer h,
                             ffi::Result<ffi::AnyBuffer> dx,
                             ffi::Result<ffi::AnyBuffer> dw_gate_up,
                             ffi::Result<ffi::AnyBuffer> dw_down,
                             ffi::Result<ffi::AnyBuffer> dgate_up, ffi::Result<ffi::AnyBuffer> dh,
                             ffi::Result<ffi::AnyBuffer> workspace) {
  MlpDims d;
  MEGAMOE_RETURN_IF_ERROR(ReadMlpDims(x, group_sizes, w_gate_up, w_down, &d));
  MEGAMOE_RETURN_IF_ERROR(CheckCudaDims(d));
  MEGAMOE_RETURN_IF_ERROR(
      CheckMlpBwdOperands(d, dy, gate_up, h, dx, dw_gate_up, dw_down, dgate_up, dh));
  bool dgrad_core = false;
  if (std::string err = heuristics::UseMoeDgradCore(
          MoeDgradUnsupportedReason(d.h, d.f, d.e).empty(), d.h, d.f, &dgrad_core);
      !err.empty())
    return InvalidArgument(err);
  Scratch ws;
  MEGAMOE_RETURN_IF_ERROR(SplitScratch(workspace, MlpScratchNeed(d.e, SmCount()), &ws));
  const int e = int(d.e), sm = SmCount();

  MEGAMOE_RETURN_IF_KERNEL_ERROR(GroupOffsets(
      static_cast<const int32_t*>(group_sizes.untyped_data()), e, d.n, ws.offsets, stream));
  if (d.n > 0) {
    if (dgrad_core) {
      // dh + SwiGLU backward -> dgate_up, then dx, on the tile engine's dgrad core (dh itself
      // is not stored: its result buffer stays scratch).
      const MoeDgradProblem core{dy.untyped_data(),        gate_up.untyped_data(),
                                 w_gate_up.untyped_data(), w_down.untyped_data(),
                                 ws.offsets,               d.n,
                                 d.h,                      d.f,
                                 e,                        dgate_up->untyped_data(),
                                 dx->untyped_data()};
      MEGAMOE_RETURN_IF_KERNEL_ERROR(MoeDgradSm90(core, stream));
    } else {
      // dh = dy @ w_down^T (per group), then the SwiGLU backward into dgate_up.
      GroupedGemmProblem l2d{GemmKind::kDgrad, e, ws.offsets, dy.untyped_data(),
                             w_down.untyped_data(), dh->untyped_data(), 0, d.f, d.h};
      MEGAMOE_RETURN_IF_KERNEL_ERROR(RunGroupedGemm(l2d, ws.gemm, ws.gemm_bytes, sm, stream));
      MEGAMOE_RETURN_IF_KERNEL_ERROR(SwigluBackward(dh->untyped_data(), gate_up.untyped_data(),
                                                    dgate_up->untyped_data(), d.n, d.f,
                                                    ws.offsets, e, stream));
      // dx = dgate_up @ w_gate_up^T.
      GroupedGemmProblem l1d{GemmKind::kDgrad, e, ws.offsets, dgate_up->untyped_data(),
                             w_gate_up.untyped_data(), dx->untyped_data(), 0, d.h, 2 * d.f};
      MEGAMOE_RETURN_IF_KERNEL_ERROR(RunGroupedGemm(l1d, ws.gemm, ws.gemm_bytes, sm, stream));
    }
    MEGAMOE_RETURN_IF_KERNEL_ERROR(
        ZeroPaddingRows(dx->untyped_data(), d.n, d.h, ws.offsets, e, stream));
    // dw_down[g] = h_g^T dy_g, dw_gate_up[g] = x_g^T dgate_up_g (K-grouped, fp32 accumulation).
    GroupedGemmProblem l2w{GemmKind::kWgrad, e, ws.offsets, h.untyped_data(), dy.untyped_data(),
                           dw_down->untyped_data(), d.f, d.h, 0};
    MEGAMOE_RETURN_IF_KERNEL_ERROR(RunGroupedGemm(l2w, ws.gemm, ws.gemm_bytes, sm, stream));
    GroupedGemmProblem l1w{GemmKind::kWgrad, e, ws.offsets, x.untyped_data(),
                           dgate_up->untyped_data(), dw_gate_up->untyped_data(), d.h, 2 * d.f, 0};
    MEGAMOE_RETURN_IF_KERNEL_ERROR(RunGroupedGemm(l1w, ws.gemm, ws.gemm_bytes, sm, stream));
  }
  MEGAMOE_RETURN_IF_KERNEL_ERROR(
      ZeroEmptyGroups(dw_down->untyped_data(), d.f * d.h, ws.offsets, e, stream));
  MEGAMOE_RETURN_IF_KERNEL_ERROR(
      ZeroEmptyGroups(dw_gate_up->untyped_data(), d.h * 2 * d.f, ws.offsets, e, stream));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedMlpFwdCuda, GroupedMlpFwdImpl,
                              BindGroupedMlpFwd(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedMlpBwdCuda, GroupedMlpBwdImpl,
                              BindGroupedMlpBwd(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

MEGAMOE_REGISTER_FFI_WITH_SCRATCH("megamoe_grouped_mlp_fwd", "CUDA", GroupedMlpFwdCuda,
                                  CudaScratchBytes<MlpScratchNeed>);
MEGAMOE_REGISTER_FFI_WITH_SCRATCH("megamoe_grouped_mlp_bwd", "CUDA", GroupedMlpBwdCuda,
                                  CudaScratchBytes<MlpScratchNeed>);

}  // namespace megamoe::grouped

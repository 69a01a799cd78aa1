// XLA FFI handler (CUDA) of the router's "balance" offsets; contract and checks:
// balance_offsets_ops.h, kernel: ffi/impls/balance_offsets.cu, CPU twin: balance_offsets_cpu.cc.
#include <cuda_runtime.h>

#include "ffi/common/checks.h"
#include "ffi/handlers/balance_offsets_ops.h"
#include "ffi/handlers/scratch.h"
#include "ffi/impls/balance_offsets.h"
#include "ffi/registry.h"

namespace megamoe::router {
namespace {

// The scratch: no group offsets, the kernel's column partials in the "GEMM" part.
ScratchNeed BalanceScratchNeed(int64_t experts, int sm_count) {
  return {0, BalanceScratchBytes(experts, sm_count)};
}

ffi::Error BalanceOffsetsImpl(cudaStream_t stream, ffi::AnyBuffer z,
                              ffi::Result<ffi::AnyBuffer> offsets,
                              ffi::Result<ffi::AnyBuffer> workspace, int64_t top_k,
                              float temperature, int64_t sinkhorn_iterations, int64_t load_steps,
                              float step_first, float step_decay) {
  int64_t rows, experts;
  BalanceSettings settings;
  MEGAMOE_RETURN_IF_ERROR(CheckBalanceOffsets(z, offsets, top_k, temperature,
                                              sinkhorn_iterations, load_steps, step_first,
                                              step_decay, &rows, &experts, &settings));
  Scratch ws;
  MEGAMOE_RETURN_IF_ERROR(
      SplitScratch(workspace, BalanceScratchNeed(experts, CurrentDeviceSmCount()), &ws));
  MEGAMOE_RETURN_IF_KERNEL_ERROR(BalanceOffsets(
      static_cast<const float*>(z.untyped_data()), rows, experts, settings,
      static_cast<float*>(offsets->untyped_data()), ws.gemm, ws.gemm_bytes, stream));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    BalanceOffsetsCuda, BalanceOffsetsImpl,
    BindBalanceOffsets(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});

MEGAMOE_REGISTER_FFI_WITH_SCRATCH("megamoe_balance_offsets", "CUDA", BalanceOffsetsCuda,
                                  CudaScratchBytes<BalanceScratchNeed>);

}  // namespace megamoe::router

// XLA FFI handler (CUDA) of the LM head's cross-entropy with its gradient; contract and checks:
// cross_entropy_ops.h, kernel: ffi/impls/cross_entropy_grad.cu, CPU twin: cross_entropy_cpu.cc.
#include <cuda_runtime.h>

#include "ffi/common/checks.h"
#include "ffi/handlers/cross_entropy_ops.h"
#include "ffi/impls/cross_entropy_grad.h"
#include "ffi/registry.h"

namespace megamoe::xent {
namespace {

ffi::Error CrossEntropyGradImpl(cudaStream_t stream, ffi::AnyBuffer logits,
                                ffi::AnyBuffer targets, ffi::Result<ffi::AnyBuffer> d_logits,
                                ffi::Result<ffi::AnyBuffer> row_loss, int64_t count) {
  int64_t rows, vocab;
  MEGAMOE_RETURN_IF_ERROR(
      CheckCrossEntropyGrad(logits, targets, d_logits, row_loss, count, &rows, &vocab));
  MEGAMOE_RETURN_IF_KERNEL_ERROR(CrossEntropyGrad(
      static_cast<const float*>(logits.untyped_data()),
      static_cast<const int32_t*>(targets.untyped_data()), rows, vocab, count,
      d_logits->untyped_data(), static_cast<float*>(row_loss->untyped_data()), stream));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    CrossEntropyGradCuda, CrossEntropyGradImpl,
    BindCrossEntropyGrad(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});

MEGAMOE_REGISTER_FFI("megamoe_cross_entropy_grad", "CUDA", CrossEntropyGradCuda);

}  // namespace megamoe::xent

// The LM head's cross-entropy op: contract, XLA binding and validation, shared by its CUDA
// handler (cross_entropy.cu) and CPU handler (cross_entropy_cpu.cc).
//   megamoe_cross_entropy_grad  logits [N, V] f32, targets [N] int32 ->
//                               d_logits [N, V] bf16, row_loss [N] f32; attribute count >= 1
// As ffi/impls/cross_entropy_grad.h: row_loss = lse - logits[target] (NaN for a target outside
// [0, V)), d_logits = (softmax - one_hot(target)) / count.
#pragma once

#include <cstdint>
#include <utility>

#include "ffi/common/checks.h"

namespace megamoe::xent {

inline ffi::Error CheckCrossEntropyGrad(const ffi::AnyBuffer& logits,
                                        const ffi::AnyBuffer& targets,
                                        ffi::Result<ffi::AnyBuffer>& d_logits,
                                        ffi::Result<ffi::AnyBuffer>& row_loss, int64_t count,
                                        int64_t* rows, int64_t* vocab) {
  MEGAMOE_RETURN_IF_ERROR(ExpectDtype("logits", logits.element_type(), ffi::DataType::F32));
  MEGAMOE_RETURN_IF_ERROR(ExpectDtype("targets", targets.element_type(), ffi::DataType::S32));
  auto ld = logits.dimensions();
  if (ld.size() != 2 || ld[1] < 1) {
    return InvalidArgument("logits must be [N, V] with V >= 1, got ", ShapeString(ld));
  }
  *rows = ld[0];
  *vocab = ld[1];
  if (count < 1) return InvalidArgument("count must be >= 1, got ", count);
  MEGAMOE_RETURN_IF_ERROR(ExpectShape("targets", targets.dimensions(), {*rows}));
  MEGAMOE_RETURN_IF_ERROR(ExpectDtype("d_logits", d_logits->element_type(), ffi::DataType::BF16));
  MEGAMOE_RETURN_IF_ERROR(ExpectShape("d_logits", d_logits->dimensions(), {*rows, *vocab}));
  MEGAMOE_RETURN_IF_ERROR(ExpectDtype("row_loss", row_loss->element_type(), ffi::DataType::F32));
  return ExpectShape("row_loss", row_loss->dimensions(), {*rows});
}

template <class Binding>
auto BindCrossEntropyGrad(Binding&& b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()  // logits
      .template Arg<ffi::AnyBuffer>()                 // targets
      .template Ret<ffi::AnyBuffer>()                 // d_logits
      .template Ret<ffi::AnyBuffer>()                 // row_loss
      .template Attr<int64_t>("count");
}

}  // namespace megamoe::xent

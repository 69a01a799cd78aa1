// XLA FFI handler (CPU) of the LM head's cross-entropy with its gradient: the contract of
// cross_entropy_ops.h in plain loops (libm exp; the kernel uses the SFU's, within the tests'
// tolerances), so that CI runs losses.py's kernel path end to end.
#include <cmath>
#include <cstdint>
#include <limits>

#include "ffi/common/checks.h"
#include "ffi/common/host_numerics.h"
#include "ffi/handlers/cross_entropy_ops.h"
#include "ffi/registry.h"

namespace megamoe::xent {
namespace {

ffi::Error CrossEntropyGradImpl(ffi::AnyBuffer logits, ffi::AnyBuffer targets,
                                ffi::Result<ffi::AnyBuffer> d_logits,
                                ffi::Result<ffi::AnyBuffer> row_loss, int64_t count) {
  int64_t rows, vocab;
  MEGAMOE_RETURN_IF_ERROR(
      CheckCrossEntropyGrad(logits, targets, d_logits, row_loss, count, &rows, &vocab));
  const float* x = static_cast<const float*>(logits.untyped_data());
  const int32_t* t = static_cast<const int32_t*>(targets.untyped_data());
  uint16_t* d = static_cast<uint16_t*>(d_logits->untyped_data());
  float* loss = static_cast<float*>(row_loss->untyped_data());
  const float inv_count = 1.0f / float(count);
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * vocab;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t v = 0; v < vocab; ++v) m = std::fmax(m, row[v]);
    float s = 0.0f;  // maxima count 1 unscaled (losses._logsumexp's rule for +-inf)
    for (int64_t v = 0; v < vocab; ++v) s += row[v] == m ? 1.0f : std::exp(row[v] - m);
    const float lse = m + std::log(s);
    for (int64_t v = 0; v < vocab; ++v) {
      const float one_hot = v == t[r] ? 1.0f : 0.0f;
      d[r * vocab + v] = host::FloatToBf16((std::exp(row[v] - lse) - one_hot) * inv_count);
    }
    loss[r] = t[r] >= 0 && t[r] < vocab ? lse - row[t[r]]
                                        : std::numeric_limits<float>::quiet_NaN();
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CrossEntropyGradCpu, CrossEntropyGradImpl,
                              BindCrossEntropyGrad(ffi::Ffi::Bind()));

MEGAMOE_REGISTER_FFI("megamoe_cross_entropy_grad", "cpu", CrossEntropyGradCpu);

}  // namespace megamoe::xent

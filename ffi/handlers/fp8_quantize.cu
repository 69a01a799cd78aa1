// XLA FFI handlers (CUDA) of the blockwise-FP8 quantisers (recipe "fp8", jax_megamoe/fp8.py):
//   megamoe_fp8_quantize_rows     x [N, K] bf16 -> q [N, K] e4m3, scale [N, K/128] f32
//                                 (1x128 blocks along K: activations, token rows)
//   megamoe_fp8_quantize_weights  w [E, K, P] bf16 -> q [E, P, K] e4m3 (transposed, K-major),
//                                 scale [E, K/128, P/128] f32 (128x128 blocks)
// Attribute pow2 (0/1): scales rounded up to powers of two ("fp8_pow2").
#include <cuda_runtime.h>

#include "ffi/common/checks.h"
#include "ffi/handlers/grouped_mlp_args.h"
#include "ffi/kernels/grouped_fp8.h"
#include "ffi/registry.h"

namespace megamoe::grouped {
namespace {

ffi::Error CheckQuantOutputs(ffi::Result<ffi::AnyBuffer>& q, ffi::Result<ffi::AnyBuffer>& scale,
                             std::initializer_list<int64_t> q_dims,
                             std::initializer_list<int64_t> scale_dims) {
  MEGAMOE_RETURN_IF_ERROR(ExpectDtype("q", q->element_type(), ffi::DataType::F8E4M3FN));
  MEGAMOE_RETURN_IF_ERROR(ExpectDtype("scale", scale->element_type(), ffi::DataType::F32));
  MEGAMOE_RETURN_IF_ERROR(ExpectShape("q", q->dimensions(), q_dims));
  return ExpectShape("scale", scale->dimensions(), scale_dims);
}

ffi::Error QuantizeRowsImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q,
                            ffi::Result<ffi::AnyBuffer> scale, int64_t pow2) {
  MEGAMOE_RETURN_IF_ERROR(ExpectDtype("x", x.element_type(), ffi::DataType::BF16));
  auto xd = x.dimensions();
  if (xd.size() != 2) return InvalidArgument("x must be [N, K], got ", ShapeString(xd));
  const int64_t n = xd[0], k = xd[1];
  if (k % 128 != 0) return InvalidArgument("FP8 rows need K % 128 == 0, got K=", k);
  MEGAMOE_RETURN_IF_ERROR(CheckQuantOutputs(q, scale, {n, k}, {n, k / 128}));
  std::string err = QuantizeActivations1x128(x.untyped_data(), n, k, pow2 != 0, q->untyped_data(),
                                             static_cast<float*>(scale->untyped_data()), stream);
  if (!err.empty()) return Internal(err);
  return ffi::Error::Success();
}

ffi::Error QuantizeWeightsImpl(cudaStream_t stream, ffi::AnyBuffer w,
                               ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> scale,
                               int64_t pow2) {
  MEGAMOE_RETURN_IF_ERROR(ExpectDtype("w", w.element_type(), ffi::DataType::BF16));
  auto wd = w.dimensions();
  if (wd.size() != 3) return InvalidArgument("w must be [E, K, P], got ", ShapeString(wd));
  const int64_t e = wd[0], k = wd[1], p = wd[2];
  if (k % 128 != 0 || p % 128 != 0) {
    return InvalidArgument("FP8 weights need K and P multiples of 128, got w ", ShapeString(wd));
  }
  MEGAMOE_RETURN_IF_ERROR(CheckQuantOutputs(q, scale, {e, p, k}, {e, k / 128, p / 128}));
  std::string err = QuantizeWeights128x128(w.untyped_data(), e, k, p, pow2 != 0,
                                           q->untyped_data(),
                                           static_cast<float*>(scale->untyped_data()), stream);
  if (!err.empty()) return Internal(err);
  return ffi::Error::Success();
}

}  // namespace

#define MEGAMOE_QUANT_BINDING(impl)                          \
  ffi::Ffi::Bind()                                           \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()              \
      .Arg<ffi::AnyBuffer>()                                 \
      .Ret<ffi::AnyBuffer>()                                 \
      .Ret<ffi::AnyBuffer>()                                 \
      .Attr<int64_t>("pow2")

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8QuantizeRowsCuda, QuantizeRowsImpl,
                              MEGAMOE_QUANT_BINDING(QuantizeRowsImpl),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8QuantizeWeightsCuda, QuantizeWeightsImpl,
                              MEGAMOE_QUANT_BINDING(QuantizeWeightsImpl),
                              {ffi::Traits::kCmdBufferCompatible});
#undef MEGAMOE_QUANT_BINDING

MEGAMOE_REGISTER_FFI("megamoe_fp8_quantize_rows", "CUDA", Fp8QuantizeRowsCuda);
MEGAMOE_REGISTER_FFI("megamoe_fp8_quantize_weights", "CUDA", Fp8QuantizeWeightsCuda);

}  // namespace megamoe::grouped

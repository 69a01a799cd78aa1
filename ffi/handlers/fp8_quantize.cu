// XLA FFI handlers (CUDA) of the blockwise-FP8 quantisers (recipe "fp8", jax_megamoe/fp8.py):
//   megamoe_fp8_quantize_rows     x [N, K] bf16 -> q [N, K] e4m3, scale [N, K/128] f32
//                                 (1x128 blocks along K: activations, token rows)
//   megamoe_fp8_quantize_weights  w [E, K, P] bf16 -> q [E, P, K] e4m3 (transposed, K-major),
//                                 scale [E, K/128, P/128] f32 (128x128 blocks)
//   megamoe_fp8_swiglu_quantize   gate_up [N, 2F] bf16, group_sizes [E] int32 -> h [N, F] bf16
//                                 (silu(gate) * up; rows past sum(group_sizes) zero), h_q [N, F]
//                                 e4m3 and h_scale [N, F/128] f32 (1x128; rows past the sum
//                                 unwritten), workspace u8[W] (group offsets)
// Attribute pow2 (0/1): scales rounded up to powers of two ("fp8_pow2").
#include <cuda_runtime.h>

#include "ffi/common/checks.h"
#include "ffi/handlers/grouped_mlp_args.h"
#include "ffi/kernels/grouped_fp8.h"
#include "ffi/kernels/grouped_swiglu.h"
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

ffi::Error SwigluQuantizeImpl(cudaStream_t stream, ffi::AnyBuffer gate_up,
                              ffi::AnyBuffer group_sizes, ffi::Result<ffi::AnyBuffer> h,
                              ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> scale,
                              ffi::Result<ffi::AnyBuffer> workspace, int64_t pow2) {
  MEGAMOE_RETURN_IF_ERROR(ExpectDtype("gate_up", gate_up.element_type(), ffi::DataType::BF16));
  MEGAMOE_RETURN_IF_ERROR(ExpectDtype("group_sizes", group_sizes.element_type(), ffi::DataType::S32));
  auto gd = gate_up.dimensions(), sd = group_sizes.dimensions();
  if (gd.size() != 2 || gd[1] % 256 != 0) {
    return InvalidArgument("gate_up must be [N, 2F] with F a multiple of 128, got ",
                           ShapeString(gd));
  }
  if (sd.size() != 1 || sd[0] < 1) {
    return InvalidArgument("group_sizes must be [E] with E >= 1, got ", ShapeString(sd));
  }
  const int64_t n = gd[0], f = gd[1] / 2, e = sd[0];
  if (n > INT32_MAX) return InvalidArgument("gate_up has ", n, " rows, more than 2^31-1");
  MEGAMOE_RETURN_IF_ERROR(ExpectDtype("h", h->element_type(), ffi::DataType::BF16));
  MEGAMOE_RETURN_IF_ERROR(ExpectShape("h", h->dimensions(), {n, f}));
  MEGAMOE_RETURN_IF_ERROR(CheckQuantOutputs(q, scale, {n, f}, {n, f / 128}));
  if (workspace->size_bytes() < size_t(e + 1) * 4) {
    return InvalidArgument("workspace must hold ", e + 1, " int32 offsets, got ",
                           workspace->size_bytes(), " bytes");
  }
  int32_t* offsets = static_cast<int32_t*>(workspace->untyped_data());
  std::string err = GroupOffsets(static_cast<const int32_t*>(group_sizes.untyped_data()), int(e),
                                 n, offsets, stream);
  if (err.empty()) {
    err = SwigluQuantize1x128(gate_up.untyped_data(), h->untyped_data(), n, f, offsets, int(e),
                              pow2 != 0, q->untyped_data(),
                              static_cast<float*>(scale->untyped_data()), stream);
  }
  if (!err.empty()) return Internal(err);
  return ffi::Error::Success();
}

}  // namespace

// x -> (q, scale), attribute pow2: the binding of both quantisers.
#define MEGAMOE_QUANT_BINDING                                \
  ffi::Ffi::Bind()                                           \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()              \
      .Arg<ffi::AnyBuffer>()                                 \
      .Ret<ffi::AnyBuffer>()                                 \
      .Ret<ffi::AnyBuffer>()                                 \
      .Attr<int64_t>("pow2")

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8QuantizeRowsCuda, QuantizeRowsImpl,
                              MEGAMOE_QUANT_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8QuantizeWeightsCuda, QuantizeWeightsImpl,
                              MEGAMOE_QUANT_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8SwigluQuantizeCuda, SwigluQuantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // gate_up
                                  .Arg<ffi::AnyBuffer>()  // group_sizes
                                  .Ret<ffi::AnyBuffer>()  // h
                                  .Ret<ffi::AnyBuffer>()  // h_q
                                  .Ret<ffi::AnyBuffer>()  // h_scale
                                  .Ret<ffi::AnyBuffer>()  // workspace
                                  .Attr<int64_t>("pow2"),
                              {ffi::Traits::kCmdBufferCompatible});
#undef MEGAMOE_QUANT_BINDING

MEGAMOE_REGISTER_FFI("megamoe_fp8_quantize_rows", "CUDA", Fp8QuantizeRowsCuda);
MEGAMOE_REGISTER_FFI("megamoe_fp8_quantize_weights", "CUDA", Fp8QuantizeWeightsCuda);
MEGAMOE_REGISTER_FFI("megamoe_fp8_swiglu_quantize", "CUDA", Fp8SwigluQuantizeCuda);

}  // namespace megamoe::grouped

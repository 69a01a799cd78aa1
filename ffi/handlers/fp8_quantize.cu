// XLA FFI handlers (CUDA) of the blockwise-FP8 quantisers (recipe "fp8", jax_megamoe/fp8.py):
// Contracts and checks: fp8_args.h; CPU twins: fp8_cpu.cc.
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
#include "ffi/handlers/fp8_args.h"
#include "ffi/kernels/grouped_fp8.h"
#include "ffi/kernels/grouped_swiglu.h"
#include "ffi/registry.h"

namespace megamoe::grouped {
namespace {

ffi::Error QuantizeRowsImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q,
                            ffi::Result<ffi::AnyBuffer> scale, int64_t pow2) {
  int64_t n, k;
  MEGAMOE_RETURN_IF_ERROR(CheckQuantizeRows(x, q, scale, &n, &k));
  std::string err = QuantizeActivations1x128(x.untyped_data(), n, k, pow2 != 0, q->untyped_data(),
                                             static_cast<float*>(scale->untyped_data()), stream);
  if (!err.empty()) return Internal(err);
  return ffi::Error::Success();
}

ffi::Error QuantizeWeightsImpl(cudaStream_t stream, ffi::AnyBuffer w,
                               ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> scale,
                               int64_t pow2) {
  int64_t e, k, p;
  MEGAMOE_RETURN_IF_ERROR(CheckQuantizeWeights(w, q, scale, &e, &k, &p));
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
  int64_t n, f, e;
  MEGAMOE_RETURN_IF_ERROR(CheckSwigluQuantize(gate_up, group_sizes, h, q, scale, &n, &f, &e));
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

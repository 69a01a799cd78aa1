// XLA FFI handlers (CUDA) of the blockwise-FP8 quantisers (recipe "fp8", jax_megamoe/fp8.py):
// Contracts, checks and bindings: fp8_ops.h; CPU twins: fp8_cpu.cc.
//   megamoe_fp8_quantize_rows     x [N, K] bf16 -> q [N, K] e4m3, scale [N, K/128] f32
//                                 (1x128 blocks along K: activations, token rows)
//   megamoe_fp8_quantize_weights  w [E, K, P] bf16 -> q [E, P, K] e4m3 (transposed, K-major),
//                                 scale [E, K/128, P/128] f32 (128x128 blocks); attribute
//                                 dgrad=1: q [E, K, P], scale [E, P/128, K/128] (for dy @ w^T)
//   megamoe_fp8_swiglu_quantize   gate_up [N, 2F] bf16, group_sizes [E] int32 -> h [N, F] bf16
//                                 (silu(gate) * up; rows past sum(group_sizes) zero), h_q [N, F]
//                                 e4m3 and h_scale [N, F/128] f32 (1x128; rows past the sum
//                                 unwritten), workspace u8[W] (the group offsets)
//   megamoe_fp8_quantize_wgrad_operand  x [N, C] bf16, x_scale [0], source [0], group_sizes
//                                 [E] -> q [C, L] e4m3, scale [L/128, C] f32 (128x1 blocks
//                                 inside each group, stored transposed and group-padded;
//                                 cuda_fp8.WgradOperand), q_rows, scale_rows (attribute rows=1:
//                                 x's 1x128 rows from the same read, else [0, C], [0, C/128]),
//                                 workspace u8[W] (the group and padded offsets); the rows
//                                 gathered (source [N] int32 into x [T, C]), the SwiGLU of x =
//                                 gate_up [N, 2C] (swiglu=1), or dequantised (x e4m3 with its
//                                 1x128 x_scale)
//   megamoe_fp8_swiglu_backward_quantize  dh [N, F], gate_up [N, 2F] bf16, group_sizes [E] ->
//                                 the SwiGLU backward dgate_up [N, 2F] (never stored in bf16)
//                                 as 1x128 rows q_rows, scale_rows (rows past the sum unwritten)
//                                 and as a weight-gradient operand q, scale; workspace as above
// Attribute pow2 (0/1): scales rounded up to powers of two ("fp8_pow2").
#include <cuda_runtime.h>

#include "ffi/common/checks.h"
#include "ffi/handlers/fp8_ops.h"
#include "ffi/handlers/scratch.h"
#include "ffi/impls/fp8_quantize.h"
#include "ffi/registry.h"
#include "ffi/scheduler/group_offsets.h"

namespace megamoe::grouped {
namespace {

// Scratch: the group offsets, and with padded the padded offsets after them (no GEMM).
ScratchNeed OffsetsScratchNeed(int64_t e, int /*sm_count*/) { return {e + 1, 0}; }
ScratchNeed PaddedOffsetsScratchNeed(int64_t e, int /*sm_count*/) { return {2 * (e + 1), 0}; }

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
                               int64_t pow2, int64_t dgrad) {
  int64_t e, k, p;
  MEGAMOE_RETURN_IF_ERROR(CheckQuantizeWeights(w, q, scale, dgrad != 0, &e, &k, &p));
  std::string err = QuantizeWeights128x128(w.untyped_data(), e, k, p, pow2 != 0, dgrad != 0,
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
  Scratch ws;
  MEGAMOE_RETURN_IF_ERROR(SplitScratch(workspace, OffsetsScratchNeed(e, 0), &ws));
  const int32_t* offsets = ws.offsets;
  std::string err = GroupOffsets(static_cast<const int32_t*>(group_sizes.untyped_data()), int(e),
                                 n, ws.offsets, stream);
  if (err.empty()) {
    err = SwigluQuantize1x128(gate_up.untyped_data(), h->untyped_data(), n, f, offsets, int(e),
                              pow2 != 0, q->untyped_data(),
                              static_cast<float*>(scale->untyped_data()), stream);
  }
  if (!err.empty()) return Internal(err);
  return ffi::Error::Success();
}

// Row and padded offsets of the groups, in the workspace result.
ffi::Error PaddedOffsets(cudaStream_t stream, const ffi::AnyBuffer& group_sizes, int64_t e,
                         int64_t n, ffi::Result<ffi::AnyBuffer>& workspace, int32_t** offsets,
                         int32_t** padded) {
  Scratch ws;
  MEGAMOE_RETURN_IF_ERROR(SplitScratch(workspace, PaddedOffsetsScratchNeed(e, 0), &ws));
  *offsets = ws.offsets;
  *padded = ws.offsets + e + 1;
  std::string err = PaddedGroupOffsets(static_cast<const int32_t*>(group_sizes.untyped_data()),
                                       int(e), n, *offsets, *padded, stream);
  if (!err.empty()) return Internal(err);
  return ffi::Error::Success();
}

ffi::Error QuantizeWgradOperandImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer x_scale,
                                    ffi::AnyBuffer source, ffi::AnyBuffer group_sizes,
                                    ffi::Result<ffi::AnyBuffer> q,
                                    ffi::Result<ffi::AnyBuffer> scale,
                                    ffi::Result<ffi::AnyBuffer> q_rows,
                                    ffi::Result<ffi::AnyBuffer> scale_rows,
                                    ffi::Result<ffi::AnyBuffer> workspace, int64_t pow2,
                                    int64_t rows, int64_t swiglu) {
  WgradRowsSource operand;
  int64_t n, c, e, length;
  MEGAMOE_RETURN_IF_ERROR(CheckQuantizeWgradOperand(x, x_scale, source, group_sizes, swiglu != 0,
                                                    rows != 0, q, scale, q_rows, scale_rows,
                                                    &operand, &n, &c, &e, &length));
  int32_t *offsets, *padded;
  MEGAMOE_RETURN_IF_ERROR(PaddedOffsets(stream, group_sizes, e, n, workspace, &offsets, &padded));
  std::string err = QuantizeWgradOperand128x1(
      operand, c, offsets, padded, int(e), length, pow2 != 0, q->untyped_data(),
      static_cast<float*>(scale->untyped_data()), rows != 0 ? q_rows->untyped_data() : nullptr,
      static_cast<float*>(scale_rows->untyped_data()), stream);
  if (!err.empty()) return Internal(err);
  return ffi::Error::Success();
}

ffi::Error SwigluBackwardQuantizeImpl(cudaStream_t stream, ffi::AnyBuffer dh,
                                      ffi::AnyBuffer gate_up, ffi::AnyBuffer group_sizes,
                                      ffi::Result<ffi::AnyBuffer> q_rows,
                                      ffi::Result<ffi::AnyBuffer> scale_rows,
                                      ffi::Result<ffi::AnyBuffer> q,
                                      ffi::Result<ffi::AnyBuffer> scale,
                                      ffi::Result<ffi::AnyBuffer> workspace, int64_t pow2) {
  int64_t n, f, e, length;
  MEGAMOE_RETURN_IF_ERROR(CheckSwigluBackwardQuantize(dh, gate_up, group_sizes, q_rows,
                                                      scale_rows, q, scale, &n, &f, &e, &length));
  int32_t *offsets, *padded;
  MEGAMOE_RETURN_IF_ERROR(PaddedOffsets(stream, group_sizes, e, n, workspace, &offsets, &padded));
  std::string err = SwigluBackwardQuantize(
      dh.untyped_data(), gate_up.untyped_data(), f, offsets, padded, int(e), length, pow2 != 0,
      q_rows->untyped_data(), static_cast<float*>(scale_rows->untyped_data()), q->untyped_data(),
      static_cast<float*>(scale->untyped_data()), stream);
  if (!err.empty()) return Internal(err);
  return ffi::Error::Success();
}

}  // namespace

// The CUDA context, then each op's binding (fp8_ops.h).
#define MEGAMOE_CUDA_BIND ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()
XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8QuantizeRowsCuda, QuantizeRowsImpl,
                              BindQuantizeRows(MEGAMOE_CUDA_BIND),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8QuantizeWeightsCuda, QuantizeWeightsImpl,
                              BindQuantizeWeights(MEGAMOE_CUDA_BIND),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8SwigluQuantizeCuda, SwigluQuantizeImpl,
                              BindSwigluQuantize(MEGAMOE_CUDA_BIND),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8QuantizeWgradOperandCuda, QuantizeWgradOperandImpl,
                              BindQuantizeWgradOperand(MEGAMOE_CUDA_BIND),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8SwigluBackwardQuantizeCuda, SwigluBackwardQuantizeImpl,
                              BindSwigluBackwardQuantize(MEGAMOE_CUDA_BIND),
                              {ffi::Traits::kCmdBufferCompatible});
#undef MEGAMOE_CUDA_BIND

MEGAMOE_REGISTER_FFI("megamoe_fp8_quantize_rows", "CUDA", Fp8QuantizeRowsCuda);
MEGAMOE_REGISTER_FFI("megamoe_fp8_quantize_weights", "CUDA", Fp8QuantizeWeightsCuda);
MEGAMOE_REGISTER_FFI_WITH_SCRATCH("megamoe_fp8_swiglu_quantize", "CUDA", Fp8SwigluQuantizeCuda,
                                  CudaScratchBytes<OffsetsScratchNeed>);
MEGAMOE_REGISTER_FFI_WITH_SCRATCH("megamoe_fp8_swiglu_backward_quantize", "CUDA",
                                  Fp8SwigluBackwardQuantizeCuda,
                                  CudaScratchBytes<PaddedOffsetsScratchNeed>);
MEGAMOE_REGISTER_FFI_WITH_SCRATCH("megamoe_fp8_quantize_wgrad_operand", "CUDA",
                                  Fp8QuantizeWgradOperandCuda,
                                  CudaScratchBytes<PaddedOffsetsScratchNeed>);

}  // namespace megamoe::grouped

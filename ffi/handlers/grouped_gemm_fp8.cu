// XLA FFI handler (CUDA) of the blockwise-FP8 grouped GEMM on operands quantised beforehand
// (ffi/handlers/fp8_quantize.cu, or rows dispatched already in FP8):
//   a_q [N, L] e4m3 (L >= K, L % 16 == 0: row r's K values are its first K bytes, so rows may
//       carry more, e.g. the scales they were dispatched with), a_scale [N, K/128] f32 (1x128
//       blocks along K),
//   group_sizes [E] int32,
//   b_q [E, P, K] e4m3 (the weights transposed: K-major), b_scale [E, K/128, P/128] f32
//   -> d [N, P] bf16 (rows past sum(group_sizes) are 0), workspace u8[W].
// fp32 accumulation promoted every 128 of K.
// And the K-grouped weight gradient (megamoe_grouped_wgrad_fp8) on two weight-gradient operands
// (fp8_quantize.cu, cuda_fp8.WgradOperand):
//   a_q [Ca, L] e4m3, a_scale [L/128, Ca] f32, group_sizes [E] int32, b_q [Cb, L] e4m3,
//   b_scale [L/128, Cb] f32 -> d [E, Ca, Cb] bf16 (a group with no rows: 0), workspace u8[W].
// Group g's columns are recomputed from group_sizes as the quantiser laid them out (rows
// clamped to L - 128 E >= N; the same for every valid input).
#include <cuda_runtime.h>

#include "ffi/common/checks.h"
#include "ffi/common/device_info.h"
#include "ffi/gemm/grouped_gemm_fp8.h"
#include "ffi/handlers/fp8_ops.h"
#include "ffi/handlers/scratch.h"
#include "ffi/impls/grouped_zero_fill.h"
#include "ffi/registry.h"
#include "ffi/scheduler/group_offsets.h"

namespace megamoe::grouped {
namespace {

// Scratch: the group offsets (with the padded offsets after them for wgrad), then the GEMM's.
ScratchNeed GemmScratchNeed(int64_t e, int sm_count) {
  return {e + 1, GroupedGemmFp8WorkspaceBytes(int(e), sm_count)};
}
ScratchNeed WgradScratchNeed(int64_t e, int sm_count) {
  return {2 * (e + 1), GroupedWgradFp8WorkspaceBytes(int(e), sm_count)};
}

ffi::Error GroupedGemmFp8Impl(cudaStream_t stream, ffi::AnyBuffer a_q, ffi::AnyBuffer a_scale,
                              ffi::AnyBuffer group_sizes, ffi::AnyBuffer b_q,
                              ffi::AnyBuffer b_scale, ffi::Result<ffi::AnyBuffer> d,
                              ffi::Result<ffi::AnyBuffer> workspace) {
  Fp8GemmDims g;
  MEGAMOE_RETURN_IF_ERROR(CheckGroupedGemmFp8(a_q, a_scale, group_sizes, b_q, b_scale, d, &g));
  const int64_t e = g.e, n = g.n, lda = g.lda, p = g.p, k = g.k;
  const int sm = CurrentDeviceSmCount();
  Scratch ws;
  MEGAMOE_RETURN_IF_ERROR(SplitScratch(workspace, GemmScratchNeed(e, sm), &ws));
  int32_t* offsets = ws.offsets;
  std::string err = GroupOffsets(static_cast<const int32_t*>(group_sizes.untyped_data()), int(e),
                                 n, offsets, stream);
  if (err.empty() && n > 0) {
    GroupedGemmFp8Problem prob{int(e), offsets, a_q.untyped_data(),
                               static_cast<const float*>(a_scale.untyped_data()),
                               b_q.untyped_data(),
                               static_cast<const float*>(b_scale.untyped_data()),
                               d->untyped_data(), n, p, k, lda};
    err = RunGroupedGemmFp8(prob, ws.gemm, ws.gemm_bytes, sm, stream);
  }
  if (err.empty()) err = ZeroPaddingRows(d->untyped_data(), n, p, offsets, int(e), stream);
  if (!err.empty()) return Internal(err);
  return ffi::Error::Success();
}

ffi::Error GroupedWgradFp8Impl(cudaStream_t stream, ffi::AnyBuffer a_q, ffi::AnyBuffer a_scale,
                               ffi::AnyBuffer group_sizes, ffi::AnyBuffer b_q,
                               ffi::AnyBuffer b_scale, ffi::Result<ffi::AnyBuffer> d,
                               ffi::Result<ffi::AnyBuffer> workspace) {
  Fp8WgradDims g;
  MEGAMOE_RETURN_IF_ERROR(CheckGroupedWgradFp8(a_q, a_scale, group_sizes, b_q, b_scale, d, &g));
  const int sm = CurrentDeviceSmCount();
  Scratch ws;
  MEGAMOE_RETURN_IF_ERROR(SplitScratch(workspace, WgradScratchNeed(g.e, sm), &ws));
  int32_t* offsets = ws.offsets;
  int32_t* padded = offsets + g.e + 1;
  std::string err = PaddedGroupOffsets(static_cast<const int32_t*>(group_sizes.untyped_data()),
                                       int(g.e), g.length - 128 * g.e, offsets, padded, stream);
  if (err.empty()) {
    GroupedWgradFp8Problem prob{int(g.e), offsets, padded, a_q.untyped_data(),
                                static_cast<const float*>(a_scale.untyped_data()),
                                b_q.untyped_data(),
                                static_cast<const float*>(b_scale.untyped_data()),
                                d->untyped_data(), g.ca, g.cb, g.length};
    err = RunGroupedWgradFp8(prob, ws.gemm, ws.gemm_bytes, sm, stream);
  }
  if (err.empty()) err = ZeroEmptyGroups(d->untyped_data(), g.ca * g.cb, offsets, int(g.e), stream);
  if (!err.empty()) return Internal(err);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedGemmFp8Cuda, GroupedGemmFp8Impl,
                              BindGroupedGemmFp8(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedWgradFp8Cuda, GroupedWgradFp8Impl,
                              BindGroupedGemmFp8(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

MEGAMOE_REGISTER_FFI_WITH_SCRATCH("megamoe_grouped_gemm_fp8", "CUDA", GroupedGemmFp8Cuda,
                                  CudaScratchBytes<GemmScratchNeed>);
MEGAMOE_REGISTER_FFI_WITH_SCRATCH("megamoe_grouped_wgrad_fp8", "CUDA", GroupedWgradFp8Cuda,
                                  CudaScratchBytes<WgradScratchNeed>);

}  // namespace megamoe::grouped

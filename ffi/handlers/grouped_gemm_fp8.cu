// XLA FFI handler (CUDA) of the blockwise-FP8 grouped GEMM (recipe "fp8", forward layout):
//   a [N, K] bf16, group_sizes [E] int32, b [E, K, P] bf16  ->  d [N, P] bf16
// quantising a in 1x128 blocks along K and b in 128x128 blocks inside the call. The quantised
// operands come back as results (a_q u8[N*K], a_scale f32[N*K/128] (row-major), b_q u8[E*P*K]
// (b transposed, K-major), b_scale f32[E*K/128*P/128]) so tests can check them bit for bit; then
// the workspace. Attribute pow2 (0/1): power-of-two scales. Rows past sum(group_sizes) are 0.
// Attribute stages (benchmarks only; 7 = everything): bit 1 quantise a, bit 2 quantise b, bit 4
// the GEMM (with stages = 3 the quantisation alone is timed, d is left unwritten).
#include <cuda_runtime.h>

#include "ffi/common/checks.h"
#include "ffi/common/device_info.h"
#include "ffi/kernels/grouped_fp8.h"
#include "ffi/kernels/grouped_swiglu.h"
#include "ffi/registry.h"

namespace megamoe::grouped {
namespace {

ffi::Error CheckBytes(const char* name, ffi::Result<ffi::AnyBuffer>& buf, ffi::DataType t,
                      size_t elems) {
  if (buf->element_type() != t || buf->element_count() != elems) {
    return InvalidArgument(name, " must be ", DataTypeName(t), "[", elems, "], got ",
                           DataTypeName(buf->element_type()), ShapeString(buf->dimensions()));
  }
  return ffi::Error::Success();
}

ffi::Error GroupedGemmFp8Impl(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer group_sizes,
                              ffi::AnyBuffer b, ffi::Result<ffi::AnyBuffer> d,
                              ffi::Result<ffi::AnyBuffer> a_q, ffi::Result<ffi::AnyBuffer> a_scale,
                              ffi::Result<ffi::AnyBuffer> b_q, ffi::Result<ffi::AnyBuffer> b_scale,
                              ffi::Result<ffi::AnyBuffer> workspace, int64_t pow2,
                              int64_t stages) {
  for (auto [name, t] : {std::pair{"a", a.element_type()}, {"b", b.element_type()},
                         {"d", d->element_type()}}) {
    if (t != ffi::DataType::BF16) {
      return InvalidArgument(name, " has dtype ", DataTypeName(t), ", expected bfloat16");
    }
  }
  if (group_sizes.element_type() != ffi::DataType::S32 || group_sizes.dimensions().size() != 1 ||
      group_sizes.dimensions()[0] < 1) {
    return InvalidArgument("group_sizes must be [E] int32 with E >= 1");
  }
  const int64_t e = group_sizes.dimensions()[0];
  auto ad = a.dimensions(), bd = b.dimensions(), dd = d->dimensions();
  if (ad.size() != 2 || bd.size() != 3 || bd[0] != e || bd[1] != ad[1] || dd.size() != 2 ||
      dd[0] != ad[0] || dd[1] != bd[2]) {
    return InvalidArgument("FP8 grouped GEMM got a ", ShapeString(ad), ", b ", ShapeString(bd),
                           ", d ", ShapeString(dd), ", E=", e,
                           ": expected a [N, K], b [E, K, P], d [N, P]");
  }
  const int64_t n = ad[0], k = ad[1], p = bd[2];
  if (k % 128 != 0) return InvalidArgument("FP8 needs K % 128 == 0, got K=", k);
  if (p % 128 != 0) return InvalidArgument("FP8 needs P % 128 == 0, got P=", p);
  MEGAMOE_RETURN_IF_ERROR(CheckBytes("a_q", a_q, ffi::DataType::U8, size_t(n * k)));
  MEGAMOE_RETURN_IF_ERROR(CheckBytes("a_scale", a_scale, ffi::DataType::F32, size_t(k / 128 * n)));
  MEGAMOE_RETURN_IF_ERROR(CheckBytes("b_q", b_q, ffi::DataType::U8, size_t(e * p * k)));
  MEGAMOE_RETURN_IF_ERROR(
      CheckBytes("b_scale", b_scale, ffi::DataType::F32, size_t(e * (k / 128) * (p / 128))));
  const int sm = CurrentDeviceSmCount();
  const size_t offsets_bytes = ((e + 1) * 4 + 255) / 256 * 256;
  const size_t need = offsets_bytes + GroupedGemmFp8WorkspaceBytes(int(e), sm);
  if (workspace->element_type() != ffi::DataType::U8 || workspace->size_bytes() < need) {
    return InvalidArgument("workspace must be uint8 with at least ", need, " bytes, got ",
                           workspace->size_bytes());
  }
  uint8_t* ws = static_cast<uint8_t*>(workspace->untyped_data());
  int32_t* offsets = reinterpret_cast<int32_t*>(ws);
  std::string err = GroupOffsets(static_cast<const int32_t*>(group_sizes.untyped_data()), int(e),
                                 n, offsets, stream);
  if (err.empty() && (stages & 1)) {
    err = QuantizeActivations1x128(a.untyped_data(), n, k, pow2 != 0, a_q->untyped_data(),
                                   static_cast<float*>(a_scale->untyped_data()), stream);
  }
  if (err.empty() && (stages & 2)) {
    err = QuantizeWeights128x128(b.untyped_data(), e, k, p, pow2 != 0, b_q->untyped_data(),
                                 static_cast<float*>(b_scale->untyped_data()), stream);
  }
  if (err.empty() && n > 0 && (stages & 4)) {
    GroupedGemmFp8Problem prob{int(e), offsets, a_q->untyped_data(),
                               static_cast<const float*>(a_scale->untyped_data()),
                               b_q->untyped_data(),
                               static_cast<const float*>(b_scale->untyped_data()),
                               d->untyped_data(), n, p, k};
    err = RunGroupedGemmFp8(prob, ws + offsets_bytes, workspace->size_bytes() - offsets_bytes, sm,
                            stream);
  }
  if (err.empty() && (stages & 4)) {
    err = ZeroPaddingRows(d->untyped_data(), n, p, offsets, int(e), stream);
  }
  if (!err.empty()) return Internal(err);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedGemmFp8Cuda, GroupedGemmFp8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // a
                                  .Arg<ffi::AnyBuffer>()  // group_sizes
                                  .Arg<ffi::AnyBuffer>()  // b
                                  .Ret<ffi::AnyBuffer>()  // d
                                  .Ret<ffi::AnyBuffer>()  // a_q
                                  .Ret<ffi::AnyBuffer>()  // a_scale
                                  .Ret<ffi::AnyBuffer>()  // b_q
                                  .Ret<ffi::AnyBuffer>()  // b_scale
                                  .Ret<ffi::AnyBuffer>()  // workspace
                                  .Attr<int64_t>("pow2")
                                  .Attr<int64_t>("stages"));

MEGAMOE_REGISTER_FFI("megamoe_grouped_gemm_fp8", "CUDA", GroupedGemmFp8Cuda);

}  // namespace megamoe::grouped

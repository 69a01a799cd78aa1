// XLA FFI handler (CUDA) of one grouped GEMM over rows sorted by group (grouped_gemm.h), for
// benchmarks, tests and callers that compose their own expert computation.
//   kind 0 fprop: a [N, K], b [E, K, P] -> d [N, P]      (rows past sum(group_sizes) zeroed)
//   kind 1 dgrad: a [N, K], b [E, P, K] -> d [N, P]      (likewise)
//   kind 2 wgrad: a [N, M], b [N, P]    -> d [E, M, P]   (an empty group's d[g] zeroed)
// bf16 operands and result, fp32 accumulation; results: d, workspace u8[W].
#include <cuda_runtime.h>

#include "ffi/common/checks.h"
#include "ffi/common/device_info.h"
#include "ffi/gemm/grouped_gemm.h"
#include "ffi/impls/grouped_swiglu.h"
#include "ffi/registry.h"

namespace megamoe::grouped {
namespace {

ffi::Error GroupedGemmImpl(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer group_sizes,
                           ffi::AnyBuffer b, ffi::Result<ffi::AnyBuffer> d,
                           ffi::Result<ffi::AnyBuffer> workspace, int64_t kind) {
  if (kind < 0 || kind > 2) return InvalidArgument("kind must be 0, 1 or 2, got ", kind);
  const GemmKind k = static_cast<GemmKind>(kind);
  for (auto [name, t] : {std::pair{"a", a.element_type()}, {"b", b.element_type()},
                         {"d", d->element_type()}}) {
    if (t != ffi::DataType::BF16) {
      return InvalidArgument(name, " has dtype ", DataTypeName(t), ", expected bfloat16");
    }
  }
  if (group_sizes.element_type() != ffi::DataType::S32 || group_sizes.dimensions().size() != 1 ||
      group_sizes.dimensions()[0] < 1) {
    return InvalidArgument("group_sizes must be [E] int32 with E >= 1, got ",
                           DataTypeName(group_sizes.element_type()),
                           ShapeString(group_sizes.dimensions()));
  }
  const int64_t e = group_sizes.dimensions()[0];
  if (e > 65535) return InvalidArgument("group_sizes has E=", e, " groups, at most 65535");
  auto ad = a.dimensions(), bd = b.dimensions(), dd = d->dimensions();
  if (ad.size() != 2) return InvalidArgument("a must be 2-D, got ", ShapeString(ad));
  const int64_t n = ad[0];
  int64_t m = 0, p = 0, kk = 0;
  bool ok;
  if (k == GemmKind::kWgrad) {
    m = ad[1];
    ok = bd.size() == 2 && bd[0] == n && dd.size() == 3 && dd[0] == e && dd[1] == m;
    if (ok) p = bd[1], ok = dd[2] == p;
  } else {
    kk = ad[1];
    ok = bd.size() == 3 && bd[0] == e && dd.size() == 2 && dd[0] == n;
    if (ok) {
      p = k == GemmKind::kFprop ? bd[2] : bd[1];
      ok = (k == GemmKind::kFprop ? bd[1] : bd[2]) == kk && dd[1] == p;
    }
  }
  if (!ok) {
    return InvalidArgument("grouped GEMM kind ", kind, " got a ", ShapeString(ad), ", b ",
                           ShapeString(bd), ", d ", ShapeString(dd), ", group_sizes [", e,
                           "]: shapes do not match (see grouped_gemm.cu)");
  }
  for (int64_t v : {m, p, kk}) {
    if (v % 8 != 0) return InvalidArgument("every GEMM extent must be a multiple of 8, got ", v);
  }
  if (workspace->element_type() != ffi::DataType::U8) {
    return InvalidArgument("workspace must be uint8");
  }
  const int sm = CurrentDeviceSmCount();
  const size_t offsets_bytes = ((e + 1) * 4 + 255) / 256 * 256;
  const size_t need = offsets_bytes + GroupedGemmWorkspaceBytes(k, int(e), sm);
  if (workspace->size_bytes() < need) {
    return InvalidArgument("workspace has ", workspace->size_bytes(), " bytes, need ", need);
  }
  uint8_t* ws = static_cast<uint8_t*>(workspace->untyped_data());
  int32_t* offsets = reinterpret_cast<int32_t*>(ws);
  std::string err = GroupOffsets(static_cast<const int32_t*>(group_sizes.untyped_data()), int(e),
                                 n, offsets, stream);
  if (!err.empty()) return Internal(err);
  if (n > 0) {
    GroupedGemmProblem prob{k, int(e), offsets, a.untyped_data(), b.untyped_data(),
                            d->untyped_data(), m, p, kk};
    err = RunGroupedGemm(prob, ws + offsets_bytes, workspace->size_bytes() - offsets_bytes, sm,
                         stream);
    if (!err.empty()) return Internal(err);
  }
  err = k == GemmKind::kWgrad
            ? ZeroEmptyGroups(d->untyped_data(), m * p, offsets, int(e), stream)
            : ZeroPaddingRows(d->untyped_data(), n, p, offsets, int(e), stream);
  if (!err.empty()) return Internal(err);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedGemmCuda, GroupedGemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // a
                                  .Arg<ffi::AnyBuffer>()  // group_sizes
                                  .Arg<ffi::AnyBuffer>()  // b
                                  .Ret<ffi::AnyBuffer>()  // d
                                  .Ret<ffi::AnyBuffer>()  // workspace
                                  .Attr<int64_t>("kind"));

MEGAMOE_REGISTER_FFI("megamoe_grouped_gemm", "CUDA", GroupedGemmCuda);

}  // namespace megamoe::grouped

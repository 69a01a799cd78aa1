// Minimal XLA FFI handlers that fail validation the way this project's handlers do, one per
// binding shape that they use (results, attributes, a platform-stream-free CPU context), so that
// a crash on an error path can be placed: jaxlib's FFI itself, a binding shape, or this
// project's extension (tests/test_handler_errors.py).
#include <cstdint>
#include <sstream>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error Fail(const char* what) {
  std::ostringstream os;
  os << what << " has shape [2], expected [4]";
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, os.str());
}

ffi::Error OneResult(ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer>) { return Fail("one_result"); }

ffi::Error TwoResultsAndAttr(ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer>,
                             ffi::Result<ffi::AnyBuffer>, int64_t) {
  return Fail("two_results_attr");
}

ffi::Error TypedBuffers(ffi::Buffer<ffi::BF16>, ffi::Buffer<ffi::S32>,
                        ffi::Result<ffi::Buffer<ffi::F32>>) {
  return Fail("typed_buffers");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ProbeOneResult, OneResult,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(ProbeTwoResultsAndAttr, TwoResultsAndAttr,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("pow2"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(ProbeTypedBuffers, TypedBuffers,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

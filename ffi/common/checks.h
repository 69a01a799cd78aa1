// Checks shared by the FFI handlers: CUDA return codes and argument validation, turned into
// xla::ffi::Error values whose message names the parameter and the offending value.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace megamoe {

namespace ffi = ::xla::ffi;

// Builds a message from any streamable pieces: Message("w_down dim ", 1, " is ", d).
template <typename... Args>
std::string Message(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

template <typename... Args>
ffi::Error InvalidArgument(Args&&... args) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, Message(std::forward<Args>(args)...));
}

template <typename... Args>
ffi::Error Internal(Args&&... args) {
  return ffi::Error(ffi::ErrorCode::kInternal, Message(std::forward<Args>(args)...));
}

inline std::string ShapeString(ffi::Span<const int64_t> dims) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < dims.size(); ++i) os << (i ? ", " : "") << dims[i];
  os << "]";
  return os.str();
}

inline const char* DataTypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::F8E4M3FN: return "float8_e4m3fn";
    default: return "other";
  }
}

// A buffer's shape and dtype against what an op expects; the message names the buffer.
inline ffi::Error ExpectShape(const char* name, ffi::Span<const int64_t> dims,
                              std::initializer_list<int64_t> want) {
  bool ok = dims.size() == want.size();
  size_t i = 0;
  for (int64_t w : want) ok = ok && dims[i++] == w;
  if (!ok) {
    std::vector<int64_t> w(want);
    return InvalidArgument(name, " has shape ", ShapeString(dims), ", expected ",
                           ShapeString(ffi::Span<const int64_t>(w.data(), w.size())));
  }
  return ffi::Error::Success();
}

inline ffi::Error ExpectDtype(const char* name, ffi::DataType got, ffi::DataType want) {
  if (got != want) {
    return InvalidArgument(name, " has dtype ", DataTypeName(got), ", expected ",
                           DataTypeName(want));
  }
  return ffi::Error::Success();
}

}  // namespace megamoe

// Returns from the enclosing function with the error when `expr` (an ffi::Error) is not ok.
#define MEGAMOE_RETURN_IF_ERROR(expr)          \
  do {                                         \
    ::xla::ffi::Error megamoe_err_ = (expr);   \
    if (megamoe_err_.failure()) return megamoe_err_; \
  } while (0)

// Returns an Internal error from the enclosing function when `expr` (a kernel launcher's
// std::string: "" or what failed) is not empty.
#define MEGAMOE_RETURN_IF_KERNEL_ERROR(expr)                          \
  do {                                                                \
    const std::string megamoe_kerr_ = (expr);                         \
    if (!megamoe_kerr_.empty()) return ::megamoe::Internal(megamoe_kerr_); \
  } while (0)

#ifdef __CUDACC__
#include <cuda_runtime.h>
// Returns an ffi::Error naming the call when a CUDA runtime call fails.
#define MEGAMOE_CUDA_RETURN_IF_ERROR(expr)                                                   \
  do {                                                                                       \
    cudaError_t megamoe_cuda_err_ = (expr);                                                  \
    if (megamoe_cuda_err_ != cudaSuccess)                                                    \
      return ::megamoe::Internal(#expr, " failed: ", cudaGetErrorString(megamoe_cuda_err_), \
                                 " (", __FILE__, ":", __LINE__, ")");                        \
  } while (0)
#endif

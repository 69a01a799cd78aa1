// What the EP handlers (dispatch and combine, forward and backward) share: the binding's
// context and attributes, the workspace lookup with its error report, the dtype mapping and the
// checks that a call fits its workspace.
#pragma once

#include <cuda_runtime.h>

#include <initializer_list>
#include <string>
#include <utility>

#include "ffi/comm/symmetric_memory.h"
#include "ffi/comm/workspace_registry.h"
#include "ffi/common/checks.h"
#include "ffi/impls/ep_dispatch_combine.h"
#include "xla/ffi/api/ffi.h"

namespace megamoe::ep {

namespace ffi = xla::ffi;

// The local ranks of workspace `id` on this device (one, or R of a virtual group), after
// checking that no earlier call recorded an error on any of them.
inline ffi::Error ResolveRanks(int64_t id, int32_t ordinal, LocalRanks* ranks) {
  std::string message;
  if (!FindLocalRanks(id, ordinal, ranks, &message)) return ffi::Error::InvalidArgument(message);
  for (int r = 0; r < ranks->count; ++r) {
    std::string error = DescribeError(*ranks->views[r]);
    if (!error.empty()) return ffi::Error::Internal(error);
  }
  // The shares' device, not XLA's ordinal: where the one-share fallback (one device per
  // process) matched, the two may differ.
  int current = -1;
  cudaGetDevice(&current);
  if (current != ranks->cuda_device) cudaSetDevice(ranks->cuda_device);
  return ffi::Error::Success();
}

// One operand of an EP call as each local rank sees it: on a virtual group the buffer has a
// leading axis of one entry per rank, and rank r's part is its r-th slice.
struct RankOperand {
  char* data = nullptr;
  size_t rank_bytes = 0;
  int64_t dims[4] = {};  // one rank's dimensions

  template <typename T = void>
  T* at(int r) const {
    return reinterpret_cast<T*>(data + static_cast<size_t>(r) * rank_bytes);
  }
};

// The first failure among `statuses` (all already evaluated), else success.
inline ffi::Error FirstFailure(std::initializer_list<ffi::Error> statuses) {
  for (const ffi::Error& e : statuses) {
    if (e.failure()) return e;
  }
  return ffi::Error::Success();
}

template <typename Buffer>
ffi::Error SplitRanks(const Buffer& buffer, const LocalRanks& ranks, size_t rank_ndim,
                      const char* name, RankOperand* out) {
  const auto dims = buffer.dimensions();
  const size_t lead = ranks.stacked ? 1 : 0;
  if (dims.size() != rank_ndim + lead || (lead == 1 && dims[0] != ranks.count)) {
    return ffi::Error::InvalidArgument(
        std::string("jax_megamoe EP: ") + name + " must be " + std::to_string(rank_ndim) +
        "-D" + (lead ? " per rank, with a leading axis of " + std::to_string(ranks.count) +
                           " virtual ranks"
                     : "") +
        ", got " + std::to_string(dims.size()) + " dimensions");
  }
  out->data = static_cast<char*>(buffer.untyped_data());
  out->rank_bytes = buffer.size_bytes() / ranks.count;
  for (size_t i = 0; i < rank_ndim; ++i) out->dims[i] = dims[lead + i];
  return ffi::Error::Success();
}

inline ffi::Error ElemTypeOf(ffi::DataType dtype, const char* what, ElemType* out) {
  switch (dtype) {
    case ffi::DataType::F32: *out = ElemType::kF32; return ffi::Error::Success();
    case ffi::DataType::BF16: *out = ElemType::kBF16; return ffi::Error::Success();
    case ffi::DataType::F16: *out = ElemType::kF16; return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument(std::string("jax_megamoe EP: ") + what +
                                         " must be float32, bfloat16 or float16");
  }
}

inline int64_t ByteWidthOf(ElemType t) { return t == ElemType::kF32 ? 4 : 2; }

// Rows of `tokens` x `hidden` elements and `top_k` slots must fit the workspace's layout.
inline ffi::Error CheckFits(const PeerView& v, int64_t tokens, int64_t hidden, int64_t top_k,
                            ElemType t, int64_t num_experts) {
  const WorkspaceLayout& L = v.layout;
  const int64_t row_bytes = hidden * ByteWidthOf(t);
  auto fail = [](const std::string& m) {
    return ffi::Error::InvalidArgument("jax_megamoe EP: " + m);
  };
  if (tokens > L.max_tokens)
    return fail("tokens per rank " + std::to_string(tokens) + " > workspace max_tokens " +
                std::to_string(L.max_tokens));
  if (top_k > L.top_k || top_k > 32)
    return fail("top_k " + std::to_string(top_k) + " > workspace top_k " + std::to_string(L.top_k));
  if (row_bytes > L.hidden * L.elem_bytes)
    return fail("a row of " + std::to_string(row_bytes) + " bytes exceeds the workspace rows (" +
                std::to_string(L.hidden * L.elem_bytes) + " bytes)");
  if (row_bytes % 16 != 0)
    return fail("hidden * itemsize must be a multiple of 16 bytes, got " +
                std::to_string(row_bytes));
  if (num_experts % v.num_ranks != 0)
    return fail("num_experts " + std::to_string(num_experts) + " is not divisible by the " +
                std::to_string(v.num_ranks) + " ranks");
  if (num_experts / v.num_ranks > 1024) return fail("more than 1024 experts per rank");
  if (static_cast<int64_t>(v.num_ranks) * tokens * top_k > (int64_t{1} << 31) - 1)
    return fail("ranks * tokens * top_k overflows int32");
  return ffi::Error::Success();
}

inline ffi::Error CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jax_megamoe EP ") + what + ": " +
                              cudaGetErrorString(err));
}

// The binding of an EP handler: EpAttributes(EpContext().Arg<...>()...Ret<...>()), the stream
// and device ordinal first, the workspace id (jax_megamoe.symmetric) and the global expert count
// last.
inline auto EpContext() {
  return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::DeviceOrdinal>();
}
template <class Binding>
auto EpAttributes(Binding&& b) {
  return std::move(b).template Attr<int64_t>("workspace_id").template Attr<int64_t>("num_experts");
}

// The integer and float operands (any rank: a virtual group's carry a leading rank axis).
using S32Array = ffi::Buffer<ffi::S32>;
using F32Array = ffi::Buffer<ffi::F32>;

}  // namespace megamoe::ep

// XLA FFI handlers of expert-parallel combine: forward, and its backward (dispatch-shaped).
// Attributes: workspace_id (int64), num_experts (int64, global E).
#include "ffi/comm/workspace_ops.h"
#include "ffi/handlers/ep_ops.h"
#include "ffi/registry.h"

namespace megamoe::ep {
namespace {

ffi::Error CombineFwd(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer y_sorted,
                      ffi::Buffer<ffi::S32, 2> slot_pos, ffi::Buffer<ffi::F32, 2> recv_w,
                      ffi::Buffer<ffi::S32, 2> ids, ffi::Result<ffi::AnyBuffer> out,
                      int64_t workspace_id, int64_t num_experts) {
  const PeerView* v = nullptr;
  if (auto e = ResolveView(workspace_id, ordinal, &v); e.failure()) return e;
  ElemType type;
  if (auto e = ElemTypeOf(y_sorted.element_type(), "y_sorted", &type); e.failure()) return e;
  const int64_t T = ids.dimensions()[0], K = ids.dimensions()[1], H = y_sorted.dimensions()[1];
  if (auto e = CheckFits(*v, T, H, K, type, num_experts); e.failure()) return e;
  const int64_t rows = v->num_ranks * T;
  if (out->dimensions()[0] != T || out->dimensions()[1] != H || slot_pos.dimensions()[0] != rows ||
      recv_w.dimensions()[0] != rows || out->element_type() != y_sorted.element_type()) {
    return ffi::Error::InvalidArgument("jax_megamoe EP combine: inconsistent operand shapes");
  }
  CombineArgs a{type, y_sorted.untyped_data(), slot_pos.typed_data(), recv_w.typed_data(),
                nullptr, ids.typed_data(), static_cast<int>(T), static_cast<int>(H),
                static_cast<int>(K), static_cast<int>(num_experts / v->num_ranks),
                static_cast<int>(y_sorted.dimensions()[0])};
  return CudaStatus(LaunchCombine(*v, a, kOpCombineFwd, out->untyped_data(), nullptr, stream),
                    "combine launch");
}

ffi::Error CombineBwd(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer d_out,
                      ffi::AnyBuffer y_sorted, ffi::Buffer<ffi::S32, 2> slot_pos,
                      ffi::Buffer<ffi::F32, 2> recv_w, ffi::Buffer<ffi::S32, 2> ids,
                      ffi::Buffer<ffi::S32, 1> group_sizes, ffi::Result<ffi::AnyBuffer> dy_sorted,
                      ffi::Result<ffi::Buffer<ffi::F32, 2>> d_recv_w, int64_t workspace_id,
                      int64_t num_experts) {
  const PeerView* v = nullptr;
  if (auto e = ResolveView(workspace_id, ordinal, &v); e.failure()) return e;
  ElemType type;
  if (auto e = ElemTypeOf(d_out.element_type(), "d_out", &type); e.failure()) return e;
  const int64_t T = ids.dimensions()[0], K = ids.dimensions()[1], H = d_out.dimensions()[1];
  if (auto e = CheckFits(*v, T, H, K, type, num_experts); e.failure()) return e;
  const int64_t rows = v->num_ranks * T;
  const int64_t epr = num_experts / v->num_ranks;
  if (d_out.dimensions()[0] != T || y_sorted.dimensions()[1] != H ||
      y_sorted.element_type() != d_out.element_type() || slot_pos.dimensions()[0] != rows ||
      recv_w.dimensions()[0] != rows || group_sizes.dimensions()[0] != epr ||
      dy_sorted->dimensions()[0] != y_sorted.dimensions()[0] || d_recv_w->dimensions()[0] != rows) {
    return ffi::Error::InvalidArgument("jax_megamoe EP combine backward: inconsistent shapes");
  }
  DispatchArgs a{type, d_out.untyped_data(), ids.typed_data(), nullptr, static_cast<int>(T),
                 static_cast<int>(H), static_cast<int>(K), static_cast<int>(epr)};
  return CudaStatus(
      LaunchCombineBackward(*v, a, y_sorted.untyped_data(), slot_pos.typed_data(),
                            recv_w.typed_data(), group_sizes.typed_data(),
                            static_cast<int>(y_sorted.dimensions()[0]), dy_sorted->untyped_data(),
                            d_recv_w->typed_data(), stream),
      "combine backward launch");
}

}  // namespace
}  // namespace megamoe::ep

namespace ffi = xla::ffi;
using S32Matrix = ffi::Buffer<ffi::S32, 2>;
using F32Matrix = ffi::Buffer<ffi::F32, 2>;
using S32Vector = ffi::Buffer<ffi::S32, 1>;

XLA_FFI_DEFINE_HANDLER_SYMBOL(MegamoeEpCombineFwd, megamoe::ep::CombineFwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<S32Matrix>()
                                  .Arg<F32Matrix>()
                                  .Arg<S32Matrix>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("workspace_id")
                                  .Attr<int64_t>("num_experts"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MegamoeEpCombineBwd, megamoe::ep::CombineBwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<S32Matrix>()
                                  .Arg<F32Matrix>()
                                  .Arg<S32Matrix>()
                                  .Arg<S32Vector>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<F32Matrix>()
                                  .Attr<int64_t>("workspace_id")
                                  .Attr<int64_t>("num_experts"),
                              {ffi::Traits::kCmdBufferCompatible});

MEGAMOE_REGISTER_FFI("megamoe_ep_combine_fwd", "CUDA", MegamoeEpCombineFwd);
MEGAMOE_REGISTER_FFI("megamoe_ep_combine_bwd", "CUDA", MegamoeEpCombineBwd);

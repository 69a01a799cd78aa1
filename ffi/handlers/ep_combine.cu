// XLA FFI handlers of expert-parallel combine: forward, and its backward (dispatch-shaped).
// Attributes: workspace_id (int64), num_experts (int64, global E).
#include "ffi/comm/workspace_ops.h"
#include "ffi/handlers/ep_ops.h"
#include "ffi/registry.h"

namespace megamoe::ep {
namespace {

ffi::Error CombineFwd(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer y_sorted,
                      S32Matrix slot_pos, F32Matrix recv_w, S32Matrix ids,
                      ffi::Result<ffi::AnyBuffer> out, int64_t workspace_id, int64_t num_experts) {
  const int64_t T = ids.dimensions()[0], K = ids.dimensions()[1], H = y_sorted.dimensions()[1];
  EpCall call;
  MEGAMOE_RETURN_IF_ERROR(ResolveEpCall(workspace_id, ordinal, y_sorted.element_type(),
                                        "y_sorted", T, H, K, num_experts, &call));
  const PeerView* v = call.view;
  const ElemType type = call.type;
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
                      ffi::AnyBuffer y_sorted, S32Matrix slot_pos, F32Matrix recv_w, S32Matrix ids,
                      S32Vector group_sizes, ffi::Result<ffi::AnyBuffer> dy_sorted,
                      ffi::Result<F32Matrix> d_recv_w, int64_t workspace_id, int64_t num_experts) {
  const int64_t T = ids.dimensions()[0], K = ids.dimensions()[1], H = d_out.dimensions()[1];
  EpCall call;
  MEGAMOE_RETURN_IF_ERROR(ResolveEpCall(workspace_id, ordinal, d_out.element_type(), "d_out", T,
                                        H, K, num_experts, &call));
  const PeerView* v = call.view;
  const ElemType type = call.type;
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(MegamoeEpCombineFwd, CombineFwd,
                              EpAttributes(EpContext()
                                  .Arg<ffi::AnyBuffer>()  // y_sorted
                                  .Arg<S32Matrix>()       // slot_pos
                                  .Arg<F32Matrix>()       // recv_w
                                  .Arg<S32Matrix>()       // ids
                                  .Ret<ffi::AnyBuffer>()),  // out
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MegamoeEpCombineBwd, CombineBwd,
                              EpAttributes(EpContext()
                                  .Arg<ffi::AnyBuffer>()  // d_out
                                  .Arg<ffi::AnyBuffer>()  // y_sorted
                                  .Arg<S32Matrix>()       // slot_pos
                                  .Arg<F32Matrix>()       // recv_w
                                  .Arg<S32Matrix>()       // ids
                                  .Arg<S32Vector>()       // group_sizes
                                  .Ret<ffi::AnyBuffer>()  // dy_sorted
                                  .Ret<F32Matrix>()),     // d_recv_w
                              {ffi::Traits::kCmdBufferCompatible});

MEGAMOE_REGISTER_FFI("megamoe_ep_combine_fwd", "CUDA", MegamoeEpCombineFwd);
MEGAMOE_REGISTER_FFI("megamoe_ep_combine_bwd", "CUDA", MegamoeEpCombineBwd);

}  // namespace megamoe::ep

// XLA FFI handlers of expert-parallel dispatch: forward, and its backward (combine-shaped).
// Binding and validation only; the kernels are in ffi/impls/ep_dispatch.cu and ep_combine.cu.
// Attributes: workspace_id (int64, jax_megamoe.symmetric), num_experts (int64, global E).
#include "ffi/comm/workspace_ops.h"
#include "ffi/handlers/ep_ops.h"
#include "ffi/registry.h"

namespace megamoe::ep {
namespace {

ffi::Error DispatchFwd(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, S32Matrix ids,
                       F32Matrix weights, ffi::Result<ffi::AnyBuffer> x_sorted,
                       ffi::Result<S32Vector> group_sizes, ffi::Result<S32Matrix> slot_pos,
                       ffi::Result<F32Matrix> recv_w, ffi::Result<S32Vector> stats,
                       ffi::Result<S32Vector> scratch, int64_t workspace_id, int64_t num_experts) {
  if (x.dimensions().size() != 2 || x_sorted->dimensions().size() != 2)
    return ffi::Error::InvalidArgument("jax_megamoe EP dispatch: x and x_sorted must be 2-D");
  const int64_t T = x.dimensions()[0], H = x.dimensions()[1], K = ids.dimensions()[1];
  EpCall call;
  MEGAMOE_RETURN_IF_ERROR(ResolveEpCall(workspace_id, ordinal, x.element_type(), "x", T, H, K,
                                        num_experts, &call));
  const PeerView* v = call.view;
  const ElemType type = call.type;
  const int64_t epr = num_experts / v->num_ranks;
  const int64_t rows = v->num_ranks * T;
  if (ids.dimensions()[0] != T || weights.dimensions()[0] != T || weights.dimensions()[1] != K ||
      x_sorted->dimensions()[1] != H || x_sorted->element_type() != x.element_type() ||
      group_sizes->dimensions()[0] != epr || slot_pos->dimensions()[0] != rows ||
      slot_pos->dimensions()[1] != K || recv_w->dimensions()[0] != rows ||
      stats->dimensions()[0] != 4 || scratch->dimensions()[0] < DispatchScratchInts(rows, epr)) {
    return ffi::Error::InvalidArgument("jax_megamoe EP dispatch: inconsistent operand shapes");
  }
  DispatchArgs a{type, x.untyped_data(), ids.typed_data(), weights.typed_data(),
                 static_cast<int>(T), static_cast<int>(H), static_cast<int>(K),
                 static_cast<int>(epr)};
  return CudaStatus(
      LaunchDispatchForward(*v, a, x_sorted->untyped_data(),
                            static_cast<int>(x_sorted->dimensions()[0]),
                            group_sizes->typed_data(), slot_pos->typed_data(),
                            recv_w->typed_data(), stats->typed_data(), scratch->typed_data(),
                            stream),
      "dispatch launch");
}

// dx[t] = sum over ranks of sum over the token's slots there of dx_sorted rows;
// d_weights[t, j] = d_recv_w of slot (t, j) on the rank that holds its expert.
ffi::Error DispatchBwd(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer dx_sorted,
                       F32Matrix d_recv_w, S32Matrix slot_pos, S32Matrix ids,
                       ffi::Result<ffi::AnyBuffer> dx, ffi::Result<F32Matrix> d_weights,
                       int64_t workspace_id, int64_t num_experts) {
  const int64_t T = ids.dimensions()[0], K = ids.dimensions()[1], H = dx_sorted.dimensions()[1];
  EpCall call;
  MEGAMOE_RETURN_IF_ERROR(ResolveEpCall(workspace_id, ordinal, dx_sorted.element_type(),
                                        "dx_sorted", T, H, K, num_experts, &call));
  const PeerView* v = call.view;
  const ElemType type = call.type;
  const int64_t rows = v->num_ranks * T;
  if (dx->dimensions()[0] != T || dx->dimensions()[1] != H || slot_pos.dimensions()[0] != rows ||
      d_recv_w.dimensions()[0] != rows || d_weights->dimensions()[0] != T) {
    return ffi::Error::InvalidArgument("jax_megamoe EP dispatch backward: inconsistent shapes");
  }
  CombineArgs a{type, dx_sorted.untyped_data(), slot_pos.typed_data(), nullptr,
                d_recv_w.typed_data(), ids.typed_data(), static_cast<int>(T),
                static_cast<int>(H), static_cast<int>(K),
                static_cast<int>(num_experts / v->num_ranks),
                static_cast<int>(dx_sorted.dimensions()[0])};
  return CudaStatus(LaunchCombine(*v, a, kOpDispatchBwd, dx->untyped_data(),
                                  d_weights->typed_data(), stream),
                    "dispatch backward launch");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MegamoeEpDispatchFwd, DispatchFwd,
                              EpAttributes(EpContext()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<S32Matrix>()       // ids
                                  .Arg<F32Matrix>()       // weights
                                  .Ret<ffi::AnyBuffer>()  // x_sorted
                                  .Ret<S32Vector>()       // group_sizes
                                  .Ret<S32Matrix>()       // slot_pos
                                  .Ret<F32Matrix>()       // recv_w
                                  .Ret<S32Vector>()       // stats
                                  .Ret<S32Vector>()),     // scratch
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MegamoeEpDispatchBwd, DispatchBwd,
                              EpAttributes(EpContext()
                                  .Arg<ffi::AnyBuffer>()  // dx_sorted
                                  .Arg<F32Matrix>()       // d_recv_w
                                  .Arg<S32Matrix>()       // slot_pos
                                  .Arg<S32Matrix>()       // ids
                                  .Ret<ffi::AnyBuffer>()  // dx
                                  .Ret<F32Matrix>()),     // d_weights
                              {ffi::Traits::kCmdBufferCompatible});

MEGAMOE_REGISTER_FFI("megamoe_ep_dispatch_fwd", "CUDA", MegamoeEpDispatchFwd);
MEGAMOE_REGISTER_FFI("megamoe_ep_dispatch_bwd", "CUDA", MegamoeEpDispatchBwd);

}  // namespace megamoe::ep

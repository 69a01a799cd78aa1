// XLA FFI handlers of expert-parallel dispatch: forward, and its backward (combine-shaped).
// Binding and validation only; the kernels are in ffi/impls/ep_dispatch.cu and ep_combine.cu.
// Attributes: workspace_id (int64, jax_megamoe.symmetric), num_experts (int64, global E).
#include "ffi/comm/workspace_ops.h"
#include "ffi/handlers/ep_ops.h"
#include "ffi/registry.h"

namespace megamoe::ep {
namespace {

ffi::Error DispatchFwd(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                       ffi::Buffer<ffi::S32, 2> ids, ffi::Buffer<ffi::F32, 2> weights,
                       ffi::Result<ffi::AnyBuffer> x_sorted,
                       ffi::Result<ffi::Buffer<ffi::S32, 1>> group_sizes,
                       ffi::Result<ffi::Buffer<ffi::S32, 2>> slot_pos,
                       ffi::Result<ffi::Buffer<ffi::F32, 2>> recv_w,
                       ffi::Result<ffi::Buffer<ffi::S32, 1>> stats,
                       ffi::Result<ffi::Buffer<ffi::S32, 1>> scratch, int64_t workspace_id,
                       int64_t num_experts) {
  const PeerView* v = nullptr;
  if (auto e = ResolveView(workspace_id, ordinal, &v); e.failure()) return e;
  ElemType type;
  if (auto e = ElemTypeOf(x.element_type(), "x", &type); e.failure()) return e;
  if (x.dimensions().size() != 2 || x_sorted->dimensions().size() != 2)
    return ffi::Error::InvalidArgument("jax_megamoe EP dispatch: x and x_sorted must be 2-D");
  const int64_t T = x.dimensions()[0], H = x.dimensions()[1], K = ids.dimensions()[1];
  if (auto e = CheckFits(*v, T, H, K, type, num_experts); e.failure()) return e;
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
                       ffi::Buffer<ffi::F32, 2> d_recv_w, ffi::Buffer<ffi::S32, 2> slot_pos,
                       ffi::Buffer<ffi::S32, 2> ids, ffi::Result<ffi::AnyBuffer> dx,
                       ffi::Result<ffi::Buffer<ffi::F32, 2>> d_weights, int64_t workspace_id,
                       int64_t num_experts) {
  const PeerView* v = nullptr;
  if (auto e = ResolveView(workspace_id, ordinal, &v); e.failure()) return e;
  ElemType type;
  if (auto e = ElemTypeOf(dx_sorted.element_type(), "dx_sorted", &type); e.failure()) return e;
  const int64_t T = ids.dimensions()[0], K = ids.dimensions()[1], H = dx_sorted.dimensions()[1];
  if (auto e = CheckFits(*v, T, H, K, type, num_experts); e.failure()) return e;
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
}  // namespace megamoe::ep

namespace ffi = xla::ffi;
using S32Matrix = ffi::Buffer<ffi::S32, 2>;
using F32Matrix = ffi::Buffer<ffi::F32, 2>;
using S32Vector = ffi::Buffer<ffi::S32, 1>;

XLA_FFI_DEFINE_HANDLER_SYMBOL(MegamoeEpDispatchFwd, megamoe::ep::DispatchFwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<S32Matrix>()
                                  .Arg<F32Matrix>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<S32Vector>()
                                  .Ret<S32Matrix>()
                                  .Ret<F32Matrix>()
                                  .Ret<S32Vector>()
                                  .Ret<S32Vector>()
                                  .Attr<int64_t>("workspace_id")
                                  .Attr<int64_t>("num_experts"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MegamoeEpDispatchBwd, megamoe::ep::DispatchBwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<F32Matrix>()
                                  .Arg<S32Matrix>()
                                  .Arg<S32Matrix>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<F32Matrix>()
                                  .Attr<int64_t>("workspace_id")
                                  .Attr<int64_t>("num_experts"),
                              {ffi::Traits::kCmdBufferCompatible});

MEGAMOE_REGISTER_FFI("megamoe_ep_dispatch_fwd", "CUDA", MegamoeEpDispatchFwd);
MEGAMOE_REGISTER_FFI("megamoe_ep_dispatch_bwd", "CUDA", MegamoeEpDispatchBwd);

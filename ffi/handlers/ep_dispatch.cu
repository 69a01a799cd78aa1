// XLA FFI handlers of expert-parallel dispatch: forward, and its backward (combine-shaped).
// Binding and validation only; the kernels are in ffi/impls/ep_dispatch.cu and ep_combine.cu.
// Attributes: workspace_id (int64, jax_megamoe.symmetric), num_experts (int64, global E).
// On a virtual-rank workspace every operand carries a leading axis of one entry per rank.
#include <vector>

#include "ffi/comm/peer_signal.h"
#include "ffi/handlers/ep_args.h"
#include "ffi/registry.h"

namespace megamoe::ep {
namespace {

ffi::Error DispatchFwd(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                       ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> weights,
                       ffi::Result<ffi::AnyBuffer> x_sorted,
                       ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,
                       ffi::Result<ffi::Buffer<ffi::S32>> slot_pos,
                       ffi::Result<ffi::Buffer<ffi::F32>> recv_w,
                       ffi::Result<ffi::Buffer<ffi::S32>> stats,
                       ffi::Result<ffi::Buffer<ffi::S32>> scratch, int64_t workspace_id,
                       int64_t num_experts) {
  LocalRanks ranks;
  if (auto e = ResolveRanks(workspace_id, ordinal, &ranks); e.failure()) return e;
  ElemType type;
  if (auto e = ElemTypeOf(x.element_type(), "x", &type); e.failure()) return e;
  RankOperand ox, oids, ow, oxs, ogs, opos, orw, ost, osc;
  if (auto e = FirstFailure({SplitRanks(x, ranks, 2, "x", &ox),
                            SplitRanks(ids, ranks, 2, "topk_ids", &oids),
                            SplitRanks(weights, ranks, 2, "topk_weights", &ow),
                            SplitRanks(*x_sorted, ranks, 2, "x_sorted", &oxs),
                            SplitRanks(*group_sizes, ranks, 1, "group_sizes", &ogs),
                            SplitRanks(*slot_pos, ranks, 2, "slot_pos", &opos),
                            SplitRanks(*recv_w, ranks, 2, "recv_w", &orw),
                            SplitRanks(*stats, ranks, 1, "stats", &ost),
                            SplitRanks(*scratch, ranks, 1, "scratch", &osc)});
      e.failure()) {
    return e;
  }
  const PeerView& v0 = *ranks.views[0];
  const int64_t T = ox.dims[0], H = ox.dims[1], K = oids.dims[1];
  if (auto e = CheckFits(v0, T, H, K, type, num_experts); e.failure()) return e;
  const int64_t epr = num_experts / v0.num_ranks;
  const int64_t rows = v0.num_ranks * T;
  if (oids.dims[0] != T || ow.dims[0] != T || ow.dims[1] != K || oxs.dims[1] != H ||
      x_sorted->element_type() != x.element_type() || ogs.dims[0] != epr ||
      opos.dims[0] != rows || opos.dims[1] != K || orw.dims[0] != rows || ost.dims[0] != 4 ||
      osc.dims[0] < DispatchScratchInts(rows, epr)) {
    return ffi::Error::InvalidArgument("jax_megamoe EP dispatch: inconsistent operand shapes");
  }
  std::vector<DispatchForwardCall> calls;
  for (int r = 0; r < ranks.count; ++r) {
    if (r == ranks.absent) continue;
    calls.push_back({ranks.views[r],
                     {type, ox.at(r), oids.at<int32_t>(r), ow.at<float>(r), static_cast<int>(T),
                      static_cast<int>(H), static_cast<int>(K), static_cast<int>(epr)},
                     oxs.at(r), static_cast<int>(oxs.dims[0]), ogs.at<int32_t>(r),
                     opos.at<int32_t>(r), orw.at<float>(r), ost.at<int32_t>(r),
                     osc.at<int32_t>(r)});
  }
  if (calls.empty()) return ffi::Error::Success();
  return CudaStatus(LaunchDispatchForward(calls.data(), static_cast<int>(calls.size()), stream),
                    "dispatch launch");
}

// dx[t] = sum over ranks of sum over the token's slots there of dx_sorted rows;
// d_weights[t, j] = d_recv_w of slot (t, j) on the rank that holds its expert.
ffi::Error DispatchBwd(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer dx_sorted,
                       ffi::Buffer<ffi::F32> d_recv_w, ffi::Buffer<ffi::S32> slot_pos,
                       ffi::Buffer<ffi::S32> ids, ffi::Result<ffi::AnyBuffer> dx,
                       ffi::Result<ffi::Buffer<ffi::F32>> d_weights, int64_t workspace_id,
                       int64_t num_experts) {
  LocalRanks ranks;
  if (auto e = ResolveRanks(workspace_id, ordinal, &ranks); e.failure()) return e;
  ElemType type;
  if (auto e = ElemTypeOf(dx_sorted.element_type(), "dx_sorted", &type); e.failure()) return e;
  RankOperand odxs, odrw, opos, oids, odx, odw;
  if (auto e = FirstFailure({SplitRanks(dx_sorted, ranks, 2, "dx_sorted", &odxs),
                            SplitRanks(d_recv_w, ranks, 2, "d_recv_w", &odrw),
                            SplitRanks(slot_pos, ranks, 2, "slot_pos", &opos),
                            SplitRanks(ids, ranks, 2, "topk_ids", &oids),
                            SplitRanks(*dx, ranks, 2, "dx", &odx),
                            SplitRanks(*d_weights, ranks, 2, "d_weights", &odw)});
      e.failure()) {
    return e;
  }
  const PeerView& v0 = *ranks.views[0];
  const int64_t T = oids.dims[0], K = oids.dims[1], H = odxs.dims[1];
  if (auto e = CheckFits(v0, T, H, K, type, num_experts); e.failure()) return e;
  const int64_t rows = v0.num_ranks * T;
  if (odx.dims[0] != T || odx.dims[1] != H || opos.dims[0] != rows || odrw.dims[0] != rows ||
      odw.dims[0] != T) {
    return ffi::Error::InvalidArgument("jax_megamoe EP dispatch backward: inconsistent shapes");
  }
  std::vector<CombineCall> calls;
  for (int r = 0; r < ranks.count; ++r) {
    if (r == ranks.absent) continue;
    calls.push_back({ranks.views[r],
                     {type, odxs.at(r), opos.at<int32_t>(r), nullptr, odrw.at<float>(r),
                      oids.at<int32_t>(r), static_cast<int>(T), static_cast<int>(H),
                      static_cast<int>(K), static_cast<int>(num_experts / v0.num_ranks),
                      static_cast<int>(odxs.dims[0])},
                     odx.at(r), odw.at<float>(r)});
  }
  if (calls.empty()) return ffi::Error::Success();
  return CudaStatus(LaunchCombine(calls.data(), static_cast<int>(calls.size()), kOpDispatchBwd,
                                  stream),
                    "dispatch backward launch");
}

}  // namespace
}  // namespace megamoe::ep

namespace ffi = xla::ffi;
using S32Array = ffi::Buffer<ffi::S32>;
using F32Array = ffi::Buffer<ffi::F32>;

XLA_FFI_DEFINE_HANDLER_SYMBOL(MegamoeEpDispatchFwd, megamoe::ep::DispatchFwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<S32Array>()
                                  .Arg<F32Array>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<S32Array>()
                                  .Ret<S32Array>()
                                  .Ret<F32Array>()
                                  .Ret<S32Array>()
                                  .Ret<S32Array>()
                                  .Attr<int64_t>("workspace_id")
                                  .Attr<int64_t>("num_experts"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MegamoeEpDispatchBwd, megamoe::ep::DispatchBwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<F32Array>()
                                  .Arg<S32Array>()
                                  .Arg<S32Array>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<F32Array>()
                                  .Attr<int64_t>("workspace_id")
                                  .Attr<int64_t>("num_experts"),
                              {ffi::Traits::kCmdBufferCompatible});

MEGAMOE_REGISTER_FFI("megamoe_ep_dispatch_fwd", "CUDA", MegamoeEpDispatchFwd);
MEGAMOE_REGISTER_FFI("megamoe_ep_dispatch_bwd", "CUDA", MegamoeEpDispatchBwd);

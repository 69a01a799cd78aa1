// XLA FFI handlers of expert-parallel combine: forward, and its backward (dispatch-shaped).
// Attributes: workspace_id (int64), num_experts (int64, global E). On a virtual-rank workspace
// every operand carries a leading axis of one entry per rank.
#include <vector>

#include "ffi/comm/peer_signal.h"
#include "ffi/handlers/ep_args.h"
#include "ffi/registry.h"

namespace megamoe::ep {
namespace {

ffi::Error CombineFwd(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer y_sorted,
                      ffi::Buffer<ffi::S32> slot_pos, ffi::Buffer<ffi::F32> recv_w,
                      ffi::Buffer<ffi::S32> ids, ffi::Result<ffi::AnyBuffer> out,
                      int64_t workspace_id, int64_t num_experts) {
  LocalRanks ranks;
  if (auto e = ResolveRanks(workspace_id, ordinal, &ranks); e.failure()) return e;
  ElemType type;
  if (auto e = ElemTypeOf(y_sorted.element_type(), "y_sorted", &type); e.failure()) return e;
  RankOperand oy, opos, orw, oids, oout;
  if (auto e = FirstFailure({SplitRanks(y_sorted, ranks, 2, "y_sorted", &oy),
                            SplitRanks(slot_pos, ranks, 2, "slot_pos", &opos),
                            SplitRanks(recv_w, ranks, 2, "recv_w", &orw),
                            SplitRanks(ids, ranks, 2, "topk_ids", &oids),
                            SplitRanks(*out, ranks, 2, "out", &oout)});
      e.failure()) {
    return e;
  }
  const PeerView& v0 = *ranks.views[0];
  const int64_t T = oids.dims[0], K = oids.dims[1], H = oy.dims[1];
  if (auto e = CheckFits(v0, T, H, K, type, num_experts); e.failure()) return e;
  const int64_t rows = v0.num_ranks * T;
  if (oout.dims[0] != T || oout.dims[1] != H || opos.dims[0] != rows || orw.dims[0] != rows ||
      out->element_type() != y_sorted.element_type()) {
    return ffi::Error::InvalidArgument("jax_megamoe EP combine: inconsistent operand shapes");
  }
  std::vector<CombineCall> calls;
  for (int r = 0; r < ranks.count; ++r) {
    if (r == ranks.absent) continue;
    calls.push_back({ranks.views[r],
                     {type, oy.at(r), opos.at<int32_t>(r), orw.at<float>(r), nullptr,
                      oids.at<int32_t>(r), static_cast<int>(T), static_cast<int>(H),
                      static_cast<int>(K), static_cast<int>(num_experts / v0.num_ranks),
                      static_cast<int>(oy.dims[0])},
                     oout.at(r), nullptr});
  }
  if (calls.empty()) return ffi::Error::Success();
  return CudaStatus(LaunchCombine(calls.data(), static_cast<int>(calls.size()), kOpCombineFwd,
                                  stream),
                    "combine launch");
}

ffi::Error CombineBwd(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer d_out,
                      ffi::AnyBuffer y_sorted, ffi::Buffer<ffi::S32> slot_pos,
                      ffi::Buffer<ffi::F32> recv_w, ffi::Buffer<ffi::S32> ids,
                      ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> dy_sorted,
                      ffi::Result<ffi::Buffer<ffi::F32>> d_recv_w, int64_t workspace_id,
                      int64_t num_experts) {
  LocalRanks ranks;
  if (auto e = ResolveRanks(workspace_id, ordinal, &ranks); e.failure()) return e;
  ElemType type;
  if (auto e = ElemTypeOf(d_out.element_type(), "d_out", &type); e.failure()) return e;
  RankOperand odo, oy, opos, orw, oids, ogs, ody, odrw;
  if (auto e = FirstFailure({SplitRanks(d_out, ranks, 2, "d_out", &odo),
                            SplitRanks(y_sorted, ranks, 2, "y_sorted", &oy),
                            SplitRanks(slot_pos, ranks, 2, "slot_pos", &opos),
                            SplitRanks(recv_w, ranks, 2, "recv_w", &orw),
                            SplitRanks(ids, ranks, 2, "topk_ids", &oids),
                            SplitRanks(group_sizes, ranks, 1, "group_sizes", &ogs),
                            SplitRanks(*dy_sorted, ranks, 2, "dy_sorted", &ody),
                            SplitRanks(*d_recv_w, ranks, 2, "d_recv_w", &odrw)});
      e.failure()) {
    return e;
  }
  const PeerView& v0 = *ranks.views[0];
  const int64_t T = oids.dims[0], K = oids.dims[1], H = odo.dims[1];
  if (auto e = CheckFits(v0, T, H, K, type, num_experts); e.failure()) return e;
  const int64_t rows = v0.num_ranks * T;
  const int64_t epr = num_experts / v0.num_ranks;
  if (odo.dims[0] != T || oy.dims[1] != H || y_sorted.element_type() != d_out.element_type() ||
      opos.dims[0] != rows || orw.dims[0] != rows || ogs.dims[0] != epr ||
      ody.dims[0] != oy.dims[0] || odrw.dims[0] != rows) {
    return ffi::Error::InvalidArgument("jax_megamoe EP combine backward: inconsistent shapes");
  }
  std::vector<CombineBackwardCall> calls;
  for (int r = 0; r < ranks.count; ++r) {
    if (r == ranks.absent) continue;
    calls.push_back({ranks.views[r],
                     {type, odo.at(r), oids.at<int32_t>(r), nullptr, static_cast<int>(T),
                      static_cast<int>(H), static_cast<int>(K), static_cast<int>(epr)},
                     oy.at(r), opos.at<int32_t>(r), orw.at<float>(r), ogs.at<int32_t>(r),
                     static_cast<int>(oy.dims[0]), ody.at(r), odrw.at<float>(r)});
  }
  if (calls.empty()) return ffi::Error::Success();
  return CudaStatus(
      LaunchCombineBackward(calls.data(), static_cast<int>(calls.size()), stream),
      "combine backward launch");
}

}  // namespace
}  // namespace megamoe::ep

namespace ffi = xla::ffi;
using S32Array = ffi::Buffer<ffi::S32>;
using F32Array = ffi::Buffer<ffi::F32>;

XLA_FFI_DEFINE_HANDLER_SYMBOL(MegamoeEpCombineFwd, megamoe::ep::CombineFwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<S32Array>()
                                  .Arg<F32Array>()
                                  .Arg<S32Array>()
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
                                  .Arg<S32Array>()
                                  .Arg<F32Array>()
                                  .Arg<S32Array>()
                                  .Arg<S32Array>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<F32Array>()
                                  .Attr<int64_t>("workspace_id")
                                  .Attr<int64_t>("num_experts"),
                              {ffi::Traits::kCmdBufferCompatible});

MEGAMOE_REGISTER_FFI("megamoe_ep_combine_fwd", "CUDA", MegamoeEpCombineFwd);
MEGAMOE_REGISTER_FFI("megamoe_ep_combine_bwd", "CUDA", MegamoeEpCombineBwd);

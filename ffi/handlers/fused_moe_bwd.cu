// XLA FFI handler of the fused MoE backward's pass (backend "fused", bf16): binding and
// validation only; the kernel is ffi/impls/sm90_fused_moe.cu's, run with the dgrad engine
// (LaunchFusedBackward; benchmarks/kernels/FUSED_BACKWARD_PLAN.md, step 3). Attributes as the
// forward's: workspace_id, num_experts, n_cap (the forward's), max_ctas. On a virtual-rank
// workspace every operand carries a leading axis of one entry per rank.
//
// In: dy [T, H] bf16, the forward's topk_ids and topk_weights [T, k], its y rows in comb order
// (y_comb: [n_cap, H], its y_sorted, with one rank alone; [T * k, H] with several), its gate_up
// [n_cap, 2F], and the weights w_gate_up [E/R, H, 2F], w_down [E/R, F, H] (bf16, as stored).
// Out: dx [T, H] bf16, d topk_weights [T, k] f32, dy_sorted [n_cap, H] and dgate_up [n_cap, 2F]
// (pool order, the wgrads' operands), and the forward's scratch, slot tables, group sizes,
// stats and phases (the routing runs again). Rows of dy_sorted and dgate_up past the last group
// are not written (the wgrads stop at each group's end), as the forward's x_sorted. A rank that
// timed out gives NaN in all four outputs.
#include <cuda_bf16.h>

#include <string>
#include <vector>

#include "ffi/handlers/ep_ops.h"
#include "ffi/handlers/fused_ops.h"
#include "ffi/impls/fused_moe.h"
#include "ffi/registry.h"

namespace megamoe::fused {
namespace {

namespace ffi = xla::ffi;
using ep::FirstFailure;
using ep::LocalRanks;
using ep::RankOperand;
using ep::SplitRanks;

ffi::Error Fail(const std::string& message) {
  return ffi::Error::InvalidArgument("jax_megamoe fused backward: " + message);
}

ffi::Error FusedMoeBwd(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer dy,
                       ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> weights,
                       ffi::AnyBuffer y_comb, ffi::AnyBuffer gate_up, ffi::AnyBuffer w_gate_up,
                       ffi::AnyBuffer w_down, ffi::Result<ffi::AnyBuffer> dx,
                       ffi::Result<ffi::Buffer<ffi::F32>> d_weights,
                       ffi::Result<ffi::AnyBuffer> dy_sorted,
                       ffi::Result<ffi::AnyBuffer> dgate_up,
                       ffi::Result<ffi::Buffer<ffi::S32>> scratch,
                       ffi::Result<ffi::Buffer<ffi::S32>> slot_rows,
                       ffi::Result<ffi::Buffer<ffi::S32>> slot_dest,
                       ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,
                       ffi::Result<ffi::Buffer<ffi::S32>> stats,
                       ffi::Result<ffi::Buffer<ffi::S32>> phases, int64_t workspace_id,
                       int64_t num_experts, int64_t n_cap, int64_t max_ctas) {
  LocalRanks ranks;
  if (auto e = ep::ResolveRanks(workspace_id, ordinal, &ranks); e.failure()) return e;
  if (std::string why = DtypeMismatch({{dy.element_type(), "dy"},
                                       {y_comb.element_type(), "y_comb"},
                                       {gate_up.element_type(), "gate_up"},
                                       {w_gate_up.element_type(), "w_gate_up"},
                                       {w_down.element_type(), "w_down"},
                                       {dx->element_type(), "dx"},
                                       {dy_sorted->element_type(), "dy_sorted"},
                                       {dgate_up->element_type(), "dgate_up"}},
                                      ffi::DataType::BF16, "bfloat16");
      !why.empty())
    return Fail(why);
  RankOperand ody, oids, ow, oyc, ogate, ogu, odn, odx, odw, odys, odgu;
  RoutingOutputs routing;
  if (auto e = FirstFailure({SplitRanks(dy, ranks, 2, "dy", &ody),
                            SplitRanks(ids, ranks, 2, "topk_ids", &oids),
                            SplitRanks(weights, ranks, 2, "topk_weights", &ow),
                            SplitRanks(y_comb, ranks, 2, "y_comb", &oyc),
                            SplitRanks(gate_up, ranks, 2, "gate_up", &ogate),
                            SplitRanks(w_gate_up, ranks, 3, "w_gate_up", &ogu),
                            SplitRanks(w_down, ranks, 3, "w_down", &odn),
                            SplitRanks(*dx, ranks, 2, "dx", &odx),
                            SplitRanks(*d_weights, ranks, 2, "d_topk_weights", &odw),
                            SplitRanks(*dy_sorted, ranks, 2, "dy_sorted", &odys),
                            SplitRanks(*dgate_up, ranks, 2, "dgate_up", &odgu),
                            SplitRoutingOutputs(ranks, *scratch, *slot_rows, *slot_dest,
                                                *group_sizes, *stats, *phases, &routing)});
      e.failure()) {
    return e;
  }
  const ep::PeerView& v0 = *ranks.views[0];
  const int64_t T = ody.dims[0], H = ody.dims[1], K = oids.dims[1];
  const int64_t El = ogu.dims[0], F = ogu.dims[2] / 2;
  const auto n = [](int64_t v) { return std::to_string(v); };
  if (oids.dims[0] != T || !DimsAre(ow, {T, K}) || !DimsAre(odw, {T, K}))
    return Fail("topk_ids, topk_weights and d_topk_weights must be [T=" + n(T) + ", k]");
  if (El * v0.num_ranks != num_experts || !DimsAre(ogu, {El, H, 2 * F}))
    return Fail("w_gate_up must be [E/R=" + n(num_experts / v0.num_ranks) + ", H=" + n(H) +
                ", 2F] per rank");
  if (!DimsAre(odn, {El, F, H}))
    return Fail("w_down must be [E/R, F=" + n(F) + ", H=" + n(H) + "] per rank");
  // One rank alone the comb buffer is the pool's order (the forward's y_sorted); otherwise the
  // forward copied its comb rows out, one per slot.
  const bool one_rank = v0.num_ranks == 1 && ranks.count == 1;
  const int64_t comb_rows = one_rank ? n_cap : T * K;
  if (!DimsAre(oyc, {comb_rows, H}))
    return Fail("y_comb must be [" + std::string(one_rank ? "n_cap=" : "T * k=") + n(comb_rows) +
                ", H=" + n(H) + "] per rank (" +
                (one_rank ? "one rank alone: the forward's y_sorted" : "the forward's comb rows") +
                ")");
  if (!DimsAre(ogate, {n_cap, 2 * F}) || !DimsAre(odgu, {n_cap, 2 * F}))
    return Fail("gate_up and dgate_up must be [n_cap=" + n(n_cap) + ", 2F=" + n(2 * F) +
                "] per rank");
  if (!DimsAre(odx, {T, H}) || !DimsAre(odys, {n_cap, H}))
    return Fail("dx must be [T, H] and dy_sorted [n_cap=" + n(n_cap) + ", H] per rank");
  if (std::string why = RoutingOutputsMismatch(routing, T, K, El, num_experts); !why.empty())
    return Fail(why);
  FusedForwardProblem problem;
  if (std::string why = FusedProblemFor(T, H, F, K, num_experts, n_cap, max_ctas, /*fp8=*/false,
                                        /*pow2=*/false, v0, &problem);
      !why.empty())
    return Fail(why);
  std::vector<FusedBackwardRankOperands> ops;
  for (int r = 0; r < ranks.count; ++r) {
    ops.push_back({ranks.views[r], ody.at(r), oids.at<int32_t>(r), ow.at<float>(r), oyc.at(r),
                   ogate.at(r), ogu.at(r), odn.at(r), odx.at(r), odw.at<float>(r), odys.at(r),
                   odgu.at(r), routing.scratch.at<int32_t>(r),
                   routing.slot_rows.at<int32_t>(r), routing.slot_dest.at<int32_t>(r),
                   routing.group_sizes.at<int32_t>(r), routing.stats.at<int32_t>(r),
                   routing.phases.at<int32_t>(r)});
  }
  if (std::string err = LaunchFusedBackward(ops.data(), static_cast<int>(ops.size()),
                                            ranks.absent, problem, stream);
      !err.empty()) {
    return ffi::Error::Internal("jax_megamoe fused backward: " + err);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace megamoe::fused

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(MegamoeFusedMoeBwd, megamoe::fused::FusedMoeBwd,
                              megamoe::ep::EpAttributes(
                                  megamoe::ep::EpContext()
                                      .Arg<ffi::AnyBuffer>()  // dy
                                      .Arg<ffi::Buffer<ffi::S32>>()  // topk_ids
                                      .Arg<ffi::Buffer<ffi::F32>>()  // topk_weights
                                      .Arg<ffi::AnyBuffer>()  // y_comb
                                      .Arg<ffi::AnyBuffer>()  // gate_up
                                      .Arg<ffi::AnyBuffer>()  // w_gate_up
                                      .Arg<ffi::AnyBuffer>()  // w_down
                                      .Ret<ffi::AnyBuffer>()  // dx
                                      .Ret<ffi::Buffer<ffi::F32>>()  // d_topk_weights
                                      .Ret<ffi::AnyBuffer>()  // dy_sorted
                                      .Ret<ffi::AnyBuffer>()  // dgate_up
                                      .Ret<ffi::Buffer<ffi::S32>>()  // scratch
                                      .Ret<ffi::Buffer<ffi::S32>>()  // slot_rows
                                      .Ret<ffi::Buffer<ffi::S32>>()  // slot_dest
                                      .Ret<ffi::Buffer<ffi::S32>>()  // group_sizes
                                      .Ret<ffi::Buffer<ffi::S32>>()  // stats
                                      .Ret<ffi::Buffer<ffi::S32>>())  // phases
                                  .Attr<int64_t>("n_cap")
                                  .Attr<int64_t>("max_ctas"),
                              {ffi::Traits::kCmdBufferCompatible});

MEGAMOE_REGISTER_FFI("megamoe_fused_moe_bwd", "CUDA", MegamoeFusedMoeBwd);

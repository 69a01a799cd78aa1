// XLA FFI handler of the fused MoE forward (backend "fused"): binding and validation only; the
// kernel is ffi/impls/sm90_fused_moe_fwd.cu. Attributes: workspace_id (int64, a workspace with
// fused regions), num_experts (global E), n_cap (pool rows per rank), max_ctas (CTAs of the
// launch: > 0 at most that many, <= 0 every SM but -max_ctas). On a virtual-rank workspace
// every operand carries a leading axis of one entry per rank. Residual outputs, each [0] when
// not kept: gate_up ([n_cap, 2F] per rank) and y_sorted ([n_cap, H] per rank), any workspace;
// x_sorted ([n_cap, H]), a workspace of one rank only (it replaces the pool region).
#include <cuda_bf16.h>

#include <string>
#include <vector>

#include "ffi/comm/peer_signal.cuh"
#include "ffi/handlers/ep_ops.h"
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
  return ffi::Error::InvalidArgument("jax_megamoe fused forward: " + message);
}

ffi::Error RequireBf16(ffi::DataType dtype, const char* name) {
  if (dtype == ffi::DataType::BF16) return ffi::Error::Success();
  return Fail(std::string(name) + " must be bfloat16");
}

ffi::Error FusedMoeFwd(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                       ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> weights,
                       ffi::AnyBuffer w_gate_up, ffi::AnyBuffer w_down,
                       ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> h,
                       ffi::Result<ffi::Buffer<ffi::S32>> chunk_counts,
                       ffi::Result<ffi::Buffer<ffi::S32>> slot_rows,
                       ffi::Result<ffi::Buffer<ffi::S32>> slot_dest,
                       ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,
                       ffi::Result<ffi::Buffer<ffi::S32>> stats,
                       ffi::Result<ffi::Buffer<ffi::S32>> phases,
                       ffi::Result<ffi::AnyBuffer> x_sorted, ffi::Result<ffi::AnyBuffer> gate_up,
                       ffi::Result<ffi::AnyBuffer> y_sorted, int64_t workspace_id,
                       int64_t num_experts, int64_t n_cap, int64_t max_ctas) {
  LocalRanks ranks;
  if (auto e = ep::ResolveRanks(workspace_id, ordinal, &ranks); e.failure()) return e;
  for (auto [dtype, name] : {std::pair{x.element_type(), "x"},
                             {w_gate_up.element_type(), "w_gate_up"},
                             {w_down.element_type(), "w_down"}, {y->element_type(), "y"},
                             {h->element_type(), "h"}, {x_sorted->element_type(), "x_sorted"},
                             {gate_up->element_type(), "gate_up"},
                             {y_sorted->element_type(), "y_sorted"}}) {
    if (auto e = RequireBf16(dtype, name); e.failure()) return e;
  }
  RankOperand ox, oids, ow, ogu, odn, oy, oh, occ, orows, odest, ogs, ost, oph;
  if (auto e = FirstFailure({SplitRanks(x, ranks, 2, "x", &ox),
                            SplitRanks(ids, ranks, 2, "topk_ids", &oids),
                            SplitRanks(weights, ranks, 2, "topk_weights", &ow),
                            SplitRanks(w_gate_up, ranks, 3, "w_gate_up", &ogu),
                            SplitRanks(w_down, ranks, 3, "w_down", &odn),
                            SplitRanks(*y, ranks, 2, "y", &oy),
                            SplitRanks(*h, ranks, 2, "h", &oh),
                            SplitRanks(*chunk_counts, ranks, 1, "chunk_counts", &occ),
                            SplitRanks(*slot_rows, ranks, 2, "slot_rows", &orows),
                            SplitRanks(*slot_dest, ranks, 2, "slot_dest", &odest),
                            SplitRanks(*group_sizes, ranks, 1, "group_sizes", &ogs),
                            SplitRanks(*stats, ranks, 1, "stats", &ost),
                            SplitRanks(*phases, ranks, 1, "phases", &oph)});
      e.failure()) {
    return e;
  }
  const ep::PeerView& v0 = *ranks.views[0];
  const int64_t T = ox.dims[0], H = ox.dims[1], K = oids.dims[1];
  const int64_t El = ogu.dims[0], F = ogu.dims[2] / 2;
  const auto n = [](int64_t v) { return std::to_string(v); };
  if (oids.dims[0] != T || ow.dims[0] != T || ow.dims[1] != K)
    return Fail("topk_ids and topk_weights must be [T=" + n(T) + ", k]");
  if (ogu.dims[1] != H || ogu.dims[2] != 2 * F || El * v0.num_ranks != num_experts)
    return Fail("w_gate_up must be [E/R=" + n(num_experts / v0.num_ranks) + ", H=" + n(H) +
                ", 2F] per rank");
  if (odn.dims[0] != El || odn.dims[1] != F || odn.dims[2] != H)
    return Fail("w_down must be [E/R, F=" + n(F) + ", H=" + n(H) + "] per rank");
  if (oy.dims[0] != T || oy.dims[1] != H) return Fail("y must be [T, H] per rank");
  if (oh.dims[0] != n_cap || oh.dims[1] != F)
    return Fail("h must be [n_cap=" + n(n_cap) + ", F=" + n(F) + "] per rank");
  if (occ.dims[0] < FusedChunkCountInts(T, num_experts))
    return Fail("chunk_counts must hold " + n(FusedChunkCountInts(T, num_experts)) + " ints");
  if (orows.dims[0] != T || orows.dims[1] != K || odest.dims[0] != T || odest.dims[1] != K)
    return Fail("slot_rows and slot_dest must be [T, k] per rank");
  if (ogs.dims[0] != El) return Fail("group_sizes must be [E/R=" + n(El) + "] per rank");
  if (ost.dims[0] != 4) return Fail("stats must be [4] per rank");
  if (oph.dims[0] != kFusedPhases)
    return Fail("phases must be [" + n(kFusedPhases) + "] per rank");
  const FusedForwardProblem problem{static_cast<int>(T), static_cast<int>(H),
                                    static_cast<int>(F), static_cast<int>(K),
                                    static_cast<int>(num_experts), static_cast<int>(n_cap),
                                    static_cast<int>(max_ctas)};
  if (std::string why = FusedForwardUnsupported(problem, v0.layout, v0.num_ranks); !why.empty())
    return Fail(why);
  const auto dims = [](const ffi::AnyBuffer& b) {
    auto d = b.dimensions();
    return std::vector<int64_t>(d.begin(), d.end());
  };
  // gate_up and y_sorted are kept per rank, any workspace; x_sorted by one rank alone.
  RankOperand ogate, oyrows;
  const bool keep_gate_up = gate_up->element_count() > 0;
  if (keep_gate_up) {
    if (auto e = SplitRanks(*gate_up, ranks, 2, "gate_up", &ogate); e.failure()) return e;
    if (ogate.dims[0] != n_cap || ogate.dims[1] != 2 * F)
      return Fail("gate_up must be [n_cap=" + n(n_cap) + ", 2F=" + n(2 * F) + "] per rank");
  }
  const bool keep_y_rows = y_sorted->element_count() > 0;
  if (keep_y_rows) {
    if (auto e = SplitRanks(*y_sorted, ranks, 2, "y_sorted", &oyrows); e.failure()) return e;
    if (oyrows.dims[0] != n_cap || oyrows.dims[1] != H)
      return Fail("y_sorted must be [n_cap=" + n(n_cap) + ", H=" + n(H) + "] per rank");
  }
  const bool keep_x_rows = x_sorted->element_count() > 0;
  if (keep_x_rows) {
    if (ranks.count != 1 || v0.num_ranks != 1)
      return Fail("x_sorted (the pool) is kept by a workspace of one rank only, this one has " +
                  n(v0.num_ranks));
    if (dims(*x_sorted) != std::vector<int64_t>{n_cap, H})
      return Fail("x_sorted must be [n_cap=" + n(n_cap) + ", H=" + n(H) + "]");
  }
  std::vector<FusedRankOperands> ops;
  for (int r = 0; r < ranks.count; ++r) {
    ops.push_back({ranks.views[r], ox.at(r), oids.at<int32_t>(r), ow.at<float>(r), ogu.at(r),
                   odn.at(r), oy.at(r), oh.at(r), occ.at<int32_t>(r), orows.at<int32_t>(r),
                   odest.at<int32_t>(r), ogs.at<int32_t>(r),
                   keep_x_rows ? x_sorted->untyped_data() : nullptr,
                   keep_gate_up ? ogate.at(r) : nullptr,
                   keep_y_rows ? oyrows.at(r) : nullptr, ost.at<int32_t>(r),
                   oph.at<int32_t>(r)});
  }
  if (std::string err = LaunchFusedForward(ops.data(), static_cast<int>(ops.size()),
                                           ranks.absent, problem, stream);
      !err.empty()) {
    return ffi::Error::Internal("jax_megamoe fused forward: " + err);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace megamoe::fused

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(MegamoeFusedMoeFwd, megamoe::fused::FusedMoeFwd,
                              megamoe::ep::EpAttributes(
                                  megamoe::ep::EpContext()
                                      .Arg<ffi::AnyBuffer>()  // x
                                      .Arg<ffi::Buffer<ffi::S32>>()  // topk_ids
                                      .Arg<ffi::Buffer<ffi::F32>>()  // topk_weights
                                      .Arg<ffi::AnyBuffer>()  // w_gate_up
                                      .Arg<ffi::AnyBuffer>()  // w_down
                                      .Ret<ffi::AnyBuffer>()  // y
                                      .Ret<ffi::AnyBuffer>()  // h (L1 output; a residual)
                                      .Ret<ffi::Buffer<ffi::S32>>()  // chunk_counts (scratch)
                                      .Ret<ffi::Buffer<ffi::S32>>()  // slot_rows (scratch)
                                      .Ret<ffi::Buffer<ffi::S32>>()  // slot_dest
                                      .Ret<ffi::Buffer<ffi::S32>>()  // group_sizes
                                      .Ret<ffi::Buffer<ffi::S32>>()  // stats
                                      .Ret<ffi::Buffer<ffi::S32>>()  // phases
                                      .Ret<ffi::AnyBuffer>()  // x_sorted (residual or [0])
                                      .Ret<ffi::AnyBuffer>()  // gate_up (residual or [0])
                                      .Ret<ffi::AnyBuffer>())  // y_sorted (residual or [0])
                                  .Attr<int64_t>("n_cap")
                                  .Attr<int64_t>("max_ctas"),
                              {ffi::Traits::kCmdBufferCompatible});

MEGAMOE_REGISTER_FFI("megamoe_fused_moe_fwd", "CUDA", MegamoeFusedMoeFwd);

// XLA FFI handler of the fused MoE forward (backend "fused"): binding and validation only; the
// kernel is ffi/impls/sm90_fused_moe.cu. Attributes: workspace_id (int64, a workspace with
// fused regions), num_experts (global E), n_cap (pool rows per rank), max_ctas (CTAs of the
// launch: > 0 at most that many, <= 0 every SM but -max_ctas), pow2 (FP8 h scales). On a
// virtual-rank workspace every operand carries a leading axis of one entry per rank. Residual
// outputs, each [0] when not kept: gate_up ([n_cap, 2F] per rank), y_sorted ([n_cap, H] per
// rank), y_comb ([T * k, H] per rank, several ranks only: the comb rows, for the fused backward)
// and x_sorted ([n_cap, H] per rank: the pool's rows; bf16 with one rank alone it replaces
// the pool region, otherwise the kernel copies the pool out; FP8: e4m3 rows, with their scales
// in x_sorted_scale [n_cap, H/128] float32, [0] for bf16).
//
// Element types, from x's: bfloat16 (recipe None; x_scale, w_gate_up_scale, w_down_scale and
// h_scale [0]) or float8_e4m3fn (recipes "fp8" / "fp8_pow2", attribute pow2; jax_megamoe/fp8.py):
// x e4m3 [T, H] with x_scale [T, H/128], w_gate_up e4m3 [E/R, 2F, H] (K-major, as
// cuda_fp8.quantize_weights lays it out) with w_gate_up_scale [E/R, H/128, 2F/128], w_down e4m3
// [E/R, H, F] with w_down_scale [E/R, F/128, H/128]; h (scratch) e4m3 [n_cap, F] with h_scale
// [F/128, FusedScalePitch(n_cap)]; y bf16.
#include <cuda_bf16.h>

#include <string>
#include <vector>

#include "ffi/comm/peer_signal.cuh"
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
  return ffi::Error::InvalidArgument("jax_megamoe fused forward: " + message);
}

ffi::Error FusedMoeFwd(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                       ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> weights,
                       ffi::AnyBuffer w_gate_up, ffi::AnyBuffer w_down,
                       ffi::Buffer<ffi::F32> x_scale, ffi::Buffer<ffi::F32> w_gate_up_scale,
                       ffi::Buffer<ffi::F32> w_down_scale,
                       ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> h,
                       ffi::Result<ffi::Buffer<ffi::S32>> scratch,
                       ffi::Result<ffi::Buffer<ffi::S32>> slot_rows,
                       ffi::Result<ffi::Buffer<ffi::S32>> slot_dest,
                       ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,
                       ffi::Result<ffi::Buffer<ffi::S32>> stats,
                       ffi::Result<ffi::Buffer<ffi::S32>> phases,
                       ffi::Result<ffi::AnyBuffer> x_sorted, ffi::Result<ffi::AnyBuffer> gate_up,
                       ffi::Result<ffi::AnyBuffer> y_sorted, ffi::Result<ffi::AnyBuffer> y_comb,
                       ffi::Result<ffi::Buffer<ffi::F32>> h_scale,
                       ffi::Result<ffi::Buffer<ffi::F32>> x_sorted_scale, int64_t workspace_id,
                       int64_t num_experts, int64_t n_cap, int64_t max_ctas, int64_t pow2) {
  LocalRanks ranks;
  if (auto e = ep::ResolveRanks(workspace_id, ordinal, &ranks); e.failure()) return e;
  const bool fp8 = x.element_type() == ffi::DataType::F8E4M3FN;
  const ffi::DataType elem = fp8 ? ffi::DataType::F8E4M3FN : ffi::DataType::BF16;
  const char* elem_name = fp8 ? "float8_e4m3fn (x is)" : "bfloat16";
  if (std::string why = DtypeMismatch({{x.element_type(), "x"},
                                       {w_gate_up.element_type(), "w_gate_up"},
                                       {w_down.element_type(), "w_down"},
                                       {h->element_type(), "h"}},
                                      elem, elem_name);
      !why.empty())
    return Fail(why);
  if (std::string why = DtypeMismatch({{y->element_type(), "y"},
                                       {gate_up->element_type(), "gate_up"},
                                       {y_sorted->element_type(), "y_sorted"},
                                       {y_comb->element_type(), "y_comb"}},
                                      ffi::DataType::BF16, "bfloat16");
      !why.empty())
    return Fail(why);
  if (!fp8 && (x_scale.element_count() != 0 || w_gate_up_scale.element_count() != 0 ||
               w_down_scale.element_count() != 0 || h_scale->element_count() != 0 ||
               x_sorted_scale->element_count() != 0))
    return Fail("x_scale, w_gate_up_scale, w_down_scale, h_scale and x_sorted_scale must be [0] "
                "for bfloat16");
  RankOperand ox, oids, ow, ogu, odn, oy, oh;
  RoutingOutputs routing;
  if (auto e = FirstFailure({SplitRanks(x, ranks, 2, "x", &ox),
                            SplitRanks(ids, ranks, 2, "topk_ids", &oids),
                            SplitRanks(weights, ranks, 2, "topk_weights", &ow),
                            SplitRanks(w_gate_up, ranks, 3, "w_gate_up", &ogu),
                            SplitRanks(w_down, ranks, 3, "w_down", &odn),
                            SplitRanks(*y, ranks, 2, "y", &oy),
                            SplitRanks(*h, ranks, 2, "h", &oh),
                            SplitRoutingOutputs(ranks, *scratch, *slot_rows, *slot_dest,
                                                *group_sizes, *stats, *phases, &routing)});
      e.failure()) {
    return e;
  }
  const ep::PeerView& v0 = *ranks.views[0];
  const int64_t T = ox.dims[0], H = ox.dims[1], K = oids.dims[1];
  // bf16 weights [E/R, H, 2F] and [E/R, F, H]; FP8 K-major [E/R, 2F, H] and [E/R, H, F].
  const int64_t El = ogu.dims[0], F = (fp8 ? ogu.dims[1] : ogu.dims[2]) / 2;
  const auto n = [](int64_t v) { return std::to_string(v); };
  if (oids.dims[0] != T || !DimsAre(ow, {T, K}))
    return Fail("topk_ids and topk_weights must be [T=" + n(T) + ", k]");
  if (El * v0.num_ranks != num_experts ||
      !(fp8 ? DimsAre(ogu, {El, 2 * F, H}) : DimsAre(ogu, {El, H, 2 * F})))
    return Fail("w_gate_up must be [E/R=" + n(num_experts / v0.num_ranks) +
                (fp8 ? ", 2F, H=" + n(H) : ", H=" + n(H) + ", 2F") + "] per rank");
  if (!(fp8 ? DimsAre(odn, {El, H, F}) : DimsAre(odn, {El, F, H})))
    return Fail("w_down must be [E/R, " + std::string(fp8 ? "H=" + n(H) + ", F=" + n(F)
                                                          : "F=" + n(F) + ", H=" + n(H)) +
                "] per rank");
  RankOperand oxs, ogus, odns, ohs;
  if (fp8) {
    if (auto e = FirstFailure({SplitRanks(x_scale, ranks, 2, "x_scale", &oxs),
                              SplitRanks(w_gate_up_scale, ranks, 3, "w_gate_up_scale", &ogus),
                              SplitRanks(w_down_scale, ranks, 3, "w_down_scale", &odns),
                              SplitRanks(*h_scale, ranks, 2, "h_scale", &ohs)});
        e.failure()) {
      return e;
    }
    if (H % 128 || F % 128) return Fail("FP8 needs H and F multiples of 128");
    if (!DimsAre(oxs, {T, H / 128}))
      return Fail("x_scale must be [T=" + n(T) + ", H/128=" + n(H / 128) + "] per rank");
    if (!DimsAre(ogus, {El, H / 128, 2 * F / 128}))
      return Fail("w_gate_up_scale must be [E/R, H/128, 2F/128] per rank");
    if (!DimsAre(odns, {El, F / 128, H / 128}))
      return Fail("w_down_scale must be [E/R, F/128, H/128] per rank");
    if (!DimsAre(ohs, {F / 128, FusedScalePitch(n_cap)}))
      return Fail("h_scale must be [F/128=" + n(F / 128) + ", " + n(FusedScalePitch(n_cap)) +
                  "] per rank");
  }
  if (!DimsAre(oy, {T, H})) return Fail("y must be [T, H] per rank");
  if (!DimsAre(oh, {n_cap, F}))
    return Fail("h must be [n_cap=" + n(n_cap) + ", F=" + n(F) + "] per rank");
  if (std::string why = RoutingOutputsMismatch(routing, T, K, El, num_experts); !why.empty())
    return Fail(why);
  FusedForwardProblem problem;
  if (std::string why = FusedProblemFor(T, H, F, K, num_experts, n_cap, max_ctas, fp8, pow2 != 0,
                                        v0, &problem);
      !why.empty())
    return Fail(why);
  // gate_up, y_sorted and x_sorted (FP8: with x_sorted_scale) are kept per rank, any workspace.
  RankOperand ogate, oyrows, oxrows, oxscale;
  const bool keep_gate_up = gate_up->element_count() > 0;
  if (keep_gate_up) {
    if (auto e = SplitRanks(*gate_up, ranks, 2, "gate_up", &ogate); e.failure()) return e;
    if (!DimsAre(ogate, {n_cap, 2 * F}))
      return Fail("gate_up must be [n_cap=" + n(n_cap) + ", 2F=" + n(2 * F) + "] per rank");
  }
  const bool keep_y_rows = y_sorted->element_count() > 0;
  if (keep_y_rows) {
    if (auto e = SplitRanks(*y_sorted, ranks, 2, "y_sorted", &oyrows); e.failure()) return e;
    if (!DimsAre(oyrows, {n_cap, H}))
      return Fail("y_sorted must be [n_cap=" + n(n_cap) + ", H=" + n(H) + "] per rank");
  }
  // y_comb: several ranks only (one rank alone, y_sorted is the comb buffer).
  RankOperand oycomb;
  const bool keep_y_comb = y_comb->element_count() > 0;
  if (keep_y_comb) {
    if (v0.num_ranks == 1 && ranks.count == 1)
      return Fail("y_comb is kept with several ranks only (one rank alone, y_sorted is the comb "
                  "buffer): pass [0]");
    if (auto e = SplitRanks(*y_comb, ranks, 2, "y_comb", &oycomb); e.failure()) return e;
    if (!DimsAre(oycomb, {T * K, H}))
      return Fail("y_comb must be [T * k=" + n(T * K) + ", H=" + n(H) + "] per rank");
  }
  const bool keep_x_rows = x_sorted->element_count() > 0;
  if (keep_x_rows) {
    if (std::string why = DtypeMismatch({{x_sorted->element_type(), "x_sorted"}}, elem, elem_name);
        !why.empty())
      return Fail(why);
    if (auto e = SplitRanks(*x_sorted, ranks, 2, "x_sorted", &oxrows); e.failure()) return e;
    if (!DimsAre(oxrows, {n_cap, H}))
      return Fail("x_sorted must be [n_cap=" + n(n_cap) + ", H=" + n(H) + "] per rank");
  }
  if (fp8 && (keep_x_rows || x_sorted_scale->element_count() > 0)) {
    if (auto e = SplitRanks(*x_sorted_scale, ranks, 2, "x_sorted_scale", &oxscale); e.failure())
      return e;
    if (!keep_x_rows || !DimsAre(oxscale, {n_cap, H / 128}))
      return Fail("with FP8 x_sorted [n_cap, H] comes with x_sorted_scale [n_cap=" + n(n_cap) +
                  ", H/128=" + n(H / 128) + "] per rank, and neither without the other");
  }
  std::vector<FusedRankOperands> ops;
  for (int r = 0; r < ranks.count; ++r) {
    ops.push_back({ranks.views[r], ox.at(r), fp8 ? oxs.at<float>(r) : nullptr,
                   oids.at<int32_t>(r), ow.at<float>(r), ogu.at(r),
                   fp8 ? ogus.at<float>(r) : nullptr, odn.at(r),
                   fp8 ? odns.at<float>(r) : nullptr, oy.at(r), oh.at(r),
                   fp8 ? ohs.at<float>(r) : nullptr, routing.scratch.at<int32_t>(r),
                   routing.slot_rows.at<int32_t>(r), routing.slot_dest.at<int32_t>(r),
                   routing.group_sizes.at<int32_t>(r),
                   keep_x_rows ? oxrows.at(r) : nullptr,
                   fp8 && keep_x_rows ? oxscale.at<float>(r) : nullptr,
                   keep_gate_up ? ogate.at(r) : nullptr,
                   keep_y_rows ? oyrows.at(r) : nullptr,
                   keep_y_comb ? oycomb.at(r) : nullptr, routing.stats.at<int32_t>(r),
                   routing.phases.at<int32_t>(r)});
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
                                      .Arg<ffi::Buffer<ffi::F32>>()  // x_scale (FP8, or [0])
                                      .Arg<ffi::Buffer<ffi::F32>>()  // w_gate_up_scale
                                      .Arg<ffi::Buffer<ffi::F32>>()  // w_down_scale
                                      .Ret<ffi::AnyBuffer>()  // y
                                      .Ret<ffi::AnyBuffer>()  // h (L1 output; a residual)
                                      .Ret<ffi::Buffer<ffi::S32>>()  // scratch (chunk counts, copy plan)
                                      .Ret<ffi::Buffer<ffi::S32>>()  // slot_rows (scratch)
                                      .Ret<ffi::Buffer<ffi::S32>>()  // slot_dest
                                      .Ret<ffi::Buffer<ffi::S32>>()  // group_sizes
                                      .Ret<ffi::Buffer<ffi::S32>>()  // stats
                                      .Ret<ffi::Buffer<ffi::S32>>()  // phases
                                      .Ret<ffi::AnyBuffer>()  // x_sorted (residual or [0])
                                      .Ret<ffi::AnyBuffer>()  // gate_up (residual or [0])
                                      .Ret<ffi::AnyBuffer>()  // y_sorted (residual or [0])
                                      .Ret<ffi::AnyBuffer>()  // y_comb (residual or [0])
                                      .Ret<ffi::Buffer<ffi::F32>>()  // h_scale (FP8, or [0])
                                      .Ret<ffi::Buffer<ffi::F32>>())  // x_sorted_scale (or [0])
                                  .Attr<int64_t>("n_cap")
                                  .Attr<int64_t>("max_ctas")
                                  .Attr<int64_t>("pow2"),
                              {ffi::Traits::kCmdBufferCompatible});

MEGAMOE_REGISTER_FFI("megamoe_fused_moe_fwd", "CUDA", MegamoeFusedMoeFwd);

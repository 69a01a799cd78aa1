// What the fused forward's and backward's handlers check alike. Both run the routing (the
// backward runs it again), so both write the same routing outputs, and both launch one
// FusedForwardProblem. Each handler adds its own "jax_megamoe fused forward/backward: " prefix
// to the messages returned here.
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "ffi/handlers/ep_ops.h"
#include "ffi/heuristics/fused_debug.h"
#include "ffi/impls/fused_moe.h"

namespace megamoe::fused {

namespace ffi = xla::ffi;

// "" when every operand's element type is want; otherwise "<name> must be <want_name>" of the
// first that is not.
inline std::string DtypeMismatch(
    std::initializer_list<std::pair<ffi::DataType, const char*>> operands, ffi::DataType want,
    const char* want_name) {
  for (const auto& [dtype, name] : operands) {
    if (dtype != want) return std::string(name) + " must be " + want_name;
  }
  return "";
}

// Whether one rank's leading dimensions of o are want.
inline bool DimsAre(const ep::RankOperand& o, std::initializer_list<int64_t> want) {
  return std::equal(want.begin(), want.end(), o.dims);
}

// The routing's outputs, one rank's view each.
struct RoutingOutputs {
  ep::RankOperand scratch, slot_rows, slot_dest, group_sizes, stats, phases;
};

// Splits the six routing outputs per rank into *out.
inline ffi::Error SplitRoutingOutputs(const ep::LocalRanks& ranks,
                                      const ffi::Buffer<ffi::S32>& scratch,
                                      const ffi::Buffer<ffi::S32>& slot_rows,
                                      const ffi::Buffer<ffi::S32>& slot_dest,
                                      const ffi::Buffer<ffi::S32>& group_sizes,
                                      const ffi::Buffer<ffi::S32>& stats,
                                      const ffi::Buffer<ffi::S32>& phases, RoutingOutputs* out) {
  return ep::FirstFailure({ep::SplitRanks(scratch, ranks, 1, "scratch", &out->scratch),
                           ep::SplitRanks(slot_rows, ranks, 2, "slot_rows", &out->slot_rows),
                           ep::SplitRanks(slot_dest, ranks, 2, "slot_dest", &out->slot_dest),
                           ep::SplitRanks(group_sizes, ranks, 1, "group_sizes",
                                          &out->group_sizes),
                           ep::SplitRanks(stats, ranks, 1, "stats", &out->stats),
                           ep::SplitRanks(phases, ranks, 1, "phases", &out->phases)});
}

// "" when the routing outputs have the shapes the kernel writes for T tokens, top-k, E experts
// and El = E/R local experts; otherwise what is wrong.
inline std::string RoutingOutputsMismatch(const RoutingOutputs& o, int64_t T, int64_t K,
                                          int64_t El, int64_t num_experts) {
  const auto n = [](int64_t v) { return std::to_string(v); };
  // Exactly: the copy plan's int4 rows of every stacked rank stay 16-byte aligned.
  const int64_t scratch_ints = FusedScratchInts(T, num_experts, K);
  if (o.scratch.dims[0] != scratch_ints)
    return "scratch must be [" + n(scratch_ints) + "] ints per rank, it is [" +
           n(o.scratch.dims[0]) + "]";
  if (!DimsAre(o.slot_rows, {T, K}) || !DimsAre(o.slot_dest, {T, K}))
    return "slot_rows and slot_dest must be [T=" + n(T) + ", k=" + n(K) + "] per rank";
  if (o.group_sizes.dims[0] != El) return "group_sizes must be [E/R=" + n(El) + "] per rank";
  if (o.stats.dims[0] != 4) return "stats must be [4] per rank";
  if (o.phases.dims[0] != kFusedPhases)
    return "phases must be [" + n(kFusedPhases) + "] per rank";
  return "";
}

// Fills *problem (MEGAMOE_FUSED_DEBUG read here, at every call) and returns "" when the kernel
// runs it on this workspace; otherwise why not.
inline std::string FusedProblemFor(int64_t T, int64_t H, int64_t F, int64_t K,
                                   int64_t num_experts, int64_t n_cap, int64_t max_ctas, bool fp8,
                                   bool pow2, const ep::PeerView& view,
                                   FusedForwardProblem* problem) {
  int debug = 0;  // fault localisation only, unset normally
  if (std::string err = heuristics::FusedDebugBits(&debug); !err.empty()) return err;
  *problem = FusedForwardProblem{static_cast<int>(T), static_cast<int>(H),
                                 static_cast<int>(F), static_cast<int>(K),
                                 static_cast<int>(num_experts), static_cast<int>(n_cap),
                                 static_cast<int>(max_ctas), fp8 ? 1 : 0, pow2 ? 1 : 0, debug};
  return FusedForwardUnsupported(*problem, view.layout, view.num_ranks);
}

}  // namespace megamoe::fused

// Host-side counts of the launches of kernels that a heuristic picks over another path, so that
// a test can tell which path a call took (Python: jax_megamoe._ffi.launch_counts()). A handler
// counts when it enqueues the kernels: a CUDA graph that XLA replays does not count again.
#pragma once

#include <cstddef>
#include <cstdint>

namespace megamoe {

enum class CountedLaunch : int {
  kMoeDgradCore = 0,  // backend cuda's MLP backward on the dgrad core (ffi/impls/moe_dgrad.h)
  kFusedL2RowsByTma,  // the fused forward with L2's rows by TMA (ffi/heuristics/fused_l2_store.h)
  kFusedL1NMajor,     // the fused forward with L1 N-block-major (ffi/heuristics/fused_tile_order.h)
  kNumCounted,
};

// The Python names of the counts, in CountedLaunch order.
inline constexpr const char* kCountedLaunchNames[] = {"moe_dgrad_core", "fused_l2_rows_by_tma",
                                                     "fused_l1_n_major"};
static_assert(sizeof(kCountedLaunchNames) / sizeof(kCountedLaunchNames[0]) ==
                  static_cast<size_t>(CountedLaunch::kNumCounted),
              "one Python name per counted launch");

void CountLaunch(CountedLaunch what);
int64_t LaunchCount(CountedLaunch what);

}  // namespace megamoe

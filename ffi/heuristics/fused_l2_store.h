// How the fused forward's L2 epilogue stores its rows when they are contiguous in pool order
// (one rank alone: the comb buffer's row of a slot is its pool row), decided here for every
// launch, with an environment override for benchmarking:
//   MEGAMOE_FUSED_L2_TMA   "0": 16-byte generic stores through the per-row destinations, as
//                          with several ranks; "1": TMA boxes of the staged tile
//                          (sm90::EngineParams::l2_rows); unset: kFusedL2RowsByTmaDefault;
//                          anything else refuses the call.
// Why TMA: the engine's cycle accounting (benchmarks/kernels/FUSED_CORE_NOTES.md, session 31)
// put the generic stores of a 30B L2 tile at ~2,800 cycles with the tensor cores idle; by TMA
// the warpgroup waits only for TMA's shared-memory reads and the writes drain beside the next
// tile. With several ranks the rows of a tile go to their sources' comb buffers, row by row,
// and per-row TMA ops are op-bound (FUSED_CORE_NOTES, run 1): generic stores stay there.
#pragma once

#include <string>

#include "ffi/heuristics/env_override.h"

namespace megamoe::heuristics {

// Measured (benchmarks/RESULTS.md, session 31, one H100): the harness's L2 alone 0.671 -> 0.635
// ms at 30B and 3.645 -> 2.986 at 235B. The fused kernel's "on" figures of sessions 31-35 are
// void: until session 35 "1" left the default (off) in place, so both modes ran the generic
// stores. The fused kernel with it (session 36, H100, median of three rounds' ratios): 30B bf16
// -1.5%, 235B bf16 -2.6% (within its noise), 30B fp8 -2.8%, 235B fp8 -0.6%. On since session 37,
// after the one-rank fused suite passed with it forced on (H100: the bitwise test of the two
// modes 6 passed, 53 one-rank fused and weight-block tests passed).
inline constexpr bool kFusedL2RowsByTmaDefault = true;

// Whether L2's rows go out by TMA (one rank alone only). Returns an error text for a bad
// override, else "" and sets *use.
inline std::string FusedL2RowsByTma(bool one_rank, bool* use) {
  char choice;
  if (std::string err = OneCharOverride("MEGAMOE_FUSED_L2_TMA", "01", &choice); !err.empty())
    return err;
  *use = one_rank && (choice == '\0' ? kFusedL2RowsByTmaDefault : choice == '1');
  return "";
}

}  // namespace megamoe::heuristics

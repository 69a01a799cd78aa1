// The L2 cache priorities of the fused forward's memory streams, decided here for every launch,
// with an environment override for benchmarking:
//   MEGAMOE_FUSED_L2_HINTS   an integer 0..15, the sum of the streams to mark (kFusedHint*);
//                            unset or empty: kFusedL2HintsDefault; anything else refuses the
//                            call.
// Why: the engine's cycle accounting inside the fused kernel (benchmarks/RESULTS.md, session 32)
// put the 30B bf16 mainloop at ~1,090 cycles a stage with the rows copied before the tiles, and at
// 1,260-1,690 with the copy beside them (H100s): the copy streams ~1 GB through the L2 (each
// token row read once per slot, 512 MB written), while the tiles depend on the L2 keeping their
// expert's weight slices (6 MB at 30B) between its M-blocks. Marking the copy's streams
// evict-first and the weights evict-last asks the L2 to keep what is read again.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <string>

namespace megamoe::heuristics {

enum FusedL2Hint : int32_t {
  kFusedHintWeightsLast = 1,  // the GEMMs' B (expert weights) TMA loads: evict-last
  kFusedHintRowsFirst = 2,    // the GEMMs' A (pool rows, h) TMA loads: evict-first
  kFusedHintCopyReadFirst = 4,   // the row copy's token-row loads: evict-first
  kFusedHintCopyWriteFirst = 8,  // the row copy's pool-row stores: evict-first
  kFusedHintAll = 15
};

// Not measured on an H200 yet: today's behaviour (no hint) until it is.
inline constexpr int32_t kFusedL2HintsDefault = 0;

// *hints for this launch, or an error naming a value that is not an integer in [0, 15].
inline std::string FusedL2Hints(int32_t* hints) {
  *hints = kFusedL2HintsDefault;
  const char* env = std::getenv("MEGAMOE_FUSED_L2_HINTS");
  if (env == nullptr || env[0] == '\0') return "";
  char* end = nullptr;
  const long v = std::strtol(env, &end, 10);
  if (*end != '\0' || v < 0 || v > kFusedHintAll)
    return std::string("MEGAMOE_FUSED_L2_HINTS must be an integer in [0, 15], got '") + env + "'";
  *hints = static_cast<int32_t>(v);
  return "";
}

}  // namespace megamoe::heuristics

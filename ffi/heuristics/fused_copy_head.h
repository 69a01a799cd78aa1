// How much of the fused forward's row copy (its dispatch at EP = 1, its NVLink traffic at EP > 1)
// runs before the GEMMs start, decided here for every launch, with an environment override for
// benchmarking:
//   MEGAMOE_FUSED_COPY_HEAD   an integer percent 0..100 of this rank's rows in plan order that
//                             every warp copies before the tile engine starts; the rest is
//                             copied beside the tiles by the producer warpgroup's two free
//                             warps. 100: the whole copy first (nothing overlapped). Unset or
//                             empty: the default below; anything else refuses the call.
// The plan is in pool order (ffi/impls/sm90_fused_moe.cu, phase 4), so the head holds the
// first tiles' rows and gives the two copy warps per CTA a lead over the tiles, which consume
// the pool in the same order.
#pragma once

#include <cstdint>
#include <string>

#include "ffi/heuristics/env_override.h"

namespace megamoe::heuristics {

// Measured (benchmarks/RESULTS.md, session 13 call 3; fused_phases.py --copy-heads, one H200,
// EP = 1, 16,384 tokens, kernel ms at head 100 / 25 / 12 / 0): 30B bf16 2.585 / 2.431 / 2.403 /
// 2.391; 235B bf16 9.278 / 8.817 / 8.760 / 8.786; 30B fp8 2.010 / 1.926 / 1.909 / 1.915; 235B
// fp8 6.414 / 6.244 / 6.249 / 6.233. 12 is within 0.03 ms of the best everywhere; a first wave
// of L1 tiles needs ~2% of the rows at 30B, the rest of the head is the copy warps' lead.
// Not measured where rows cross NVLink (EP over GPUs): the default applies there too, and
// MEGAMOE_FUSED_COPY_HEAD=100 copies everything before the GEMMs.
// The forward only: the backward's pass copies every w * dy row first, in token order (its
// copy computes d topk_weights too; on the two copy warps beside the tiles it starved them:
// session 20, 30B bwd kernel 4.70 ms at head 12 against 2.85 at 100), and ignores the variable.
inline constexpr int kFusedCopyHeadPercent = 12;

// Read at every call (a process may A/B several values): *percent for this launch
// (kFusedCopyHeadPercent unless overridden), or an error naming a value that is not an integer
// in [0, 100].
inline std::string FusedCopyHeadPercent(int32_t* percent) {
  int value = kFusedCopyHeadPercent;
  std::string err = IntOverride("MEGAMOE_FUSED_COPY_HEAD", 0, 100, "an integer percent", &value);
  *percent = value;
  return err;
}

}  // namespace megamoe::heuristics

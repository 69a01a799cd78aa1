// The order of the fused kernel's L1 tiles inside an expert (ExpertTileWalk::decode's n_major),
// decided here for every launch, with an environment override for benchmarking:
//   MEGAMOE_FUSED_L1_ORDER   "m": M-block-major (N fastest: consecutive tiles share A rows),
//                            "n": N-block-major (M fastest: consecutive tiles share a weight
//                            slice); unset or empty: the default below; anything else
//                            refuses the call (a mistyped override must not time the default).
// Measured:
// - the core harness (benchmarks/kernels/FUSED_CORE_NOTES.md, run 3, bf16 L1): at 30B (an
//   expert's gate/up weights 6 MiB) M-major is faster (617 vs 607 TFLOP/s); at 235B (24 MiB)
//   N-major is (661 vs 613): a wave of M-major tiles then needs more than one expert's slice set
//   at once and thrashes the 50 MB L2;
// - the layer's kernel (benchmarks/RESULTS.md, session 12, fused_phases.py, GEMM tiles phase):
//   235B bf16 7.94 ms N-major vs 8.23 M-major; 30B bf16 2.10 either way; 235B fp8 (12 MiB)
//   5.30 N-major vs 5.36 M-major, inside the run-to-run spread of that phase (~4%), so fp8 at
//   235B stays M-major.
// The threshold sits between the measured sizes.
#pragma once

#include <cstdint>
#include <string>

#include "ffi/heuristics/env_override.h"

namespace megamoe::heuristics {

// One expert's L1 weight bytes above which L1 runs N-block-major.
inline constexpr int64_t kFusedL1NMajorSliceBytes = int64_t(16) << 20;

inline bool DefaultFusedL1NMajor(int64_t hidden, int64_t ffn, bool fp8) {
  const int64_t slice_bytes = 2 * ffn * hidden * (fp8 ? 1 : 2);
  return slice_bytes > kFusedL1NMajorSliceBytes;
}

// Read whenever the handler runs (a process may A/B both orders; a CUDA graph that XLA replays
// keeps the order it was recorded with). Returns an error text for a bad override, else "" and
// sets *n_major.
inline std::string FusedL1NMajor(int64_t hidden, int64_t ffn, bool fp8, bool* n_major) {
  char choice;
  if (std::string err = OneCharOverride("MEGAMOE_FUSED_L1_ORDER", "mn", &choice); !err.empty())
    return err;
  *n_major = choice == '\0' ? DefaultFusedL1NMajor(hidden, ffn, fp8) : choice == 'n';
  return "";
}

}  // namespace megamoe::heuristics

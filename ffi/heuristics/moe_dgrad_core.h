// Whether backend cuda's grouped-MLP backward (bf16) runs its two dgrad GEMMs and the SwiGLU
// backward on the tile engine's dgrad core (ffi/impls/sm90_moe_dgrad.cu: one kernel for
// dh + SwiGLU backward, one for dx) or as two CUTLASS grouped GEMMs with the SwiGLU-backward
// kernel between them; decided here for every call, with an environment override for
// benchmarking and A/B tests:
//   MEGAMOE_DGRAD_CORE   "0": the CUTLASS path; "1": the core wherever it takes the shape;
//                        unset or empty: the default below; anything else refuses the call.
// Measured (benchmarks/RESULTS.md, session 16, one H200, 131,072 rows over 128 experts):
// - 30B (H 2048, F 768; an expert's w_gate_up 6 MiB): the core 2.09-2.16 ms for both dgrads and
//   the SwiGLU backward, against CUTLASS's 2.15 ms for the two GEMMs plus ~0.25 ms for the
//   SwiGLU backward;
// - 235B (H 4096, F 1536; 24 MiB): the core 9.0-10.0 ms against 8.28 + ~0.5: slower.
// So the default takes the core up to the forward's 16 MiB slice threshold (fused_tile_order.h),
// between the measured sizes. The dx tiles follow the forward L1's order rule (same weights).
#pragma once

#include <cstdint>
#include <string>

#include "ffi/heuristics/env_override.h"
#include "ffi/heuristics/fused_tile_order.h"

namespace megamoe::heuristics {

inline bool DefaultMoeDgradCore(int64_t hidden, int64_t ffn) {
  return 2 * ffn * hidden * 2 <= kFusedL1NMajorSliceBytes;
}

// Read whenever the handler runs. XLA may replay the call from a CUDA graph without running the
// handler (until it records the graph again, e.g. for new buffer addresses), so a live
// executable may keep the path it was recorded with: to A/B, set the variable and clear JAX's
// caches (jax.clear_caches()) or use separate processes. `takes`: the core supports the shape.
// Returns an error text for a bad override, else "" and sets *use.
inline std::string UseMoeDgradCore(bool takes, int64_t hidden, int64_t ffn, bool* use) {
  char choice;
  if (std::string err = OneCharOverride("MEGAMOE_DGRAD_CORE", "01", &choice); !err.empty())
    return err;
  *use = takes && (choice == '\0' ? DefaultMoeDgradCore(hidden, ffn) : choice == '1');
  return "";
}

// The dx tiles' order inside an expert (ExpertTileWalk::decode's n_major).
inline bool MoeDgradDxNMajor(int64_t hidden, int64_t ffn) {
  return DefaultFusedL1NMajor(hidden, ffn, /*fp8=*/false);
}

}  // namespace megamoe::heuristics

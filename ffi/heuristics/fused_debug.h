// The fused kernels' debug knob, read by both fused handlers (forward and backward) at every
// call: MEGAMOE_FUSED_DEBUG, an integer of ffi/impls/fused_moe.h's kFusedDebug* bits; unset,
// empty or 0: the normal kernel. Fault localisation and benchmarks only (fused_phases.py
// --debug-bits, fused_fp8_debug.py). A value that is not such an integer refuses the call by
// name: it used to be read with atoi, so "0x2" ran the normal kernel and "1.5" bit 1 unnoticed.
#pragma once

#include <string>

#include "ffi/heuristics/env_override.h"
#include "ffi/impls/fused_moe.h"

namespace megamoe::heuristics {

inline std::string FusedDebugBits(int* bits) {
  *bits = 0;
  return IntOverride("MEGAMOE_FUSED_DEBUG", 0, fused::kFusedDebugAllBits,
                     "an integer of fused_moe.h's kFusedDebug* bits", bits);
}

}  // namespace megamoe::heuristics

// The blockwise-FP8 scale rule (recipe "fp8", jax_megamoe/fp8.py is its definition), one copy for
// the CUDA kernels and the CPU handlers so that they cannot drift apart.
#pragma once

#include <cfloat>
#include <cmath>

#include "ffi/common/host_device.h"

namespace megamoe {

// s = max(amax * fp32(1/448), FLT_MIN): a product with the rounded reciprocal (what XLA computes
// for amax / 448 too), floored after it so that it is never denormal (flushed to 0 under FTZ, an
// all-zero block would give 0 / 0). pow2: rounded up to a power of two, exactly (frexp).
MEGAMOE_HOST_DEVICE inline float Fp8BlockScale(float amax, bool pow2) {
  float s = fmaxf(amax * (1.0f / 448.0f), FLT_MIN);
  if (pow2) {
    int e;
    const float m = frexpf(s, &e);  // s = m 2^e, m in [0.5, 1)
    s = ldexpf(1.0f, m == 0.5f ? e - 1 : e);
  }
  return s;
}

}  // namespace megamoe

// The blockwise-FP8 block layouts and scale rule (recipe "fp8", DeepSeek-V3; jax_megamoe/fp8.py
// is the definition), one copy for the CUDA kernels and the CPU handlers so that they cannot
// drift apart. e4m3 values, one fp32 scale per block:
//   rows (activations, gradients)  x [N, K] -> q [N, K], scale [N, K/128]: 1 x 128 along K
//   weights w [E, K, P]            -> q [E, P, K] (K-major), scale [E, K/128, P/128]: 128 x 128;
//                                     for dy @ w^T q [E, K, P], scale [E, P/128, K/128]
//   weight-gradient operand        x [N, C] -> q [C, L], scale [L/128, C]: 128 x 1 down the rows
//                                     of each group, stored transposed, each group's rows padded
//                                     to whole blocks (columns [padded[g], padded[g + 1]),
//                                     scheduler/group_offsets.h), L = WgradPaddedLength(N, E)
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>

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

// Columns of a weight-gradient operand of `rows` rows in `num_groups` groups: enough for every
// group's rows padded to a multiple of 128, whatever the group sizes.
MEGAMOE_HOST_DEVICE inline constexpr int64_t WgradPaddedLength(int64_t rows, int64_t num_groups) {
  return (rows + 127) / 128 * 128 + 128 * num_groups;
}

}  // namespace megamoe

// The grid of the grid-strided element-wise kernels: one thread per item up to 16 blocks per SM
// of an H200 (132 SMs), past which threads loop.
#pragma once

#include <cstdint>

namespace megamoe::heuristics {

inline int ElementwiseGrid(int64_t work, int threads) {
  const int64_t blocks = (work + threads - 1) / threads;
  return int(blocks < 1 ? 1 : (blocks > 132 * 16 ? 132 * 16 : blocks));
}

}  // namespace megamoe::heuristics

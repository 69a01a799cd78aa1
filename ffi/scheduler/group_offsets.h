// The expert groups of rows sorted by expert, from their sizes on the device: every grouped
// kernel walks its groups (and a group's 128-row blocks) from these offsets, so the host never
// learns the group sizes.
//   offsets [E + 1]  offsets[0] = 0, offsets[g + 1] = min(offsets[g] + max(group_sizes[g], 0),
//                    rows): group g's rows are [offsets[g], offsets[g + 1]), clamped to the rows
//                    that exist (a sum past `rows` is a caller error; clamping keeps every kernel
//                    inside its buffers).
//   padded [E + 1]   padded[0] = 0, padded[g + 1] = padded[g] + round_up(offsets[g + 1] -
//                    offsets[g], 128): group g's columns of a weight-gradient operand
//                    (layout/fp8_blocks.h), each group padded to whole 128-blocks.
// The host twins compute the same for the CPU handlers.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#ifdef __CUDACC__
#include <cuda_runtime.h>
#endif

namespace megamoe::grouped {

// Host: offsets of `e` groups of `sizes` over `n` rows.
inline std::vector<int64_t> HostGroupOffsets(const int32_t* sizes, int64_t e, int64_t n) {
  std::vector<int64_t> off(e + 1, 0);
  for (int64_t g = 0; g < e; ++g) off[g + 1] = std::min<int64_t>(off[g] + std::max(sizes[g], 0), n);
  return off;
}

// Host: the padded offsets of `offsets`.
inline std::vector<int64_t> HostPaddedOffsets(const std::vector<int64_t>& offsets) {
  std::vector<int64_t> padded(offsets.size(), 0);
  for (size_t g = 0; g + 1 < offsets.size(); ++g) {
    padded[g + 1] = padded[g] + (offsets[g + 1] - offsets[g] + 127) / 128 * 128;
  }
  return padded;
}

#ifdef __CUDACC__
// Device, enqueued on `stream`: offsets [E + 1] int32. Returns "" or what failed.
std::string GroupOffsets(const int32_t* group_sizes, int num_groups, int64_t rows,
                         int32_t* offsets, cudaStream_t stream);

// Device: offsets and padded, both [E + 1] int32.
std::string PaddedGroupOffsets(const int32_t* group_sizes, int num_groups, int64_t rows,
                               int32_t* offsets, int32_t* padded, cudaStream_t stream);

// In a kernel: the group g with padded[g] <= column < padded[g + 1] (column < padded[E]; empty
// groups own no columns).
__device__ __forceinline__ int GroupOfPaddedColumn(const int32_t* padded, int num_groups,
                                                   int32_t column) {
  int lo = 0, hi = num_groups - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (padded[mid] <= column) lo = mid; else hi = mid - 1;
  }
  return lo;
}
#endif

}  // namespace megamoe::grouped

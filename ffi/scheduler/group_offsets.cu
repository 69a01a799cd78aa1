// The group offsets from the group sizes on the device (scheduler/group_offsets.h): one block
// scans them.
#include <cub/block/block_scan.cuh>

#include "ffi/common/launch_error.h"
#include "ffi/scheduler/group_offsets.h"

namespace megamoe::grouped {
namespace {

// out[0] = 0, out[g + 1] = min(value(0) + ... + value(g), limit) for g < num_groups, by one block
// of kThreads threads (every thread calls it).
template <int kThreads, class Value>
__device__ void BlockInclusiveScan(int num_groups, Value value, int64_t limit,
                                   int32_t* __restrict__ out) {
  using Scan = cub::BlockScan<int64_t, kThreads>;
  __shared__ typename Scan::TempStorage temp;
  __shared__ int64_t carry;
  if (threadIdx.x == 0) {
    carry = 0;
    out[0] = 0;
  }
  __syncthreads();
  for (int base = 0; base < num_groups; base += kThreads) {
    const int g = base + threadIdx.x;
    int64_t v = g < num_groups ? value(g) : 0;
    int64_t inclusive, total;
    Scan(temp).InclusiveSum(v, inclusive, total);
    const int64_t c = carry;
    if (g < num_groups) out[g + 1] = int32_t(min(c + inclusive, limit));
    __syncthreads();
    if (threadIdx.x == 0) carry = c + total;
    __syncthreads();
  }
}

template <int kThreads>
__global__ void __launch_bounds__(kThreads) GroupOffsetsKernel(const int32_t* __restrict__ sizes,
                                                               int num_groups, int64_t rows,
                                                               int32_t* __restrict__ offsets) {
  BlockInclusiveScan<kThreads>(
      num_groups, [=](int g) { return int64_t(max(sizes[g], 0)); }, rows, offsets);
}

// Then each group's (clamped) row count rounded up to 128, scanned: the padded offsets.
template <int kThreads>
__global__ void __launch_bounds__(kThreads) PaddedOffsetsKernel(
    const int32_t* __restrict__ offsets, int num_groups, int32_t* __restrict__ padded) {
  BlockInclusiveScan<kThreads>(
      num_groups, [=](int g) { return int64_t(offsets[g + 1] - offsets[g] + 127) / 128 * 128; },
      INT32_MAX, padded);
}

}  // namespace

std::string GroupOffsets(const int32_t* group_sizes, int num_groups, int64_t rows,
                         int32_t* offsets, cudaStream_t stream) {
  GroupOffsetsKernel<256><<<1, 256, 0, stream>>>(group_sizes, num_groups, rows, offsets);
  return LastLaunchError("GroupOffsets launch");
}

std::string PaddedGroupOffsets(const int32_t* group_sizes, int num_groups, int64_t rows,
                               int32_t* offsets, int32_t* padded, cudaStream_t stream) {
  std::string err = GroupOffsets(group_sizes, num_groups, rows, offsets, stream);
  if (!err.empty()) return err;
  PaddedOffsetsKernel<256><<<1, 256, 0, stream>>>(offsets, num_groups, padded);
  return LastLaunchError("PaddedGroupOffsets launch");
}

}  // namespace megamoe::grouped

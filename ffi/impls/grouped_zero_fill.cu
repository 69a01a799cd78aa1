// Zero fills after the grouped GEMMs: see grouped_zero_fill.h.
#include "ffi/common/launch_error.h"
#include "ffi/heuristics/elementwise_grid.h"
#include "ffi/impls/grouped_zero_fill.h"

namespace megamoe::grouped {
namespace {

constexpr int kVec = 8;  // bf16 per 16-byte access

__global__ void ZeroPaddingRowsKernel(uint4* __restrict__ out, int64_t rows, int64_t col_vecs,
                                      const int32_t* __restrict__ offsets, int num_groups) {
  const int64_t begin = int64_t(offsets[num_groups]) * col_vecs, end = rows * col_vecs;
  for (int64_t i = begin + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < end;
       i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = make_uint4(0, 0, 0, 0);
  }
}

__global__ void ZeroEmptyGroupsKernel(uint4* __restrict__ out, int64_t vecs_per_group,
                                      const int32_t* __restrict__ offsets) {
  const int g = blockIdx.y;
  if (offsets[g + 1] != offsets[g]) return;
  uint4* slab = out + int64_t(g) * vecs_per_group;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < vecs_per_group;
       i += int64_t(gridDim.x) * blockDim.x) {
    slab[i] = make_uint4(0, 0, 0, 0);
  }
}

}  // namespace

std::string ZeroPaddingRows(void* out, int64_t rows, int64_t cols, const int32_t* offsets,
                            int num_groups, cudaStream_t stream) {
  const int64_t col_vecs = cols / kVec;
  ZeroPaddingRowsKernel<<<heuristics::ElementwiseGrid(rows * col_vecs, 256), 256, 0, stream>>>(
      static_cast<uint4*>(out), rows, col_vecs, offsets, num_groups);
  return LastLaunchError("ZeroPaddingRows launch");
}

std::string ZeroEmptyGroups(void* out, int64_t elems_per_group, const int32_t* offsets,
                            int num_groups, cudaStream_t stream) {
  if (num_groups == 0) return "";
  const int64_t vecs = elems_per_group / kVec;
  dim3 grid(8, num_groups);
  ZeroEmptyGroupsKernel<<<grid, 256, 0, stream>>>(static_cast<uint4*>(out), vecs, offsets);
  return LastLaunchError("ZeroEmptyGroups launch");
}

}  // namespace megamoe::grouped

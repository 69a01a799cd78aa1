// Zero fills of what the grouped GEMMs leave untouched: the padding rows past the last group
// and the weight gradients of groups with no rows (offsets as scheduler/group_offsets.h).
// Plain C++ interface; every function enqueues on `stream` and returns "" or what failed.
#pragma once

#include <cstdint>
#include <string>

#include <cuda_runtime.h>

namespace megamoe::grouped {

// Zeroes rows [offsets[E], rows) of a [rows, cols] bf16 matrix (the padding rows).
std::string ZeroPaddingRows(void* out, int64_t rows, int64_t cols, const int32_t* offsets,
                            int num_groups, cudaStream_t stream);

// Zeroes out[g] (of `elems_per_group` bf16 elements) for every group g with no rows.
std::string ZeroEmptyGroups(void* out, int64_t elems_per_group, const int32_t* offsets,
                            int num_groups, cudaStream_t stream);

}  // namespace megamoe::grouped

// Element-wise and bookkeeping kernels of the grouped SwiGLU MLP (bf16 rows sorted by expert).
// Plain C++ interface; every function enqueues on `stream` and returns "" or what failed.
#pragma once

#include <cstdint>
#include <string>

#include <cuda_runtime.h>

namespace megamoe::grouped {

// offsets[0] = 0, offsets[g + 1] = min(offsets[g] + max(group_sizes[g], 0), rows): the row range
// of each group, clamped to the rows that exist (a sum past `rows` is a caller error; clamping
// keeps every kernel inside its buffers).
std::string GroupOffsets(const int32_t* group_sizes, int num_groups, int64_t rows,
                         int32_t* offsets, cudaStream_t stream);

// Weight-gradient operands: each group's rows padded to a multiple of 128 and laid side by side
// as columns. offsets as GroupOffsets (clamped to `rows`); padded[0] = 0, padded[g + 1] =
// padded[g] + round_up(offsets[g + 1] - offsets[g], 128). Both [E + 1] int32 on the device.
std::string PaddedGroupOffsets(const int32_t* group_sizes, int num_groups, int64_t rows,
                               int32_t* offsets, int32_t* padded, cudaStream_t stream);

// h[r, j] = silu(gu[r, j]) * gu[r, F + j] in fp32, stored as bf16, for r < offsets[E];
// rows past it are not written. gu [rows, 2F], h [rows, F], all bf16.
std::string SwigluForward(const void* gate_up, void* h, int64_t rows, int64_t f,
                          const int32_t* offsets, int num_groups, cudaStream_t stream);

// With dh = dL/dh: dgu[:, :F] = dh * u * s * (1 + g (1 - s)), dgu[:, F:] = dh * g * s
// (g, u = gate, up; s = sigmoid(g)), fp32 math, bf16 storage, rows r < offsets[E] only.
std::string SwigluBackward(const void* dh, const void* gate_up, void* dgate_up, int64_t rows,
                           int64_t f, const int32_t* offsets, int num_groups,
                           cudaStream_t stream);

// Zeroes rows [offsets[E], rows) of a [rows, cols] bf16 matrix (the padding rows).
std::string ZeroPaddingRows(void* out, int64_t rows, int64_t cols, const int32_t* offsets,
                            int num_groups, cudaStream_t stream);

// Zeroes out[g] (of `elems_per_group` bf16 elements) for every group g with no rows.
std::string ZeroEmptyGroups(void* out, int64_t elems_per_group, const int32_t* offsets,
                            int num_groups, cudaStream_t stream);

}  // namespace megamoe::grouped

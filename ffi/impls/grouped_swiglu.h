// The SwiGLU of the grouped MLP and its backward (bf16 rows sorted by expert; offsets as
// scheduler/group_offsets.h). Plain C++ interface; every function enqueues on `stream` and
// returns "" or what failed.
#pragma once

#include <cstdint>
#include <string>

#include <cuda_runtime.h>

namespace megamoe::grouped {

// h[r, j] = silu(gu[r, j]) * gu[r, F + j] in fp32, stored as bf16, for r < offsets[E];
// rows past it are not written. gu [rows, 2F], h [rows, F], all bf16.
std::string SwigluForward(const void* gate_up, void* h, int64_t rows, int64_t f,
                          const int32_t* offsets, int num_groups, cudaStream_t stream);

// With dh = dL/dh: dgu[:, :F] = dh * u * s * (1 + g (1 - s)), dgu[:, F:] = dh * g * s
// (g, u = gate, up; s = sigmoid(g)), fp32 math, bf16 storage, rows r < offsets[E] only.
std::string SwigluBackward(const void* dh, const void* gate_up, void* dgate_up, int64_t rows,
                           int64_t f, const int32_t* offsets, int num_groups,
                           cudaStream_t stream);

}  // namespace megamoe::grouped

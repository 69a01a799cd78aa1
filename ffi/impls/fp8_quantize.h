// Blockwise FP8 quantisers of the grouped expert MLP (DeepSeek-V3 recipe, e4m3 values, fp32
// scales): one kernel per operand layout (layout/fp8_blocks.h gives the scale rule). Plain C++
// interface; every function enqueues on `stream` and returns "" or what failed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda_runtime.h>

#include "ffi/layout/wgrad_rows.h"

namespace megamoe::grouped {

// Activations, 1 x 128 blocks along K: x [rows, K] bf16 -> q [rows, K] e4m3 and scale
// [rows, K/128] fp32 (K-major: a group's rows are one contiguous slice). K % 128 == 0.
std::string QuantizeActivations1x128(const void* x, int64_t rows, int64_t k, bool pow2, void* q,
                                     float* scale, cudaStream_t stream);

// The SwiGLU of the grouped MLP fused with the 1x128 quantisation of its output:
// gate_up [rows, 2F] bf16 -> h [rows, F] bf16 (as SwigluForward), q [rows, F] e4m3 and scale
// [rows, F/128] of h, for rows < offsets[E]; rows past it: h zeroed, q and scale untouched.
std::string SwigluQuantize1x128(const void* gate_up, void* h, int64_t rows, int64_t f,
                                const int32_t* offsets, int num_groups, bool pow2, void* q,
                                float* scale, cudaStream_t stream);

// Weights, 128 x 128 blocks: w [E, K, N] bf16 -> q [E, N, K] e4m3 (transposed: K-major, as FP8
// wgmma needs) and scale [E, K/128, N/128] fp32: the operand of rows @ w. With dgrad, the
// operand of rows @ w^T: q [E, K, N] (w's layout, K-major for that product) and scale
// [E, N/128, K/128]; the same bytes per element. K % 128 == 0, N % 128 == 0.
std::string QuantizeWeights128x128(const void* w, int64_t e, int64_t k, int64_t n, bool pow2,
                                   bool dgrad, void* q, float* scale, cudaStream_t stream);

// 128 x 1 blocks along the rows inside each group, stored transposed: the operand's rows
// [rows, C] (bf16 values, read as `from` says: layout/wgrad_rows.h; never stored in bf16 where
// they are gathered, a SwiGLU or dequantised, the same bytes as if they were) -> q [C, length]
// e4m3 with group g's rows at columns [padded[g], padded[g] + n_g) and zeros up to
// padded[g + 1]; scale [length/128, C] fp32, scale[padded[g]/128 + b][c] that of rows
// offsets[g] + 128 b ... of column c. Columns past padded[E] untouched. C % 128 == 0.
// With q_rows (else nullptr), from the same read: the 1x128 row quantisation (as
// QuantizeActivations1x128) q_rows [rows, C], scale_rows [rows, C/128] of rows < offsets[E].
// kGathered: every source entry < x's rows, the caller's contract.
std::string QuantizeWgradOperand128x1(const WgradRowsSource& from, int64_t c,
                                      const int32_t* offsets, const int32_t* padded,
                                      int num_groups, int64_t length, bool pow2, void* q,
                                      float* scale, void* q_rows, float* scale_rows,
                                      cudaStream_t stream);

// The SwiGLU backward of the grouped MLP (as SwigluBackward, rounded to bf16) quantised both
// ways without storing it: dh [rows, F], gate_up [rows, 2F] bf16 -> dgate_up [rows, 2F] as
// 1x128 rows (q_rows, scale_rows; rows < offsets[E]) and as the weight-gradient operand (q
// [2F, length], scale [length/128, 2F], as QuantizeWgradOperand128x1).
std::string SwigluBackwardQuantize(const void* dh, const void* gate_up, int64_t f,
                                   const int32_t* offsets, const int32_t* padded, int num_groups,
                                   int64_t length, bool pow2, void* q_rows, float* scale_rows,
                                   void* q, float* scale, cudaStream_t stream);

}  // namespace megamoe::grouped

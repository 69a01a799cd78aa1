// Blockwise FP8 (DeepSeek-V3 recipe, e4m3 values, fp32 scales) for the grouped expert GEMMs:
// the quantisation kernels of each operand layout and the scaled grouped GEMM (sm_90a).
// Scale rule per block: s = max(amax * fp32(1/448), FLT_MIN) (a product with the rounded
// reciprocal, which XLA's simplifier leaves alone, so the emulation matches bit for bit; never a
// denormal, which FTZ would flush to 0);
// with pow2, s is rounded up to a power of two (never saturates). q = e4m3_rn_satfinite(v / s).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda_runtime.h>

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
// wgmma needs) and scale [E, K/128, N/128] fp32. K % 128 == 0, N % 128 == 0.
std::string QuantizeWeights128x128(const void* w, int64_t e, int64_t k, int64_t n, bool pow2,
                                   void* q, float* scale, cudaStream_t stream);

struct GroupedGemmFp8Problem {
  int num_groups;
  const int32_t* offsets;  // device [E + 1]
  const void* a;           // e4m3 [rows, lda]: each row's first K bytes
  const float* a_scale;    // [rows, K/128]
  const void* b;           // e4m3 [E, N, K]
  const float* b_scale;    // [E, K/128, N/128]
  void* d;                 // bf16 [rows, N]; rows past offsets[E] untouched
  int64_t rows, n, k;
  int64_t lda;             // bytes from one row of a to the next, >= K, multiple of 16
};

size_t GroupedGemmFp8WorkspaceBytes(int num_groups, int sm_count);
std::string RunGroupedGemmFp8(const GroupedGemmFp8Problem& problem, void* workspace,
                              size_t workspace_bytes, int sm_count, cudaStream_t stream);

}  // namespace megamoe::grouped

// Blockwise-scaled FP8 grouped GEMMs (DeepSeek-V3 recipe, e4m3 values, fp32 scales; sm_90a) on
// operands quantised by impls/fp8_quantize.h. Plain C++ interface.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda_runtime.h>

namespace megamoe::grouped {

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

// The K-grouped weight gradient on two weight-gradient operands (QuantizeWgradOperand128x1):
// d[g] [Ca, Cb] = sum over group g's columns of a[:, j] b[:, j]^T, dequantised, fp32 accumulation
// promoted every 128 columns. Groups with no rows are left untouched (the caller zeroes them).
struct GroupedWgradFp8Problem {
  int num_groups;
  const int32_t* offsets;  // device [E + 1]: an empty group has offsets[g + 1] == offsets[g]
  const int32_t* padded;   // device [E + 1]: group g's columns [padded[g], padded[g + 1])
  const void* a;           // e4m3 [Ca, length]
  const float* a_scale;    // [length/128, Ca]
  const void* b;           // e4m3 [Cb, length]
  const float* b_scale;    // [length/128, Cb]
  void* d;                 // bf16 [E, Ca, Cb]
  int64_t ca, cb, length;
};

size_t GroupedWgradFp8WorkspaceBytes(int num_groups, int sm_count);
std::string RunGroupedWgradFp8(const GroupedWgradFp8Problem& problem, void* workspace,
                               size_t workspace_bytes, int sm_count, cudaStream_t stream);

}  // namespace megamoe::grouped

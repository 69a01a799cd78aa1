// Grouped GEMMs over token rows sorted by expert (group sizes on the device), the building
// blocks of the expert MLP. Plain C++ interface: included by handlers and by the kernels' .cu.
//
// Layouts (row-major, all contiguous; E groups; rows of group g are [off[g], off[g+1])):
//   fprop  D[rows_g, N] = A[rows_g, K]  @ B[g]      A [M_total, K], B [E, K, N], D [M_total, N]
//   dgrad  D[rows_g, N] = A[rows_g, K]  @ B[g]^T    A [M_total, K], B [E, N, K], D [M_total, N]
//   wgrad  D[g]         = A[rows_g, M]^T @ B[rows_g, N]   A [T, M], B [T, N], D [E, M, N]
// fprop/dgrad compute only the valid rows (rows past off[E] are left untouched); wgrad writes
// every D[g] of a non-empty group (an empty group is left untouched: the caller zeroes it).
// Element types: bf16 operands, fp32 accumulation, D in bf16.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda_runtime.h>

namespace megamoe::grouped {

enum class GemmKind { kFprop, kDgrad, kWgrad };

struct GroupedGemmProblem {
  GemmKind kind;
  int num_groups;        // E
  const int32_t* offsets;  // device [E + 1], offsets[0] = 0, nondecreasing, offsets[E] <= rows
  const void* a;
  const void* b;
  void* d;
  int64_t m;  // wgrad: M (columns of A); fprop/dgrad: ignored (rows come from offsets)
  int64_t n;
  int64_t k;  // fprop/dgrad: K; wgrad: ignored (K = rows of the group)
};

// Device bytes of workspace one grouped GEMM needs (per-group argument arrays + CUTLASS's
// workspace), for `num_groups` groups on a GPU with `sm_count` multiprocessors.
size_t GroupedGemmWorkspaceBytes(GemmKind kind, int num_groups, int sm_count);

// Enqueues the grouped GEMM on `stream`. Returns "" on success, else what failed.
std::string RunGroupedGemm(const GroupedGemmProblem& problem, void* workspace,
                           size_t workspace_bytes, int sm_count, cudaStream_t stream);

}  // namespace megamoe::grouped

// FP8 grouped GEMM, schedule variant 1 (grouped_gemm_fp8.cuh).
#ifndef NDEBUG
#define NDEBUG
#endif
#include "ffi/impls/sm90_grouped_gemm_fp8.cuh"

MEGAMOE_DEFINE_GROUPED_GEMM_FP8(1, Cooperative128x128Cluster2x1)

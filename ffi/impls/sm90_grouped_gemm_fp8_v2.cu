// FP8 grouped GEMM, schedule variant 2 (grouped_gemm_fp8.cuh).
#ifndef NDEBUG
#define NDEBUG
#endif
#include "ffi/impls/sm90_grouped_gemm_fp8.cuh"

MEGAMOE_DEFINE_GROUPED_GEMM_FP8(2, Pingpong64x128Cluster1x2)

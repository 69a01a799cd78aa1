// FP8 K-grouped weight gradient, schedule variant 0: cooperative 128x128x128 CTA tile, 1x2x1 cluster (grouped_gemm_fp8.cuh).
#ifndef NDEBUG
#define NDEBUG
#endif
#include "ffi/impls/sm90_grouped_gemm_fp8.cuh"

MEGAMOE_DEFINE_GROUPED_WGRAD_FP8(0, Cooperative128x128Cluster1x2)

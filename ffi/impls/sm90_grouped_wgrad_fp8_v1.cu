// FP8 K-grouped weight gradient, schedule variant 1: ping-pong 64x128x128 CTA tile, 1x2x1 cluster (the epilogue of one warp group overlaps the other's mainloop) (grouped_gemm_fp8.cuh).
#ifndef NDEBUG
#define NDEBUG
#endif
#include "ffi/impls/sm90_grouped_gemm_fp8.cuh"

MEGAMOE_DEFINE_GROUPED_WGRAD_FP8(1, Pingpong64x128Cluster1x2)

// The fprop grouped GEMM (grouped_gemm.h), variant 2: Pingpong128x128Cluster2x1.
// CUTLASS asserts inside the wgmma consumer loop become function calls that serialise wgmma
// (ptxas C7510): compile the instantiation without them whatever the build type.
#ifndef NDEBUG
#define NDEBUG
#endif
#include "ffi/gemm/grouped_gemm_runner.cuh"

MEGAMOE_DEFINE_GROUPED_GEMM(Fprop, 2, Pingpong128x128Cluster2x1)

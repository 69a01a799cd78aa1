// The SwiGLU element math shared by the bf16 and FP8 kernels (one definition, so both paths
// produce the same hidden activation bit for bit).
#pragma once

namespace megamoe::grouped {

__device__ __forceinline__ float Sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

// silu(gate) * up in fp32.
__device__ __forceinline__ float Swiglu(float gate, float up) { return gate * Sigmoid(gate) * up; }

}  // namespace megamoe::grouped

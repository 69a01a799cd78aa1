// The SwiGLU element math shared by the bf16 and FP8 kernels (one definition, so both paths
// produce the same hidden activation bit for bit).
#pragma once

namespace megamoe::grouped {

__device__ __forceinline__ float Sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

// silu(gate) * up in fp32.
__device__ __forceinline__ float Swiglu(float gate, float up) { return gate * Sigmoid(gate) * up; }

// The SwiGLU backward in fp32: with d = dL/dh, *d_gate = d u s (1 + g (1 - s)), *d_up = d g s.
__device__ __forceinline__ void SwigluGrad(float d, float gate, float up, float* d_gate,
                                           float* d_up) {
  const float s = Sigmoid(gate);
  *d_gate = d * up * s * (1.0f + gate * (1.0f - s));
  *d_up = d * gate * s;
}

}  // namespace megamoe::grouped

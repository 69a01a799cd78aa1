// The SwiGLU element math shared by the bf16 and FP8 kernels (one definition, so both paths
// produce the same hidden activation bit for bit).
#pragma once

#include <cuda_bf16.h>

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

// Eight values at a time, as the kernels read them (16-byte vectors of bf16): h = bf16(silu(gate)
// * up) of a gate octet and its up octet.
__device__ __forceinline__ uint4 SwigluOctet(uint4 gate, uint4 up) {
  const __nv_bfloat162* g2 = reinterpret_cast<const __nv_bfloat162*>(&gate);
  const __nv_bfloat162* u2 = reinterpret_cast<const __nv_bfloat162*>(&up);
  uint4 h;
  __nv_bfloat162* h2 = reinterpret_cast<__nv_bfloat162*>(&h);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 g = __bfloat1622float2(g2[i]), u = __bfloat1622float2(u2[i]);
    h2[i] = __floats2bfloat162_rn(Swiglu(g.x, u.x), Swiglu(g.y, u.y));
  }
  return h;
}

// The SwiGLU backward of an octet of d = dL/dh: *d_gate, *d_up rounded to bf16.
__device__ __forceinline__ void SwigluGradOctet(uint4 d, uint4 gate, uint4 up, uint4* d_gate,
                                                uint4* d_up) {
  const __nv_bfloat162* d2 = reinterpret_cast<const __nv_bfloat162*>(&d);
  const __nv_bfloat162* g2 = reinterpret_cast<const __nv_bfloat162*>(&gate);
  const __nv_bfloat162* u2 = reinterpret_cast<const __nv_bfloat162*>(&up);
  __nv_bfloat162* dg2 = reinterpret_cast<__nv_bfloat162*>(d_gate);
  __nv_bfloat162* du2 = reinterpret_cast<__nv_bfloat162*>(d_up);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 dv = __bfloat1622float2(d2[i]), g = __bfloat1622float2(g2[i]),
                 u = __bfloat1622float2(u2[i]);
    float dgx, dux, dgy, duy;
    SwigluGrad(dv.x, g.x, u.x, &dgx, &dux);
    SwigluGrad(dv.y, g.y, u.y, &dgy, &duy);
    dg2[i] = __floats2bfloat162_rn(dgx, dgy);
    du2[i] = __floats2bfloat162_rn(dux, duy);
  }
}

}  // namespace megamoe::grouped

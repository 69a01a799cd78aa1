// The SwiGLU kernels of the grouped MLP: see grouped_swiglu.h.
#include <cuda_bf16.h>

#include "ffi/common/launch_error.h"
#include "ffi/common/swiglu_math.cuh"
#include "ffi/heuristics/elementwise_grid.h"
#include "ffi/impls/grouped_swiglu.h"

namespace megamoe::grouped {
namespace {

constexpr int kVec = 8;  // bf16 per 16-byte access

__global__ void SwigluForwardKernel(const uint4* __restrict__ gate_up, uint4* __restrict__ h,
                                    int64_t f_vecs, const int32_t* __restrict__ offsets,
                                    int num_groups) {
  const int64_t total = int64_t(offsets[num_groups]) * f_vecs;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / f_vecs, c = i - r * f_vecs;
    const uint4 gv = gate_up[r * 2 * f_vecs + c];
    const uint4 uv = gate_up[r * 2 * f_vecs + f_vecs + c];
    const __nv_bfloat162* g2 = reinterpret_cast<const __nv_bfloat162*>(&gv);
    const __nv_bfloat162* u2 = reinterpret_cast<const __nv_bfloat162*>(&uv);
    uint4 hv;
    __nv_bfloat162* h2 = reinterpret_cast<__nv_bfloat162*>(&hv);
#pragma unroll
    for (int k = 0; k < kVec / 2; ++k) {
      const float2 g = __bfloat1622float2(g2[k]);
      const float2 u = __bfloat1622float2(u2[k]);
      h2[k] = __floats2bfloat162_rn(Swiglu(g.x, u.x), Swiglu(g.y, u.y));
    }
    h[i] = hv;
  }
}

__global__ void SwigluBackwardKernel(const uint4* __restrict__ dh, const uint4* __restrict__ gate_up,
                                     uint4* __restrict__ dgate_up, int64_t f_vecs,
                                     const int32_t* __restrict__ offsets, int num_groups) {
  const int64_t total = int64_t(offsets[num_groups]) * f_vecs;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / f_vecs, c = i - r * f_vecs;
    const uint4 dv = dh[i];
    const uint4 gv = gate_up[r * 2 * f_vecs + c];
    const uint4 uv = gate_up[r * 2 * f_vecs + f_vecs + c];
    const __nv_bfloat162* d2 = reinterpret_cast<const __nv_bfloat162*>(&dv);
    const __nv_bfloat162* g2 = reinterpret_cast<const __nv_bfloat162*>(&gv);
    const __nv_bfloat162* u2 = reinterpret_cast<const __nv_bfloat162*>(&uv);
    uint4 dgv, duv;
    __nv_bfloat162* dg2 = reinterpret_cast<__nv_bfloat162*>(&dgv);
    __nv_bfloat162* du2 = reinterpret_cast<__nv_bfloat162*>(&duv);
#pragma unroll
    for (int k = 0; k < kVec / 2; ++k) {
      const float2 d = __bfloat1622float2(d2[k]);
      const float2 g = __bfloat1622float2(g2[k]);
      const float2 u = __bfloat1622float2(u2[k]);
      float dgx, dux, dgy, duy;
      SwigluGrad(d.x, g.x, u.x, &dgx, &dux);
      SwigluGrad(d.y, g.y, u.y, &dgy, &duy);
      dg2[k] = __floats2bfloat162_rn(dgx, dgy);
      du2[k] = __floats2bfloat162_rn(dux, duy);
    }
    dgate_up[r * 2 * f_vecs + c] = dgv;
    dgate_up[r * 2 * f_vecs + f_vecs + c] = duv;
  }
}

}  // namespace

std::string SwigluForward(const void* gate_up, void* h, int64_t rows, int64_t f,
                          const int32_t* offsets, int num_groups, cudaStream_t stream) {
  const int64_t f_vecs = f / kVec;
  SwigluForwardKernel<<<heuristics::ElementwiseGrid(rows * f_vecs, 256), 256, 0, stream>>>(
      static_cast<const uint4*>(gate_up), static_cast<uint4*>(h), f_vecs, offsets, num_groups);
  return LastLaunchError("SwigluForward launch");
}

std::string SwigluBackward(const void* dh, const void* gate_up, void* dgate_up, int64_t rows,
                           int64_t f, const int32_t* offsets, int num_groups,
                           cudaStream_t stream) {
  const int64_t f_vecs = f / kVec;
  SwigluBackwardKernel<<<heuristics::ElementwiseGrid(rows * f_vecs, 256), 256, 0, stream>>>(
      static_cast<const uint4*>(dh), static_cast<const uint4*>(gate_up),
      static_cast<uint4*>(dgate_up), f_vecs, offsets, num_groups);
  return LastLaunchError("SwigluBackward launch");
}

}  // namespace megamoe::grouped

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
    h[i] = SwigluOctet(gate_up[r * 2 * f_vecs + c], gate_up[r * 2 * f_vecs + f_vecs + c]);
  }
}

__global__ void SwigluBackwardKernel(const uint4* __restrict__ dh, const uint4* __restrict__ gate_up,
                                     uint4* __restrict__ dgate_up, int64_t f_vecs,
                                     const int32_t* __restrict__ offsets, int num_groups) {
  const int64_t total = int64_t(offsets[num_groups]) * f_vecs;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / f_vecs, c = i - r * f_vecs;
    uint4 dgv, duv;
    SwigluGradOctet(dh[i], gate_up[r * 2 * f_vecs + c], gate_up[r * 2 * f_vecs + f_vecs + c],
                    &dgv, &duv);
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

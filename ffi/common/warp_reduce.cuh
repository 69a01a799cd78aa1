// Warp and block reductions of one float per thread whose result every thread gets, combined
// in a fixed order (the same bits in every run, and in every CTA that reduces the same values).
#pragma once

namespace megamoe {

template <class Op>
__device__ __forceinline__ float WarpReduce(float v, Op op) {
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
  return WarpReduce(v, [](float a, float b) { return fmaxf(a, b); });
}

__device__ __forceinline__ float WarpSum(float v) {
  return WarpReduce(v, [](float a, float b) { return a + b; });
}

// Over a block of kWarps full warps; `scratch` holds kWarps floats. Every thread of the block
// calls it; it may be called again at once (it waits for the last call's readers first).
template <int kWarps, class Op>
__device__ float BlockReduce(float v, float* scratch, Op op) {
  v = WarpReduce(v, op);
  __syncthreads();  // scratch free (a previous reduction's readers are done)
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  v = scratch[0];
  for (int w = 1; w < kWarps; ++w) v = op(v, scratch[w]);  // warps in order
  return v;
}

}  // namespace megamoe

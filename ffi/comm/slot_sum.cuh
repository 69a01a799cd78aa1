// The combine's reduction: a warp sums, for one token, the rows of its slots in ascending slot
// order (fp32, optionally weighted by the routing weight), one 16-byte column chunk at a time.
//
// The rows are scattered (each slot's row sits wherever its expert put it), so the sum is bound
// by memory latency, not bandwidth: a slot-at-a-time loop keeps only one slot's vectors in
// flight per lane (measured: the fused kernel's bf16 combine moved ~1.5 TB/s on the H200; 3.5
// with this, benchmarks/RESULTS.md session 12). Here up to kSlotSumSlots slots' vectors are
// loaded before any of them is added, and the additions then run in slot order: the same fp32
// operations in the same order as the slot-at-a-time loop, so the result is bit for bit the
// same.
#pragma once

#include "ffi/comm/row_transfer.cuh"
#include "ffi/common/warp_reduce.cuh"

namespace megamoe::ep {

// Slots whose vectors are in flight together, and 16-byte vectors per lane per slot: 16 loads
// in flight per lane, 64 registers of buffer.
inline constexpr int kSlotSumSlots = 8;
inline constexpr int kSlotSumVecs = 2;
// The combine backward's dot products <dy, y> (d topk_weights): 16-byte vectors per lane in a
// chunk, each chunk's per-lane fma chain reduced over the warp, chunks summed in order. Backend
// cuda's CombineBwdRecvKernel and the fused backward's copy both use it, so their bits agree.
inline constexpr int kSlotDotVecs = 4;

// acc[u] += sum over the slots j set in `valid` (ascending) of w_j * row_j[c0 + u * 32 + lane],
// where lane j holds row_j (any value the load understands) and w_j; load(row, c) returns the
// 16-byte vector c of that row. `valid` is warp-uniform; vectors c >= nvec are left alone.
// kWeighted = false adds the rows unweighted (w_j unused).
template <typename T, bool kWeighted, int kVecs, class Load>
__device__ __forceinline__ void WarpSlotSum(unsigned valid, int row_j, float w_j, int c0,
                                            int nvec, Load load,
                                            float (&acc)[kVecs][Vec16<T>::kElems]) {
  constexpr int N = Vec16<T>::kElems;
  const int lane = threadIdx.x & 31;
  for (unsigned bits = valid; bits != 0u;) {
    uint4 buf[kSlotSumSlots][kVecs];
    float w[kSlotSumSlots];
    int n = 0;  // slots loaded in this round (warp-uniform)
#pragma unroll
    for (int s = 0; s < kSlotSumSlots; ++s) {
      if (bits != 0u) {
        const int j = __ffs(bits) - 1;
        bits &= bits - 1u;
        const int row = __shfl_sync(0xffffffffu, row_j, j);
        w[s] = kWeighted ? __shfl_sync(0xffffffffu, w_j, j) : 1.f;
        n = s + 1;
#pragma unroll
        for (int u = 0; u < kVecs; ++u) {
          const int c = c0 + u * 32 + lane;
          if (c < nvec) buf[s][u] = load(row, c);
        }
      }
    }
#pragma unroll
    for (int s = 0; s < kSlotSumSlots; ++s) {
      if (s < n) {
#pragma unroll
        for (int u = 0; u < kVecs; ++u) {
          const int c = c0 + u * 32 + lane;
          if (c < nvec) {
            float f[N];
            Unpack(buf[s][u], f, static_cast<const T*>(nullptr));
#pragma unroll
            for (int q = 0; q < N; ++q) {
              acc[u][q] = kWeighted ? fmaf(w[s], f[q], acc[u][q]) : acc[u][q] + f[q];
            }
          }
        }
      }
    }
  }
}

// One slot of one token in the combine backward, over one chunk (vectors c0 + u * 32 + lane):
// w * g stored to drow (g: the token's dy vectors, loaded once for all its slots) and the warp's
// sum of <g, y> over the chunk returned to every lane (y: the slot's forward output row). Per
// lane an fma chain over the chunk, then a butterfly over the warp. Backend cuda's
// CombineBwdRecvKernel and the fused backward's CopyTokenSlots both run it, so that their
// d topk_weights agree bit for bit.
template <typename T, int kVecs>
__device__ __forceinline__ float WarpSlotScaleDot(const uint4 (&gv)[kVecs],
                                                  const uint4 (&yv)[kVecs], float w,
                                                  uint4* drow, int c0, int nvec) {
  constexpr int N = Vec16<T>::kElems;
  const int lane = threadIdx.x & 31;
  float dot = 0.f;
#pragma unroll
  for (int u = 0; u < kVecs; ++u) {
    const int c = c0 + u * 32 + lane;
    if (c < nvec) {
      float gf[N], yf[N], df[N];
      Unpack(gv[u], gf, static_cast<const T*>(nullptr));
      Unpack(yv[u], yf, static_cast<const T*>(nullptr));
#pragma unroll
      for (int q = 0; q < N; ++q) {
        df[q] = w * gf[q];
        dot = fmaf(gf[q], yf[q], dot);
      }
      drow[c] = Pack(df, static_cast<const T*>(nullptr));
    }
  }
  return WarpSum(dot);
}

}  // namespace megamoe::ep

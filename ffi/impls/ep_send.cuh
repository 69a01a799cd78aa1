// The two kernels every use of a region begins and ends with: the dispatch-shaped send (rows of
// the source's tokens to every rank that holds one of their experts, once per rank) and the
// release (tells every source its data was read, bumps this rank's epoch).
#pragma once

#include "ffi/comm/peer_signal.h"
#include "ffi/comm/symmetric_memory.h"
#include "ffi/comm/row_transfer.cuh"

namespace megamoe::ep {

constexpr int kSendThreads = 512;
constexpr int kSendUnroll = 4;

// Which rank holds global expert e (-1 for a masked or out-of-range id).
__device__ __forceinline__ int RankOfExpert(int e, int experts_per_rank, int num_ranks) {
  return (e >= 0 && e < experts_per_rank * num_ranks) ? e / experts_per_rank : -1;
}

// One warp per token (grid-strided). Writes, on every rank r, meta slot (rank, t) (when
// kWithMeta: the local expert id on r or -1, and the weight) and, on every rank that holds at
// least one of the token's experts, the row into pool_d slot (rank, t).
template <typename T, bool kWithMeta>
__global__ void __launch_bounds__(kSendThreads)
    DispatchSendKernel(PeerView v, int op, const T* __restrict__ x,
                       const int* __restrict__ ids, const float* __restrict__ weights,
                       int num_tokens, int hidden, int top_k, int experts_per_rank) {
  const int region = kRegionDispatch;
  const WorkspaceLayout& L = v.layout;
  const unsigned long long uses = LoadUses(v, region);
  if (!BlockWaitConsumed(v, region, op, uses)) return;

  const int lane = threadIdx.x & 31;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int num_warps = (gridDim.x * blockDim.x) >> 5;
  const int nvec = hidden * static_cast<int>(sizeof(T)) / 16;
  const int R = v.num_ranks;

  for (int t = warp; t < num_tokens; t += num_warps) {
    const int e = lane < top_k ? ids[static_cast<size_t>(t) * top_k + lane] : -1;
    const int dest = RankOfExpert(e, experts_per_rank, R);
    const unsigned routes = __reduce_or_sync(0xffffffffu, dest >= 0 ? (1u << dest) : 0u);
    const size_t slot = static_cast<size_t>(v.rank) * L.max_tokens + t;
    if (kWithMeta && lane < top_k) {
      const float wt = weights[static_cast<size_t>(t) * top_k + lane];
      for (int r = 0; r < R; ++r) {
        const size_t m = slot * top_k + lane;
        reinterpret_cast<int*>(v.base[r] + L.meta_ids)[m] =
            dest == r ? e - r * experts_per_rank : -1;
        reinterpret_cast<float*>(v.base[r] + L.meta_w)[m] = dest == r ? wt : 0.f;
      }
    }
    if (routes == 0u) continue;
    const uint4* src = reinterpret_cast<const uint4*>(x + static_cast<size_t>(t) * hidden);
    for (int c0 = 0; c0 < nvec; c0 += 32 * kSendUnroll) {
      uint4 buf[kSendUnroll];
#pragma unroll
      for (int u = 0; u < kSendUnroll; ++u) {
        const int c = c0 + u * 32 + lane;
        if (c < nvec) buf[u] = __ldg(src + c);
      }
      // Start with the next rank so that the ranks do not all hit the same peer at once.
      for (int q = 1; q <= R; ++q) {
        const int r = (v.rank + q) % R;
        if (!((routes >> r) & 1u)) continue;
        uint4* dst = reinterpret_cast<uint4*>(v.base[r] + L.pool_d) + slot * nvec;
#pragma unroll
        for (int u = 0; u < kSendUnroll; ++u) {
          const int c = c0 + u * 32 + lane;
          if (c < nvec) dst[c] = buf[u];
        }
      }
    }
  }
  BlockSignalArrival(v, region);
}

// One thread: every source may reuse its slots in this rank's `region`; this rank's epoch += 1.
static __global__ void ReleaseKernel(PeerView v, int region) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  if (RankFailed(v)) return;
  __threadfence_system();
  for (int s = 0; s < v.num_ranks; ++s) AddReleaseSys(&v.signals(s)->consumed[region][v.rank], 1);
  unsigned long long* uses = &v.signals(v.rank)->uses[region];
  *reinterpret_cast<volatile unsigned long long*>(uses) = *uses + 1;
}

template <typename F>
cudaError_t WithElemType(ElemType type, F&& f) {
  switch (type) {
    case ElemType::kF32: return f(static_cast<float*>(nullptr));
    case ElemType::kBF16: return f(static_cast<__nv_bfloat16*>(nullptr));
    case ElemType::kF16: return f(static_cast<__half*>(nullptr));
  }
  return cudaErrorInvalidValue;
}

}  // namespace megamoe::ep

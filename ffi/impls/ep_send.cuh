// The dispatch-shaped send that dispatch (forward) and the combine backward begin with: rows of
// the source's tokens to every rank that holds one of their experts, once per rank (the region's
// release kernel, comm/peer_signal.cuh, ends them). Shared by impls/ep_dispatch.cu and
// impls/ep_combine.cu.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "ffi/comm/peer_signal.cuh"
#include "ffi/comm/row_transfer.cuh"
#include "ffi/comm/symmetric_memory.h"
#include "ffi/impls/ep_dispatch_combine.h"
#include "ffi/layout/ep_layout.h"

namespace megamoe::ep {

constexpr int kSendThreads = 512;
constexpr int kSendUnroll = 4;

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
  // A rank whose wait failed (now or earlier) sends nothing: its peers then time out and poison
  // their outputs instead of reading stale slots as if they were this call's.
  if (!BlockWaitConsumed(v, region, op, uses) || BlockRankFailed(v)) return;

  const int lane = threadIdx.x & 31;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int num_warps = (gridDim.x * blockDim.x) >> 5;
  const int nvec = hidden * static_cast<int>(sizeof(T)) / 16;
  const int R = v.num_ranks;

  for (int t = warp; t < num_tokens; t += num_warps) {
    const int e = lane < top_k ? ids[static_cast<size_t>(t) * top_k + lane] : -1;
    const int dest = RankOfExpert(e, experts_per_rank, R);
    const unsigned routes = __reduce_or_sync(0xffffffffu, dest >= 0 ? (1u << dest) : 0u);
    const size_t slot = PoolSlot(v.rank, t, L.max_tokens);
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
    WarpCopyRow<kSendUnroll>(
        nvec, [&](int c) { return __ldg(src + c); },
        [&](auto&& store) {
          // Start with the next rank so that the ranks do not all hit the same peer at once.
          for (int q = 1; q <= R; ++q) {
            const int r = (v.rank + q) % R;
            if (!((routes >> r) & 1u)) continue;
            store(reinterpret_cast<uint4*>(v.base[r] + L.pool_d) + slot * nvec);
          }
        });
  }
  BlockSignalArrival(v, region);
}

// Calls f with a null pointer of the C++ element type of `type`.
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

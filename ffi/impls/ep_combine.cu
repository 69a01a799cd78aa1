// Expert-parallel combine (forward) and the combine-shaped dispatch backward, plus the combine
// backward (dispatch-shaped).
//
// Combine: the expert rank reduces, for every received token, its local slots in ascending slot
// order (fp32, weighted by the routing weight in the forward), writes the partial sum in the
// activation dtype into the source's pool_c slot (expert rank, token), and the source adds the
// partials of the ranks its token visited in ascending rank order. Fixed order throughout: the
// result is bitwise reproducible.
#include <algorithm>
#include <type_traits>

#include "ffi/comm/slot_sum.cuh"
#include "ffi/impls/ep_dispatch_combine.h"
#include "ffi/impls/ep_send.cuh"
#include "ffi/layout/ep_layout.h"

namespace megamoe::ep {
namespace {

constexpr int kCombineThreads = 512;
constexpr int kCombineUnroll = kSlotDotVecs;  // slot_sum.cuh: the fused backward too

template <typename T, bool kWeighted, bool kWithMeta>
__global__ void __launch_bounds__(kCombineThreads)
    CombineSendKernel(PeerView v, int op, const T* __restrict__ y, const int* __restrict__ slot_pos,
                      const float* __restrict__ weights, const float* __restrict__ slot_values,
                      int num_tokens, int hidden, int top_k) {
  constexpr int N = Vec16<T>::kElems;
  const int region = kRegionCombine;
  const WorkspaceLayout& L = v.layout;
  const unsigned long long uses = LoadUses(v, region);
  // A rank whose wait failed (now or earlier) sends nothing: its peers then time out and poison
  // their outputs instead of reading stale slots as if they were this call's.
  if (!BlockWaitConsumed(v, region, op, uses) || BlockRankFailed(v)) return;

  const int lane = threadIdx.x & 31;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int num_warps = (gridDim.x * blockDim.x) >> 5;
  const int nvec = hidden * static_cast<int>(sizeof(T)) / 16;
  const int num_rows = v.num_ranks * num_tokens;
  const uint4* ysrc = reinterpret_cast<const uint4*>(y);

  for (int i = warp; i < num_rows; i += num_warps) {
    const int p_j =
        lane < top_k ? slot_pos[static_cast<size_t>(i) * top_k + lane] : kSlotNotRouted;
    if (__ballot_sync(0xffffffffu, p_j != kSlotNotRouted) == 0u) continue;  // not routed here
    const unsigned valid = __ballot_sync(0xffffffffu, p_j >= 0);
    float w_j = 1.f;
    if (kWeighted && lane < top_k) w_j = weights[static_cast<size_t>(i) * top_k + lane];
    const int s = i / num_tokens, t = i % num_tokens;
    const size_t slot = PoolSlot(v.rank, t, L.max_tokens);
    if (kWithMeta && lane < top_k) {
      reinterpret_cast<float*>(v.base[s] + L.meta_c)[slot * top_k + lane] =
          slot_values[static_cast<size_t>(i) * top_k + lane];
    }
    uint4* dst = reinterpret_cast<uint4*>(v.base[s] + L.pool_c) + slot * nvec;
    const auto load = [&](int p, int c) { return __ldg(ysrc + static_cast<size_t>(p) * nvec + c); };
    for (int c0 = 0; c0 < nvec; c0 += 32 * kSlotSumVecs) {
      float acc[kSlotSumVecs][N];
#pragma unroll
      for (int u = 0; u < kSlotSumVecs; ++u)
#pragma unroll
        for (int q = 0; q < N; ++q) acc[u][q] = 0.f;
      WarpSlotSum<T, kWeighted>(valid, p_j, w_j, c0, nvec, load, acc);
#pragma unroll
      for (int u = 0; u < kSlotSumVecs; ++u) {
        const int c = c0 + u * 32 + lane;
        if (c < nvec) dst[c] = Pack(acc[u], static_cast<const T*>(nullptr));
      }
    }
  }
  BlockSignalArrival(v, region);
}

// Source side: out[t] = sum over visited ranks (ascending) of their partials; with kWithMeta,
// slot_values_out[t, j] = the scalar the rank holding slot j's expert sent back.
template <typename T, bool kWithMeta>
__global__ void __launch_bounds__(kCombineThreads)
    CombineRecvKernel(PeerView v, int op, const int* __restrict__ ids, T* __restrict__ out,
                      float* __restrict__ slot_values_out, int num_tokens, int hidden, int top_k,
                      int experts_per_rank) {
  constexpr int N = Vec16<T>::kElems;
  const int region = kRegionCombine;
  const WorkspaceLayout& L = v.layout;
  const unsigned long long uses = LoadUses(v, region);
  if (!BlockWaitArrivals(v, region, op, uses) || BlockRankFailed(v)) {
    // A wait of this rank timed out (here or earlier): never a normal-looking result.
    PoisonRows(out, num_tokens, hidden * static_cast<int>(sizeof(T)) / 16);
    if (kWithMeta) {
      for (long long q = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
           q < static_cast<long long>(num_tokens) * top_k;
           q += static_cast<long long>(gridDim.x) * blockDim.x) {
        slot_values_out[q] = __int_as_float(0x7fc00000);
      }
    }
    return;
  }

  const int lane = threadIdx.x & 31;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int num_warps = (gridDim.x * blockDim.x) >> 5;
  const int nvec = hidden * static_cast<int>(sizeof(T)) / 16;
  const int R = v.num_ranks;
  const uint4* pool = reinterpret_cast<const uint4*>(v.base[v.rank] + L.pool_c);
  uint4* dst_all = reinterpret_cast<uint4*>(out);

  for (int t = warp; t < num_tokens; t += num_warps) {
    const int e = lane < top_k ? ids[static_cast<size_t>(t) * top_k + lane] : -1;
    const int dest = RankOfExpert(e, experts_per_rank, R);
    const unsigned routes = __reduce_or_sync(0xffffffffu, dest >= 0 ? (1u << dest) : 0u);
    if (kWithMeta && lane < top_k) {
      const float* meta = reinterpret_cast<const float*>(v.base[v.rank] + L.meta_c);
      slot_values_out[static_cast<size_t>(t) * top_k + lane] =
          dest >= 0 ? __ldcg(meta + PoolSlot(dest, t, L.max_tokens) * top_k + lane)
                    : 0.f;
    }
    uint4* dst = dst_all + static_cast<size_t>(t) * nvec;
    // Lane r holds rank r's partial row; the sum runs over the visited ranks in ascending order.
    const int slot_r = lane < R ? static_cast<int>(PoolSlot(lane, t, L.max_tokens)) : -1;
    const auto load = [&](int slot, int c) {
      return LoadPeerWritten(pool + static_cast<size_t>(slot) * nvec + c);
    };
    for (int c0 = 0; c0 < nvec; c0 += 32 * kSlotSumVecs) {
      float acc[kSlotSumVecs][N];
#pragma unroll
      for (int u = 0; u < kSlotSumVecs; ++u)
#pragma unroll
        for (int q = 0; q < N; ++q) acc[u][q] = 0.f;
      WarpSlotSum<T, false>(routes, slot_r, 1.f, c0, nvec, load, acc);
#pragma unroll
      for (int u = 0; u < kSlotSumVecs; ++u) {
        const int c = c0 + u * 32 + lane;
        if (c < nvec) dst[c] = Pack(acc[u], static_cast<const T*>(nullptr));
      }
    }
  }
}

// Combine backward, expert side: for every slot (i, j) held here, dy_sorted[p] = w * g and
// d_recv_w[i, j] = <g, y_sorted[p]> with g = d_out of token i as received in pool_d.
template <typename T>
__global__ void __launch_bounds__(kCombineThreads)
    CombineBwdRecvKernel(PeerView v, int op, const T* __restrict__ y,
                         const int* __restrict__ slot_pos, const float* __restrict__ weights,
                         const int* __restrict__ group_sizes, int experts_per_rank,
                         T* __restrict__ dy, float* __restrict__ d_weights, int num_tokens,
                         int hidden, int top_k, int n_cap) {
  const int region = kRegionDispatch;
  const WorkspaceLayout& L = v.layout;
  const unsigned long long uses = LoadUses(v, region);
  if (!BlockWaitArrivals(v, region, op, uses) || BlockRankFailed(v)) {
    PoisonRows(dy, n_cap, hidden * static_cast<int>(sizeof(T)) / 16);
    for (long long q = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
         q < static_cast<long long>(v.num_ranks) * num_tokens * top_k;
         q += static_cast<long long>(gridDim.x) * blockDim.x) {
      d_weights[q] = __int_as_float(0x7fc00000);
    }
    return;
  }
  __shared__ int s_total;
  if (threadIdx.x == 0) {
    int total = 0;
    for (int e = 0; e < experts_per_rank; ++e) total += group_sizes[e];
    s_total = min(total, n_cap);
  }
  __syncthreads();

  const int lane = threadIdx.x & 31;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int num_warps = (gridDim.x * blockDim.x) >> 5;
  const int nvec = hidden * static_cast<int>(sizeof(T)) / 16;
  const int num_rows = v.num_ranks * num_tokens;
  const uint4* pool = reinterpret_cast<const uint4*>(v.base[v.rank] + L.pool_d);
  const uint4* ysrc = reinterpret_cast<const uint4*>(y);
  uint4* dyout = reinterpret_cast<uint4*>(dy);

  // Per token: kCombineUnroll vectors of g per lane loaded once per chunk, then for each slot its
  // y vectors (all in flight together), dy = w * g stored and the slot's partial dot reduced
  // over the warp; lane j sums slot j's partials in chunk order (deterministic).
  for (int i = warp; i < num_rows; i += num_warps) {
    const int p_j =
        lane < top_k ? slot_pos[static_cast<size_t>(i) * top_k + lane] : kSlotNotRouted;
    const float w_j = lane < top_k ? weights[static_cast<size_t>(i) * top_k + lane] : 0.f;
    const unsigned valid = __ballot_sync(0xffffffffu, p_j >= 0);
    if (lane < top_k && p_j < 0) d_weights[static_cast<size_t>(i) * top_k + lane] = 0.f;
    if (valid == 0u) continue;
    const int s = i / num_tokens, t = i % num_tokens;
    const uint4* g = pool + PoolSlot(s, t, L.max_tokens) * nvec;
    float dot_j = 0.f;  // lane j: <g, y_sorted[p_j]>
    for (int c0 = 0; c0 < nvec; c0 += 32 * kCombineUnroll) {
      uint4 gv[kCombineUnroll];
#pragma unroll
      for (int u = 0; u < kCombineUnroll; ++u) {
        const int c = c0 + u * 32 + lane;
        if (c < nvec) gv[u] = LoadPeerWritten(g + c);
      }
      for (unsigned bits = valid; bits != 0u; bits &= bits - 1u) {
        const int j = __ffs(bits) - 1;
        const int p = __shfl_sync(0xffffffffu, p_j, j);
        const float w = __shfl_sync(0xffffffffu, w_j, j);
        const uint4* yrow = ysrc + static_cast<size_t>(p) * nvec;
        uint4* drow = dyout + static_cast<size_t>(p) * nvec;
        uint4 yv[kCombineUnroll];
#pragma unroll
        for (int u = 0; u < kCombineUnroll; ++u) {
          const int c = c0 + u * 32 + lane;
          if (c < nvec) yv[u] = __ldg(yrow + c);
        }
        const float dot = WarpSlotScaleDot<T>(gv, yv, w, drow, c0, nvec);
        if (lane == j) dot_j += dot;
      }
    }
    if (lane < top_k && p_j >= 0) d_weights[static_cast<size_t>(i) * top_k + lane] = dot_j;
  }
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  for (int row = s_total + warp; row < n_cap; row += num_warps) {
    uint4* dst = dyout + static_cast<size_t>(row) * nvec;
    for (int c = lane; c < nvec; c += 32) dst[c] = zero;
  }
}

}  // namespace

cudaError_t LaunchCombine(const CombineCall* calls, int count, int op, cudaStream_t stream) {
  return WithElemType(calls[0].args.type, [&](auto* tag) -> cudaError_t {
    using T = std::remove_pointer_t<decltype(tag)>;
    for (int c = 0; c < count; ++c) {
      const PeerView& v = *calls[c].view;
      const CombineArgs& a = calls[c].args;
      const T* y = static_cast<const T*>(a.y_sorted);
      if (a.recv_w != nullptr && a.slot_values == nullptr) {
        CombineSendKernel<T, true, false><<<v.comm_blocks, kCombineThreads, 0, stream>>>(
            v, op, y, a.slot_pos, a.recv_w, nullptr, a.num_tokens, a.hidden, a.top_k);
      } else if (a.recv_w == nullptr && a.slot_values != nullptr) {
        CombineSendKernel<T, false, true><<<v.comm_blocks, kCombineThreads, 0, stream>>>(
            v, op, y, a.slot_pos, nullptr, a.slot_values, a.num_tokens, a.hidden, a.top_k);
      } else {
        return cudaErrorInvalidValue;
      }
    }
    for (int c = 0; c < count; ++c) {
      const PeerView& v = *calls[c].view;
      const CombineArgs& a = calls[c].args;
      T* out = static_cast<T*>(calls[c].out);
      if (calls[c].slot_values_out != nullptr) {
        CombineRecvKernel<T, true><<<v.comm_blocks, kCombineThreads, 0, stream>>>(
            v, op, a.ids, out, calls[c].slot_values_out, a.num_tokens, a.hidden, a.top_k,
            a.experts_per_rank);
      } else {
        CombineRecvKernel<T, false><<<v.comm_blocks, kCombineThreads, 0, stream>>>(
            v, op, a.ids, out, nullptr, a.num_tokens, a.hidden, a.top_k, a.experts_per_rank);
      }
    }
    for (int c = 0; c < count; ++c) {
      ReleaseKernel<<<1, 32, 0, stream>>>(*calls[c].view, kRegionCombine);
    }
    return cudaGetLastError();
  });
}

cudaError_t LaunchCombineBackward(const CombineBackwardCall* calls, int count,
                                  cudaStream_t stream) {
  return WithElemType(calls[0].args.type, [&](auto* tag) -> cudaError_t {
    using T = std::remove_pointer_t<decltype(tag)>;
    for (int c = 0; c < count; ++c) {
      const PeerView& v = *calls[c].view;
      const DispatchArgs& a = calls[c].args;
      DispatchSendKernel<T, false><<<v.comm_blocks, kSendThreads, 0, stream>>>(
          v, kOpCombineBwd, static_cast<const T*>(a.x), a.ids, nullptr, a.num_tokens, a.hidden,
          a.top_k, a.experts_per_rank);
    }
    for (int c = 0; c < count; ++c) {
      const CombineBackwardCall& k = calls[c];
      const PeerView& v = *k.view;
      const DispatchArgs& a = k.args;
      CombineBwdRecvKernel<T><<<v.comm_blocks, kCombineThreads, 0, stream>>>(
          v, kOpCombineBwd, static_cast<const T*>(k.y_sorted), k.slot_pos, k.recv_w,
          k.group_sizes, a.experts_per_rank, static_cast<T*>(k.dy_sorted), k.d_recv_w,
          a.num_tokens, a.hidden, a.top_k, k.n_cap);
    }
    for (int c = 0; c < count; ++c) {
      ReleaseKernel<<<1, 32, 0, stream>>>(*calls[c].view, kRegionDispatch);
    }
    return cudaGetLastError();
  });
}

}  // namespace megamoe::ep

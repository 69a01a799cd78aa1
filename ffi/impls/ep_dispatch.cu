// Expert-parallel dispatch, forward: tokens travel once per destination rank into the receivers'
// pools (ep_send.cuh), then every receiver sorts what it got by local expert with a
// deterministic counting sort and gathers the rows into x_sorted.
//
// Sort: 32 received rows form a chunk (one warp). For each chunk and local expert, a bit mask of
// the chunk's rows routed to that expert (shared memory) gives the count (popc) and each row's
// rank inside the chunk (popc of the lower lanes); a per-expert scan over chunks gives the chunk
// offsets. Order inside an expert: (source rank, token) ascending, run to run identical.
#include <algorithm>
#include <cub/block/block_scan.cuh>
#include <type_traits>

#include "ffi/impls/ep_dispatch_combine.h"
#include "ffi/impls/ep_send.cuh"
#include "ffi/layout/ep_layout.h"

namespace megamoe::ep {
namespace {

constexpr int kChunkWarps = 8;
constexpr int kChunkThreads = kChunkWarps * 32;
constexpr int kMaxExpertsPerRank = 1024;

// Builds this warp's per-expert masks for rows [chunk*32, chunk*32+32). Returns, for the calling
// lane's row, a bit per slot j whose expert already appeared at an earlier slot of that token.
__device__ __forceinline__ unsigned BuildChunkMasks(const PeerView& v, int chunk, int num_rows,
                                                    int num_tokens, int top_k, int epr,
                                                    unsigned* mask) {
  const int lane = threadIdx.x & 31;
  for (int e = lane; e < epr; e += 32) mask[e] = 0u;
  __syncwarp();
  unsigned repeated = 0u;
  const int i = chunk * 32 + lane;
  if (i < num_rows) {
    const int s = i / num_tokens, t = i % num_tokens;
    const int* meta = reinterpret_cast<const int*>(v.base[v.rank] + v.layout.meta_ids) +
                      PoolSlot(s, t, v.layout.max_tokens) * top_k;
    const unsigned bit = 1u << lane;
    for (int j = 0; j < top_k; ++j) {
      const int e = __ldcg(meta + j);
      if (e >= 0 && e < epr) {
        if (atomicOr(&mask[e], bit) & bit) repeated |= 1u << j;
      }
    }
  }
  __syncwarp();
  return repeated;
}

__global__ void __launch_bounds__(kChunkThreads)
    DispatchCountKernel(PeerView v, int op, int num_rows, int num_tokens, int top_k, int epr,
                        int* __restrict__ chunk_counts) {
  extern __shared__ unsigned s_mask[];
  const unsigned long long uses = LoadUses(v, kRegionDispatch);
  if (!BlockWaitArrivals(v, kRegionDispatch, op, uses)) return;
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
  const int chunk = blockIdx.x * kChunkWarps + wib;
  if (chunk >= (num_rows + 31) / 32) return;
  unsigned* mask = s_mask + wib * epr;
  BuildChunkMasks(v, chunk, num_rows, num_tokens, top_k, epr, mask);
  for (int e = lane; e < epr; e += 32) {
    chunk_counts[static_cast<size_t>(chunk) * epr + e] = __popc(mask[e]);
  }
}

// One block per local expert: exclusive scan of its chunk counts (in place) and its total.
__global__ void __launch_bounds__(kChunkThreads)
    ExpertScanKernel(int* __restrict__ chunk_counts, int* __restrict__ totals, int n_chunks,
                     int epr) {
  using Scan = cub::BlockScan<int, kChunkThreads>;
  __shared__ typename Scan::TempStorage temp;
  const int e = blockIdx.x;
  int running = 0;
  for (int base = 0; base < n_chunks; base += kChunkThreads) {
    const int c = base + threadIdx.x;
    const int val = c < n_chunks ? chunk_counts[static_cast<size_t>(c) * epr + e] : 0;
    int excl, aggregate;
    Scan(temp).ExclusiveSum(val, excl, aggregate);
    if (c < n_chunks) chunk_counts[static_cast<size_t>(c) * epr + e] = running + excl;
    running += aggregate;
    __syncthreads();
  }
  if (threadIdx.x == 0) totals[e] = running;
}

// Expert base offsets (exclusive scan of totals) into s_base[0..epr], s_base[epr] = sum.
__device__ __forceinline__ void ExpertBases(const int* totals, int epr, int* s_base) {
  using Scan = cub::BlockScan<int, kChunkThreads>;
  __shared__ typename Scan::TempStorage temp;
  constexpr int kItems = kMaxExpertsPerRank / kChunkThreads;
  int items[kItems];
#pragma unroll
  for (int q = 0; q < kItems; ++q) {
    const int e = threadIdx.x * kItems + q;
    items[q] = e < epr ? totals[e] : 0;
  }
  int aggregate;
  Scan(temp).ExclusiveSum(items, items, aggregate);
#pragma unroll
  for (int q = 0; q < kItems; ++q) {
    const int e = threadIdx.x * kItems + q;
    if (e < epr) s_base[e] = items[q];
  }
  if (threadIdx.x == 0) s_base[epr] = aggregate;
  __syncthreads();
}

template <typename T>
__global__ void __launch_bounds__(kChunkThreads)
    DispatchPlaceKernel(PeerView v, int num_rows, int num_tokens, int hidden, int top_k, int epr,
                        const int* __restrict__ chunk_offsets, const int* __restrict__ totals,
                        T* __restrict__ x_sorted, int n_cap, int* __restrict__ group_sizes,
                        int* __restrict__ slot_pos, float* __restrict__ recv_w,
                        int* __restrict__ stats) {
  extern __shared__ int smem[];
  int* s_base = smem;                                          // [epr + 1]
  unsigned* s_mask = reinterpret_cast<unsigned*>(smem + epr + 1);  // [kChunkWarps][epr]
  if (BlockRankFailed(v)) {  // a wait timed out: poison every output (the handler reports it)
    PoisonRows(x_sorted, n_cap, hidden * static_cast<int>(sizeof(T)) / 16);
    const long long slots = static_cast<long long>(num_rows) * top_k;
    for (long long q = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; q < slots;
         q += static_cast<long long>(gridDim.x) * blockDim.x) {
      slot_pos[q] = kSlotNotRouted;
      recv_w[q] = __int_as_float(0x7fc00000);
    }
    if (blockIdx.x == 0) {
      for (int e = threadIdx.x; e < epr; e += blockDim.x) group_sizes[e] = 0;
    }
    return;
  }
  ExpertBases(totals, epr, s_base);
  const int needed = s_base[epr];
  if (blockIdx.x == 0) {
    for (int e = threadIdx.x; e < epr; e += blockDim.x) {
      group_sizes[e] = min(s_base[e] + totals[e], n_cap) - min(s_base[e], n_cap);
    }
    if (threadIdx.x == 0) {
      stats[0] = needed;
      stats[1] = n_cap;
      stats[2] = needed > n_cap ? 1 : 0;
    }
  }

  const WorkspaceLayout& L = v.layout;
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
  const int nvec = hidden * static_cast<int>(sizeof(T)) / 16;
  const int chunk = blockIdx.x * kChunkWarps + wib;
  uint4* out = reinterpret_cast<uint4*>(x_sorted);
  if (chunk < (num_rows + 31) / 32) {
    unsigned* mask = s_mask + wib * epr;
    const unsigned repeated = BuildChunkMasks(v, chunk, num_rows, num_tokens, top_k, epr, mask);
    const int i = chunk * 32 + lane;
    if (i < num_rows) {
      const int s = i / num_tokens, t = i % num_tokens;
      const size_t m0 = PoolSlot(s, t, L.max_tokens) * top_k;
      const int* meta_ids = reinterpret_cast<const int*>(v.base[v.rank] + L.meta_ids) + m0;
      const float* meta_w = reinterpret_cast<const float*>(v.base[v.rank] + L.meta_w) + m0;
      const unsigned lower = LaneMaskLt();
      for (int j = 0; j < top_k; ++j) {
        const int e = __ldcg(meta_ids + j);
        int p = kSlotNotRouted;
        if (e >= 0 && e < epr) {
          if ((repeated >> j) & 1u) {
            p = kSlotDropped;
            atomicAdd(&stats[3], 1);
          } else {
            p = s_base[e] + chunk_offsets[static_cast<size_t>(chunk) * epr + e] +
                __popc(mask[e] & lower);
            if (p >= n_cap) p = kSlotDropped;
          }
        }
        slot_pos[static_cast<size_t>(i) * top_k + j] = p;
        recv_w[static_cast<size_t>(i) * top_k + j] = p >= 0 ? __ldcg(meta_w + j) : 0.f;
      }
    }
    __syncwarp();
    // Gather: the warp copies each of its rows to every position it was assigned.
    for (int l = 0; l < 32; ++l) {
      const int row = chunk * 32 + l;
      if (row >= num_rows) break;
      const int p_j =
          lane < top_k ? slot_pos[static_cast<size_t>(row) * top_k + lane] : kSlotNotRouted;
      const unsigned valid = __ballot_sync(0xffffffffu, p_j >= 0);
      if (valid == 0u) continue;
      const int s = row / num_tokens, t = row % num_tokens;
      const uint4* src = reinterpret_cast<const uint4*>(v.base[v.rank] + L.pool_d) +
                         PoolSlot(s, t, L.max_tokens) * nvec;
      WarpCopyRow<kSendUnroll>(
          nvec, [&](int c) { return LoadPeerWritten(src + c); },
          [&](auto&& store) {
            for (unsigned bits = valid; bits != 0u; bits &= bits - 1u) {
              const int j = __ffs(bits) - 1;
              const int p = __shfl_sync(0xffffffffu, p_j, j);
              store(out + static_cast<size_t>(p) * nvec);
            }
          });
    }
  }
  // Rows past the last expert's group are zero (the grouped GEMM may read them).
  const int first_free = min(needed, n_cap);
  const int gwarp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int nwarps = (gridDim.x * blockDim.x) >> 5;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  for (int row = first_free + gwarp; row < n_cap; row += nwarps) {
    uint4* dst = out + static_cast<size_t>(row) * nvec;
    for (int c = lane; c < nvec; c += 32) dst[c] = zero;
  }
}

}  // namespace

int64_t DispatchScratchInts(int64_t num_rows, int64_t experts_per_rank) {
  const int64_t n_chunks = (num_rows + 31) / 32;
  return n_chunks * experts_per_rank + experts_per_rank;
}

cudaError_t LaunchDispatchForward(const DispatchForwardCall* calls, int count,
                                  cudaStream_t stream) {
  for (int c = 0; c < count; ++c) {
    if (calls[c].args.experts_per_rank > kMaxExpertsPerRank) return cudaErrorInvalidValue;
    if (cudaError_t err = cudaMemsetAsync(calls[c].stats, 0, 4 * sizeof(int32_t), stream);
        err != cudaSuccess) {
      return err;
    }
  }
  return WithElemType(calls[0].args.type, [&](auto* tag) -> cudaError_t {
    using T = std::remove_pointer_t<decltype(tag)>;
    for (int c = 0; c < count; ++c) {
      const PeerView& v = *calls[c].view;
      const DispatchArgs& a = calls[c].args;
      DispatchSendKernel<T, true><<<v.comm_blocks, kSendThreads, 0, stream>>>(
          v, kOpDispatchFwd, static_cast<const T*>(a.x), a.ids, a.weights, a.num_tokens,
          a.hidden, a.top_k, a.experts_per_rank);
    }
    for (int c = 0; c < count; ++c) {
      const PeerView& v = *calls[c].view;
      const DispatchArgs& a = calls[c].args;
      const int num_rows = v.num_ranks * a.num_tokens, epr = a.experts_per_rank;
      const int n_chunks = (num_rows + 31) / 32;
      const int chunk_blocks = std::max(1, (n_chunks + kChunkWarps - 1) / kChunkWarps);
      const size_t mask_bytes = static_cast<size_t>(kChunkWarps) * epr * sizeof(unsigned);
      DispatchCountKernel<<<chunk_blocks, kChunkThreads, mask_bytes, stream>>>(
          v, kOpDispatchFwd, num_rows, a.num_tokens, a.top_k, epr, calls[c].scratch);
    }
    for (int c = 0; c < count; ++c) {
      const PeerView& v = *calls[c].view;
      const DispatchArgs& a = calls[c].args;
      const int num_rows = v.num_ranks * a.num_tokens, epr = a.experts_per_rank;
      const int n_chunks = (num_rows + 31) / 32;
      int* chunk_counts = calls[c].scratch;
      int* totals = chunk_counts + static_cast<size_t>(n_chunks) * epr;
      ExpertScanKernel<<<epr, kChunkThreads, 0, stream>>>(chunk_counts, totals, n_chunks, epr);
      const int chunk_blocks = std::max(1, (n_chunks + kChunkWarps - 1) / kChunkWarps);
      const size_t mask_bytes = static_cast<size_t>(kChunkWarps) * epr * sizeof(unsigned);
      DispatchPlaceKernel<T><<<chunk_blocks, kChunkThreads, mask_bytes + (epr + 1) * sizeof(int),
                               stream>>>(
          v, num_rows, a.num_tokens, a.hidden, a.top_k, epr, chunk_counts, totals,
          static_cast<T*>(calls[c].x_sorted), calls[c].n_cap, calls[c].group_sizes,
          calls[c].slot_pos, calls[c].recv_w, calls[c].stats);
    }
    for (int c = 0; c < count; ++c) {
      ReleaseKernel<<<1, 32, 0, stream>>>(*calls[c].view, kRegionDispatch);
    }
    return cudaGetLastError();
  });
}

}  // namespace megamoe::ep

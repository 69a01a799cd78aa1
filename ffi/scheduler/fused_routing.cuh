// The routing phases of the fused MoE kernel (sm90_fused_moe.cu; its forward and backward
// passes both run them, see benchmarks/kernels/FUSED_BACKWARD_PLAN.md): from one rank's top-k expert
// ids and every rank's counts, where each slot's row goes and in which order the rows are
// copied. They are a deterministic function of the ids of all ranks, so a second run gives the
// forward's pool rows, comb rows and copy plan again.
//
//   1 route    per 32-token chunk, this rank's slots per expert (the scratch's chunk counts);
//              this rank's block counters zeroed
//   2 counts   per expert, the scan over chunks and the total, stored into every rank's
//              fcounts; then counts_ready[me] = epoch + 1 on every rank, and wait for every
//              source's (the rank's epoch lives in device memory: graph replays see it)
//   3 layout   from the full count matrix, in every CTA: where each expert's rows start in its
//              owner's pool (group order: expert, source rank, token), this rank's first row in
//              each block, the M-blocks, this rank's own expert walk, comb order and copy order
//   4 plan     each slot's pool row and comb row, and the copy plan: the slot's (token, pool
//              row, M-block) at its place in copy order (local expert index, then owner rank,
//              then token), so that the copy fills every rank's pool M-blocks in pool order
//
// Every CTA of the rank's group runs RouteAndPlan; the phases meet at rank barriers.
#pragma once

#include <cstdint>

#include "ffi/comm/peer_signal.cuh"
#include "ffi/comm/rank_barrier.cuh"
#include "ffi/comm/row_transfer.cuh"
#include "ffi/comm/symmetric_memory.h"
#include "ffi/scheduler/expert_tile_walk.cuh"

namespace megamoe::fused {

constexpr int kRoutingChunk = 32;  // tokens of a routing chunk: one per lane

// One row to copy: token row `token` of this rank goes to row `pool_row` of rank `rank`'s pool,
// inside that pool's M-block `mblock`; token -1: the slot was dropped at capacity. A plan built
// with kPlanSlots holds the slot t * k + j in `token` instead (the backward's copy needs j).
struct alignas(16) CopyRow {
  int32_t token, pool_row, rank, mblock;
};

// Scratch ints before the copy plan: the chunk counts, rounded up to the plan's 16 bytes.
__host__ __device__ constexpr int64_t CopyPlanOffsetInts(int64_t num_tokens, int64_t num_experts) {
  return (num_experts * ((num_tokens + kRoutingChunk - 1) / kRoutingChunk) + 3) / 4 * 4;
}

// Tables a rank's CTAs keep through the GEMMs (the L2 epilogue's row destinations read them).
struct alignas(16) RankTables {
  int32_t src_start[ep::kFusedMaxExperts];   // [El][R]: first pool row of (local expert, source)
  int32_t src_prefix[ep::kFusedMaxExperts];  // [El][R]: that block's first row in the source's comb
};

// What the phases leave in shared memory besides the tables and the walk.
struct RoutingTotals {
  unsigned long long epoch;  // this call's epoch of the rank's fused signals
  int32_t total_rows;        // rows routed to this rank's experts (before capacity)
  int32_t total_blocks;      // M-blocks of this rank's pool
  int32_t copy_rows;         // rows of this rank's copy plan (its slots, before capacity)
};

// Routing scratch (the caller puts it in the GEMMs' stage ring, free until the GEMMs start).
template <int kWarps>
struct RoutingScratch {
  uint32_t mask[kWarps][ep::kFusedMaxExperts];  // per warp: the chunk's tokens of each expert
  int32_t dst_base[ep::kFusedMaxExperts];       // this rank's first row in expert e's block
  int32_t owner_offset[ep::kFusedMaxExperts];   // first row of expert e in its owner's pool
  int32_t owner_mblock[ep::kFusedMaxExperts];   // first M-block of expert e in its owner's pool
  int32_t my_prefix[ep::kFusedMaxExperts];      // this rank's slots of experts < e (comb order)
  int32_t copy_prefix[ep::kFusedMaxExperts];    // this rank's slots before expert e's in copy order
  int32_t rows[ep::kFusedMaxExperts];           // rows of expert e over all sources
};

struct RoutingShape {
  int num_tokens, top_k, num_experts, n_cap;
};

// Where the phases leave their results: shared memory of the calling CTA.
template <int kBlockM, int kWarps>
struct RoutingSmem {
  RoutingScratch<kWarps>& scratch;
  RankTables& tables;
  typename ExpertTileWalk<kBlockM, ep::kFusedMaxExperts>::SharedStorage& walk;
  RoutingTotals& totals;
};

// How the phases ended for the calling CTA.
struct RoutingResult {
  unsigned long long epoch;
  bool routed;   // every source's counts arrived (else: compute nothing, send nothing)
  bool copying;  // and every CTA's plan rows are written: the rows may be copied
};

// Inclusive prefix sum of v over the warp's lanes.
__device__ __forceinline__ int WarpInclusiveSum(int v, int lane) {
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int u = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += u;
  }
  return v;
}

// The warp's chunk of tokens [chunk * 32, + 32): mask[e] holds a bit per lane whose token routes
// a slot to expert e. Returns, for the calling lane's token, a bit per slot j that repeats an
// expert of an earlier slot (counted once).
__device__ __forceinline__ unsigned ChunkMasks(const int32_t* __restrict__ ids, int chunk,
                                               int tokens, int top_k, int experts,
                                               uint32_t* mask, int lane) {
  for (int e = lane; e < experts; e += 32) mask[e] = 0u;
  __syncwarp();
  unsigned repeated = 0u;
  const int t = chunk * kRoutingChunk + lane;
  if (t < tokens) {
    const uint32_t bit = 1u << lane;
    for (int j = 0; j < top_k; ++j) {
      const int e = __ldg(ids + static_cast<size_t>(t) * top_k + j);
      if (e >= 0 && e < experts && (atomicOr(&mask[e], bit) & bit)) repeated |= 1u << j;
    }
  }
  __syncwarp();
  return repeated;
}

// Phases 1-4 for one rank, run by every thread of each of its G CTAs (this one is `cta`).
// A: the rank's ids and where the phases write, members of any struct (the forward passes its
// RankParams, in the kernel's __grid_constant__ parameters, so that each pointer is loaded where
// it is used; a copy made at the start kept them all live through the phases and spilled more):
//   const int32_t* ids      [T, k] expert ids (-1: masked slot)
//   int32_t* chunk_counts   [E, ceil(T / 32)] (scratch)
//   CopyRow* copy_plan      [T * k] in copy order (scratch)
//   int32_t* slot_rows      [T, k] the slot's row in this rank's comb buffer, -1 none
//   int32_t* slot_dest      [T, k] the slot's pool row at its expert rank, -1 none
//   int32_t* group_sizes    [E/R] pool rows per local expert (after capacity), written by CTA 0
//   int32_t* stats          stats[3] += repeated expert ids of a token
// rows_arrived and l1_done: the rank's per-M-block counters (the first GEMM's row arrivals and
// its finished tiles), zeroed in phase 1. mark(p) is called by every thread at the end of phases
// 1, 2 and 3 (the caller stamps times). kPlanSlots: the copy plan's rows name the slot t * k + j
// instead of the token t.
template <int kBlockM, int kWarps, bool kPlanSlots = false, class Args, class Mark>
__device__ __forceinline__ RoutingResult RouteAndPlan(
    const Args& A, RoutingShape shape, const ep::PeerView& v,
    unsigned long long* rows_arrived, unsigned long long* l1_done,
    RoutingSmem<kBlockM, kWarps> S, int cta, int G, Mark&& mark) {
  using ep::kFusedMaxExperts;
  using ep::kMaxRanks;
  constexpr int kThreads = kWarps * 32;
  const ep::WorkspaceLayout& L = v.layout;
  RoutingScratch<kWarps>& RS = S.scratch;
  ep::FusedSignals* sig = v.fused_signals(v.rank);
  const int T = shape.num_tokens, K = shape.top_k, E = shape.num_experts, n_cap = shape.n_cap;
  const int R = v.num_ranks, me = v.rank, El = E / R;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int gwarp = cta * kWarps + warp, nwarps = G * kWarps;
  const int gthread = cta * kThreads + threadIdx.x, nthreads = G * kThreads;
  const int n_chunks = (T + kRoutingChunk - 1) / kRoutingChunk;

  if (threadIdx.x == 0) {
    S.totals.epoch = *reinterpret_cast<volatile unsigned long long*>(&sig->uses);
  }
  __syncthreads();
  const unsigned long long epoch = S.totals.epoch;
  int32_t* fcounts = reinterpret_cast<int32_t*>(v.base[me] + L.fcounts);
  const size_t parity_ints = static_cast<size_t>(kMaxRanks) * kFusedMaxExperts;
  const int32_t* counts = fcounts + (epoch & 1) * parity_ints;  // [s][e] of this call

  // ---- 1 route: this rank's slots per expert in every 32-token chunk; zero its counters.
  const int64_t mblocks = ep::FusedMBlocks(L.fused_rows);
  for (int64_t i = gthread; i < mblocks; i += nthreads) {
    rows_arrived[i] = 0ull;
    l1_done[i] = 0ull;
  }
  uint32_t* mask = RS.mask[warp];
  for (int chunk = gwarp; chunk < n_chunks; chunk += nwarps) {
    ChunkMasks(A.ids, chunk, T, K, E, mask, lane);
    for (int e = lane; e < E; e += 32) {
      A.chunk_counts[static_cast<size_t>(e) * n_chunks + chunk] = __popc(mask[e]);
    }
  }
  ep::RankBarrier(v, G);
  mark(1);

  // ---- 2 counts: per expert the scan over chunks (in place) and the total, to every rank.
  for (int e = gwarp; e < E; e += nwarps) {
    int32_t* row = A.chunk_counts + static_cast<size_t>(e) * n_chunks;
    int carry = 0;
    for (int base = 0; base < n_chunks; base += 32) {
      const int c = base + lane;
      const int val = c < n_chunks ? __ldcg(row + c) : 0;
      const int incl = WarpInclusiveSum(val, lane);
      if (c < n_chunks) row[c] = carry + incl - val;
      carry += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane < R) {
      int32_t* dst = reinterpret_cast<int32_t*>(v.base[lane] + L.fcounts) +
                     (epoch & 1) * parity_ints + static_cast<size_t>(me) * kFusedMaxExperts + e;
      *dst = carry;
    }
  }
  ep::RankBarrier(v, G);
  if (cta == 0 && threadIdx.x == 0) {
    __threadfence_system();
    for (int q = 0; q < R; ++q) ep::StoreReleaseSys(&v.fused_signals(q)->counts_ready[me], epoch + 1);
  }
  if (threadIdx.x == 0) {
    for (int s = 0; s < R; ++s) {
      if (!ep::WaitAtLeast<false>(v, &sig->counts_ready[s], epoch + 1, ep::kStageFusedCounts,
                                  s)) {
        break;
      }
    }
  }
  // A rank whose wait failed (here or in an earlier call) sends nothing and computes no tile:
  // its peers' waits on it then time out and poison their outputs too. (Decided per CTA; the
  // barriers below stay matched whatever each CTA decides.)
  const bool routed = !ep::BlockRankFailed(v);
  mark(2);

  // ---- 3 layout, from counts[s][e] (every source's totals).
  for (int e = threadIdx.x; e < E; e += kThreads) {
    int rows = 0, before_me = 0;
    for (int s = 0; s < R; ++s) {
      const int c = __ldcg(counts + static_cast<size_t>(s) * kFusedMaxExperts + e);
      if (s < me) before_me += c;
      rows += c;
    }
    RS.rows[e] = rows;
    RS.dst_base[e] = before_me;  // + owner_offset below
  }
  __syncthreads();
  if (warp < R) {  // warp q: expert offsets and M-blocks inside rank q's pool
    const int q = warp;
    int off = 0, mb = 0;
    for (int base = 0; base < El; base += 32) {
      const int el = base + lane;
      const int rows = el < El ? RS.rows[q * El + el] : 0;
      const int incl = WarpInclusiveSum(rows, lane);
      const int my_off = off + incl - rows;
      const int lo = min(my_off, n_cap), hi = min(my_off + rows, n_cap);
      const int blocks = (hi - lo + kBlockM - 1) / kBlockM;
      const int bincl = WarpInclusiveSum(blocks, lane);
      if (el < El) {
        RS.owner_offset[q * El + el] = my_off;
        RS.owner_mblock[q * El + el] = mb + bincl - blocks;
      }
      off += __shfl_sync(0xffffffffu, incl, 31);
      mb += __shfl_sync(0xffffffffu, bincl, 31);
    }
    if (q == me && lane == 0) {
      S.totals.total_rows = off;
      S.totals.total_blocks = mb;
    }
  }
  __syncthreads();
  for (int s = warp; s < R; s += kWarps) {  // warp s: source s's comb order (expert-sorted)
    const int32_t* cs = counts + static_cast<size_t>(s) * kFusedMaxExperts;
    int carry = 0;
    for (int base = 0; base < E; base += 32) {
      const int e = base + lane;
      const int c = e < E ? __ldcg(cs + e) : 0;
      const int incl = WarpInclusiveSum(c, lane);
      const int prefix = carry + incl - c;
      if (e < E) {
        if (s == me) RS.my_prefix[e] = prefix;
        if (e / El == me) S.tables.src_prefix[(e - me * El) * R + s] = prefix;
      }
      carry += __shfl_sync(0xffffffffu, incl, 31);
    }
  }
  if (warp == kWarps - 1) {
    // This rank's copy order: local expert index first, then owner rank. Every source then
    // fills every rank's pool from its first M-blocks on, as the tiles consume them.
    const int32_t* mine = counts + static_cast<size_t>(me) * kFusedMaxExperts;
    int carry = 0;
    for (int base = 0; base < E; base += 32) {
      const int k = base + lane;
      const int e = k < E ? (k % R) * El + k / R : 0;
      const int c = k < E ? __ldcg(mine + e) : 0;
      const int incl = WarpInclusiveSum(c, lane);
      if (k < E) RS.copy_prefix[e] = carry + incl - c;
      carry += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane == 0) S.totals.copy_rows = carry;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += kThreads) RS.dst_base[e] += RS.owner_offset[e];
  for (int el = threadIdx.x; el < El; el += kThreads) {
    const int e = me * El + el;
    int start = RS.owner_offset[e];
    for (int s = 0; s < R; ++s) {
      S.tables.src_start[el * R + s] = start;
      start += __ldcg(counts + static_cast<size_t>(s) * kFusedMaxExperts + e);
    }
    S.walk.offsets[el] = min(RS.owner_offset[e], n_cap);
    S.walk.mb_prefix[el] = RS.owner_mblock[e];
  }
  if (threadIdx.x == 0) {
    S.walk.offsets[El] = min(S.totals.total_rows, n_cap);
    S.walk.mb_prefix[El] = S.totals.total_blocks;
  }
  __syncthreads();
  if (cta == 0) {
    for (int el = threadIdx.x; el < El; el += kThreads) {
      A.group_sizes[el] = S.walk.offsets[el + 1] - S.walk.offsets[el];
    }
  }

  // ---- 4 plan: every slot's pool row at its expert rank, its row in this rank's comb, and its
  // row of the copy plan.
  int repeated_here = 0;
  for (int chunk = gwarp; chunk < n_chunks; chunk += nwarps) {
    const unsigned repeated = ChunkMasks(A.ids, chunk, T, K, E, mask, lane);
    const int t = chunk * kRoutingChunk + lane;
    if (t < T) {
      const unsigned lower = ep::LaneMaskLt();
      for (int j = 0; j < K; ++j) {
        const size_t sj = static_cast<size_t>(t) * K + j;
        const int e = __ldg(A.ids + sj);
        int dest = -1, comb = -1;
        if (e >= 0 && e < E) {
          if ((repeated >> j) & 1u) {
            ++repeated_here;
          } else {
            const int within = __ldcg(A.chunk_counts + static_cast<size_t>(e) * n_chunks + chunk) +
                               __popc(mask[e] & lower);
            const int p = RS.dst_base[e] + within;
            CopyRow row{-1, -1, -1, -1};
            if (p < n_cap) {  // else dropped: the expert rank reports its overflow (stats)
              dest = p;
              comb = RS.my_prefix[e] + within;
              row = CopyRow{kPlanSlots ? static_cast<int32_t>(sj) : t, p, e / El,
                            RS.owner_mblock[e] + (p - RS.owner_offset[e]) / kBlockM};
            }
            A.copy_plan[RS.copy_prefix[e] + within] = row;
          }
        }
        A.slot_dest[sj] = dest;
        A.slot_rows[sj] = comb;
      }
    }
    __syncwarp();
  }
  if (repeated_here) atomicAdd(A.stats + 3, repeated_here);
  // A CTA that leaves this barrier on an error of its rank may not have every CTA's plan rows:
  // it copies nothing (the rank's waits then fail on the recorded error).
  const bool copying = ep::RankBarrier(v, G) && routed;
  return RoutingResult{epoch, routed, copying};
}

}  // namespace megamoe::fused

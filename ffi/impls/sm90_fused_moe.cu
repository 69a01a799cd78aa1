// The fused MoE kernel on sm_90a, its forward and (kBwd) its backward pass: one persistent,
// cooperative kernel per call that routes the tokens of every local rank, dispatches their rows
// over NVLink straight into the expert ranks' pools, runs L1 (+ SwiGLU) and L2 on the tile
// engine (ffi/gemm/sm90_moe_tile_engine.cuh), with the L2 epilogue storing each result row into
// its source rank's comb buffer, and reduces every token's slots at its source in slot order
// (bitwise reproducible).
//
// A launch covers `count` local ranks: one (a GPU of a real EP group) or the R ranks of a
// virtual group on one GPU (tests at any R); the CTAs are split into one group per rank, and
// every rank's group runs the phases below, in order, talking to the other ranks only through
// the symmetric workspace (ffi/comm/symmetric_memory.h, fused regions):
//
//   1-4 routing  route, counts, layout, plan (ffi/scheduler/fused_routing.cuh): every slot's
//                pool row at its expert rank, its row in this rank's comb buffer, and the copy
//                plan that fills every rank's pool M-blocks in pool order
//     head copy  the plan's first rows (MEGAMOE_FUSED_COPY_HEAD, ffi/heuristics/
//                fused_copy_head.h), copied by every warp: token row -> pool row, then that
//                pool M-block's arrival counter bumped (release)
//   5 GEMMs      the tile engine over this rank's tiles, all L1 then all L2, strided over the
//     + copy     rank's CTAs; an L1 tile waits for its M-block's rows (acquire), an L2 tile
//                for its M-block's L1 tiles; L2 rows go to comb[source][source's slot order].
//                Beside them, the producer warpgroup's two free warps copy the rest of the
//                plan in order: the first tiles wait for their own rows, not the whole copy
//   6 results    results_ready[me] = epoch + 1 on every source; wait for every expert rank's
//   7 combine    y[t] = sum over slots j, in order, of w[t, j] * comb[slot row], fp32; with
//                several ranks and residuals kept, also this rank's pool rows copied out
//
// Residuals for the backward (FusedRankOperands): L1 also stores its gate_up, and L2's rows go
// to y_sorted too (one rank alone: y_sorted is the comb buffer, a slot's comb row being its pool
// row there; several: a second store in L2's epilogue); bf16 can also keep its pool rows
// (x_sorted): one rank alone, the pool is then x_sorted; several, phase 7 copies the pool out,
// since the next call's sources overwrite it (an FP8 pool holds e4m3 rows; the backward
// scatters x's bf16 rows itself). XLA buffers instead of the workspace's regions.
//
// Safety: the launch is cooperative (every CTA co-resident before any waits); every wait is
// bounded and reports rank, stage and counters; a rank that timed out writes NaN into y.
// Capacity: a row whose pool position is past n_cap is dropped (stats[2] = 1, raised by
// Python); repeated expert ids of one token count once (stats[3]).
#include <cuda.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "ffi/comm/peer_signal.cuh"
#include "ffi/comm/rank_barrier.cuh"
#include "ffi/comm/row_transfer.cuh"
#include "ffi/comm/slot_sum.cuh"
#include "ffi/comm/symmetric_memory.h"
#include "ffi/common/device_info.h"
#include "ffi/common/launch_counts.h"
#include "ffi/gemm/sm90_moe_tile_engine.cuh"
#include "ffi/gemm/sm90_tensor_maps.cuh"
#include "ffi/heuristics/fused_copy_head.h"
#include "ffi/heuristics/fused_l2_store.h"
#include "ffi/heuristics/fused_tile_order.h"
#include "ffi/impls/fused_moe.h"
#include "ffi/scheduler/expert_tile_walk.cuh"
#include "ffi/scheduler/fused_routing.cuh"

namespace megamoe::fused {
namespace {

using ep::kFusedMaxExperts;
using ep::kMaxRanks;
using ep::PeerView;
// One engine per element type (recipe None: bf16; "fp8" / "fp8_pow2": e4m3 + blockwise scales);
// both have the same tile, threads and stage bytes.
using Engine = sm90::Sm90MoeTileEngine<4, 4>;
using Fp8Engine = sm90::Sm90MoeTileEngine<4, 4, sm90::E4m3Operands>;
static_assert(Fp8Engine::kBlockM == Engine::kBlockM && Fp8Engine::kBlockN == Engine::kBlockN &&
                  Fp8Engine::kThreads == Engine::kThreads,
              "the kernel's phases other than the GEMMs are shared by both engines");
// The backward's pass (kBwd): the dgrad GEMMs on the stored weights, read K-major.
using DgradEngine = sm90::Sm90MoeTileEngine<4, 4, sm90::Bf16Operands, /*kBKMajor=*/true,
                                            /*kDgrad=*/true>;
static_assert(DgradEngine::kBlockM == Engine::kBlockM && DgradEngine::kBlockN == Engine::kBlockN &&
                  DgradEngine::kThreads == Engine::kThreads,
              "the backward's pass shares the kernel's phases");
using Walk = ExpertTileWalk<Engine::kBlockM, kFusedMaxExperts>;
static_assert(Engine::kBlockM == ep::kFusedBlockM, "pool M-blocks are the tile engine's M");

constexpr int kThreads = Engine::kThreads;
constexpr int kWarps = kThreads / 32;
constexpr int kCopyUnroll = 4;    // 16-byte vectors in flight per lane when copying rows
// The producer warpgroup's warps that the tile engine leaves free copy the rows (phase 5).
constexpr int kFirstCopyWarp = 2, kCopyWarps = 2;
// Plan rows a warp copies between two releases: before the GEMMs every warp copies (small chunks
// spread the head over them all), beside them two warps per CTA do (larger chunks, fewer
// releases).
constexpr int kHeadChunkRows = 4, kCopyChunkRows = 16;
static_assert(Engine::kProducerWarp < kFirstCopyWarp && Engine::kSignallerWarp < kFirstCopyWarp &&
                  kFirstCopyWarp + kCopyWarps <= Engine::kFirstMathWarp,
              "the copy warps are the producer warpgroup's free warps");

// ------------------------------------------------------------------------ shared memory

// The tables come first (8 KB, a multiple of the engine's 1024-byte alignment) so that their
// place does not depend on the engine (CombRowDest reads them).
template <class Eng>
struct alignas(1024) FusedSmem {
  RankTables tables;
  typename Eng::SharedStorage engine;  // its stage ring doubles as RoutingScratch until the GEMMs
  Walk::SharedStorage walk;      // this rank's experts: clamped offsets, M-block prefix
  RoutingTotals totals;
};

// Routing scratch, in the stage ring (free until the GEMMs start).
using RankRoutingScratch = RoutingScratch<kWarps>;
static_assert(sizeof(RankRoutingScratch) <= sizeof(Engine::SharedStorage::a) +
                                            sizeof(Engine::SharedStorage::b),
              "the routing scratch must fit in the stage ring");
static_assert(sizeof(RankRoutingScratch) <= sizeof(DgradEngine::SharedStorage::a) +
                                            sizeof(DgradEngine::SharedStorage::b),
              "the routing scratch must fit in the backward's stage ring too");
static_assert(sizeof(RankTables) % 1024 == 0, "the engine's storage follows the tables");
// 227 KB of dynamic shared memory per block on sm_90, less the 1 KB ptxas reports as static.
static_assert(sizeof(FusedSmem<Engine>) <= 232448 - 1024 &&
                  sizeof(FusedSmem<Fp8Engine>) <= 232448 - 1024 &&
                  sizeof(FusedSmem<DgradEngine>) <= 232448 - 1024,
              "the fused kernel's shared memory exceeds what an sm_90 block may take");

__device__ __forceinline__ uint8_t* SmemBase() {
  extern __shared__ __align__(1024) uint8_t fused_smem[];
  return fused_smem;
}

template <class Eng>
__device__ __forceinline__ FusedSmem<Eng>& Smem() {
  return *reinterpret_cast<FusedSmem<Eng>*>(SmemBase());
}

__device__ __forceinline__ const RankTables& Tables() {
  return *reinterpret_cast<const RankTables*>(SmemBase());
}

// ------------------------------------------------------------------------ parameters

// An L2 result row -> its source rank's comb row (the source's expert-sorted slot order).
struct CombRowDest {
  char* base[kMaxRanks];  // every rank's comb buffer as mapped here (+ comb_offset)
  int64_t comb_offset;    // layout.fcomb (0 when base is y_sorted)
  int32_t num_ranks;
  int32_t hidden;

  __device__ __forceinline__ __nv_bfloat16* row(const ExpertTile& t, int r) const {
    const RankTables& tab = Tables();
    const int p = t.row_begin + r;
    const int* start = tab.src_start + t.expert * num_ranks;
    int s = num_ranks - 1;
    while (s > 0 && start[s] > p) --s;
    const int64_t comb_row = tab.src_prefix[t.expert * num_ranks + s] + (p - start[s]);
    return reinterpret_cast<__nv_bfloat16*>(base[s] + comb_offset) + comb_row * hidden;
  }
};

using EngineParams = sm90::EngineParams<CombRowDest>;

// RouteAndPlan (fused_routing.cuh) reads ids, chunk_counts, copy_plan, slot_rows, slot_dest,
// group_sizes and stats.
struct alignas(128) RankParams {
  EngineParams engine;
  PeerView view;
  char* pool[kMaxRanks];        // every rank's pool as mapped here (the dispatch's targets)
  const __nv_bfloat16* comb;    // this rank's comb buffer (the combine's source)
  void* pool_rows_out;          // residual x_sorted [n_cap, H] (else nullptr; FP8: e4m3)
  void* comb_rows_out;          // residual y_comb [T * k, H] bf16 (else nullptr)
  float* pool_scales_out;       // FP8: its scales [n_cap, H/128] (else nullptr)
  int32_t* group_sizes;         // [E/R]: pool rows per local expert (after capacity)
  const __nv_bfloat16* x;       // bf16 rows, or (FP8) e4m3 rows of H bytes
  const float* x_scale;         // FP8: [T, H/128] the rows' 1 x 128 scales
  const int32_t* ids;
  const float* weights;
  __nv_bfloat16* y;
  // Backward only (x is dy there, y is dx): the forward's y rows in this rank's comb order
  // (y_sorted with one rank alone), and d topk_weights [T, k] (zeroed by the launcher).
  const __nv_bfloat16* y_comb;
  float* d_weights;
  int32_t* chunk_counts;  // the scratch's first part: [E, ceil(T / 32)]
  CopyRow* copy_plan;     // its second part: [T * k] in copy order
  int32_t* slot_rows;
  int32_t* slot_dest;
  int32_t* stats;
  int32_t* phases;  // [kPhases] ns from the start on CTA 0's clock at each phase's end
};

struct KernelParams {
  RankParams rank[kMaxRanks];
  int32_t num_local;      // ranks of this launch
  int32_t absent;         // a rank left out (-1: none)
  int32_t ctas_per_rank;  // G
  int32_t num_tokens, hidden, ffn, top_k, num_experts, n_cap;
  // FP8: the pool holds e4m3 rows [fused_rows, H], then their scales [H/128, pitch] fp32.
  int64_t pool_scale_offset;  // bytes from a pool's start to its scales
  int64_t pool_scale_pitch;   // FusedScalePitch(fused_rows)
  int32_t debug;              // FusedForwardProblem::debug (kFusedDebug* bits; 0 normally)
  int32_t l1_n_major;         // L1 tiles N-block-major in an expert (fused_tile_order.h)
  int32_t copy_head_percent;  // of the copy plan, copied before the GEMMs (fused_copy_head.h)
};
// Kernel parameters may take 32,764 bytes (CUDA 12.1+, sm_70+).
static_assert(sizeof(KernelParams) <= 32764, "the fused kernel's parameters are too large");

// ------------------------------------------------------------------------ engine glue

// This CTA's tiles: all L1 tiles of the rank, then all L2 tiles, CTA c taking c, c + G, ...
struct TileSchedule {
  Walk walk;
  int tile, stride, l1_tiles, l2_tiles, l1_blocks_n, l2_blocks_n;
  bool l1_n_major;
  int cursor1 = 0, cursor2 = 0;

  // Called by every lane of the producer warp (each with its own copy): warp-uniform.
  __device__ __forceinline__ bool next(ExpertTile& job) {
    int t = tile;
    tile += stride;
    if (t < l1_tiles) {
      job = walk.decode(t, l1_blocks_n, sm90::kL1GateUp, cursor1, l1_n_major);
      return true;
    }
    t -= l1_tiles;
    if (t < l2_tiles) {
      job = walk.decode(t, l2_blocks_n, sm90::kL2Down, cursor2);
      return true;
    }
    return false;
  }
};

struct TileHooks {
  static constexpr int kStoreFence = 1;  // L1's h is read by this GPU's L2 tiles
  const PeerView* view;
  unsigned long long* rows_arrived;  // ftiles of this rank
  unsigned long long* l1_done;       // fl1done of this rank
  int l1_blocks_n;

  __device__ __forceinline__ void wait_rows_ready(const ExpertTile& t) const {
    if (t.kind == sm90::kL1GateUp) {
      ep::WaitAtLeast<false>(*view, rows_arrived + t.mb_global,
                             static_cast<unsigned long long>(t.rows), ep::kStageFusedRows, -1,
                             t.mb_global);
    } else {
      ep::WaitAtLeast<false>(*view, l1_done + t.mb_global,
                             static_cast<unsigned long long>(l1_blocks_n), ep::kStageFusedL1, -1,
                             t.mb_global);
    }
  }
  __device__ __forceinline__ void tile_done(const ExpertTile& t) const {
    if (t.kind == sm90::kL1GateUp) {
      asm volatile("red.release.gpu.global.add.u64 [%0], 1;" ::"l"(l1_done + t.mb_global)
                   : "memory");
    }
  }
};

// ------------------------------------------------------------------------ helpers

// The backward's copy, in token order, by every warp before the tiles (tokens first, first +
// stride, ...: phase 7 gives each token's d topk_weights to the same warp, so its NaN after a
// timeout comes after this warp's values): token t's dy chunk is loaded once for all its slots,
// as backend cuda's CombineBwdRecvKernel does; for each slot j with a pool row, w[t, j] * dy[t]
// (bf16, as cuda rounds it) goes to that row at the expert's rank, and d topk_weights[t, j] =
// <dy[t], y_comb[slot_rows[t, j]]> in CombineBwdRecvKernel's order (per chunk of 32 x
// ep::kSlotDotVecs vectors: each lane's fma chain, a butterfly sum, the chunks added in order),
// so both backends give the same bits. Two slots' y vectors are in flight at once. Slots without
// a pool row (masked, repeated, dropped) keep the launcher's 0. In pool order (CopyPlannedRows)
// every slot would read its dy row again, from DRAM once dy outgrows the L2 cache (30B shape:
// 8 x 64 MiB); the arrivals are counted after the rank's barrier (ReleaseCopiedArrivals).
__device__ __forceinline__ void CopyTokenSlots(const KernelParams& P, const RankParams& A,
                                               int first, int stride) {
  constexpr int kV = ep::kSlotDotVecs;
  const int lane = threadIdx.x & 31, K = P.top_k;
  const int El = P.num_experts / A.view.num_ranks;
  const int nvec = P.hidden * static_cast<int>(sizeof(__nv_bfloat16)) / 16;
  const uint4* y = reinterpret_cast<const uint4*>(A.y_comb);
  for (int t = first; t < P.num_tokens; t += stride) {
    const size_t s0 = static_cast<size_t>(t) * K;
    const int dest_j = lane < K ? __ldcg(A.slot_dest + s0 + lane) : -1;  // phase 4's
    const unsigned valid = __ballot_sync(0xffffffffu, dest_j >= 0);
    if (valid == 0u) continue;
    const int row_j = dest_j >= 0 ? __ldcg(A.slot_rows + s0 + lane) : 0;
    const int rank_j = dest_j >= 0 ? __ldg(A.ids + s0 + lane) / El : 0;
    const float w_j = dest_j >= 0 ? __ldg(A.weights + s0 + lane) : 0.f;
    const uint4* g = reinterpret_cast<const uint4*>(A.x) + static_cast<size_t>(t) * nvec;
    float total = 0.f;  // lane j: slot j's
    for (int c0 = 0; c0 < nvec; c0 += 32 * kV) {
      uint4 gv[kV];
#pragma unroll
      for (int u = 0; u < kV; ++u) {
        const int c = c0 + u * 32 + lane;
        if (c < nvec) gv[u] = __ldg(g + c);
      }
      // One slot: its y vectors (loaded by the caller) dotted with g, w * g stored.
      const auto slot = [&](int j, const uint4 (&yv)[kV]) {
        const float w = __shfl_sync(0xffffffffu, w_j, j);
        uint4* drow = reinterpret_cast<uint4*>(A.pool[__shfl_sync(0xffffffffu, rank_j, j)]) +
                      static_cast<size_t>(__shfl_sync(0xffffffffu, dest_j, j)) * nvec;
        const float dot = ep::WarpSlotScaleDot<__nv_bfloat16>(gv, yv, w, drow, c0, nvec);
        if (lane == j) total += dot;
      };
      const auto load_y = [&](int j, uint4 (&yv)[kV]) {
        const uint4* yrow = y + static_cast<size_t>(__shfl_sync(0xffffffffu, row_j, j)) * nvec;
#pragma unroll
        for (int u = 0; u < kV; ++u) {
          const int c = c0 + u * 32 + lane;
          if (c < nvec) yv[u] = __ldg(yrow + c);
        }
      };
      for (unsigned bits = valid; bits != 0u;) {
        const int ja = __ffs(bits) - 1;
        bits &= bits - 1u;
        const int jb = bits != 0u ? __ffs(bits) - 1 : -1;
        if (jb >= 0) bits &= bits - 1u;
        uint4 ya[kV], yb[kV];
        load_y(ja, ya);
        if (jb >= 0) load_y(jb, yb);
        slot(ja, ya);
        if (jb >= 0) slot(jb, yb);
      }
    }
    if (dest_j >= 0) A.d_weights[s0 + lane] = total;
  }
  // The expert ranks' TMA (async proxy) reads these rows once the arrivals are released.
  sm90::detail::fence_proxy_async_global();
}

// After the rank's barrier that follows CopyTokenSlots (every CTA's rows written): the arrivals
// of the rank's copied rows, counted on the expert ranks' per-M-block counters. The plan is in
// pool order, so the rows one rank sends to an M-block are consecutive plan rows: per chunk of
// 32 plan rows (chunks first, first + stride, ...), the first lane of each run of one (rank,
// M-block) adds the run's length (release; the barrier ordered every CTA's stores before it).
__device__ __forceinline__ void ReleaseCopiedArrivals(const RankParams& A, int rows, int first,
                                                      int stride) {
  const int lane = threadIdx.x & 31;
  const PeerView& v = A.view;
  for (int c0 = first * 32; c0 < rows; c0 += stride * 32) {
    int4 q = make_int4(-1, -1, -1, -1);
    if (c0 + lane < rows) q = __ldcg(reinterpret_cast<const int4*>(A.copy_plan + c0 + lane));
    const bool live = q.x >= 0;  // not dropped at capacity
    const int prev_rank = __shfl_up_sync(0xffffffffu, q.z, 1);
    const int prev_mblock = __shfl_up_sync(0xffffffffu, q.w, 1);
    const bool prev_live = __shfl_up_sync(0xffffffffu, live ? 1 : 0, 1) != 0;
    const bool starts =
        live && (lane == 0 || !prev_live || prev_rank != q.z || prev_mblock != q.w);
    const unsigned start_bits = __ballot_sync(0xffffffffu, starts);
    const unsigned live_bits = __ballot_sync(0xffffffffu, live);
    if (starts) {
      // The run ends at the next start or the next row that is not live.
      const unsigned after = (start_bits | ~live_bits) & ~((2u << lane) - 1u);
      const int end = after != 0u ? __ffs(after) - 1 : 32;
      ep::AddReleaseSys(reinterpret_cast<unsigned long long*>(v.base[q.z] + v.layout.ftiles) + q.w,
                        static_cast<unsigned long long>(end - lane));
    }
  }
}

// The calling warp's share of the plan rows [begin, end), in chunks of kChunkRows rows: chunks
// first, first + stride, ... (so that the copy of all the warps advances in plan order). Each
// token row is read and written to its pool row (FP8: with its scales); the arrivals are
// counted once per run of rows in one M-block, released after the warp's stores and after the
// proxy fence (the expert rank's TMA reads the rows). One release per run, not per row: a
// release waits for the warp's stores to land, so per row it bounded the copy by the store
// latency (session 13: 1.4 ms for the 30B shape's rows on two warps per SM, as long as L1).
// The forward's copy (the backward's is CopyTokenSlots).
template <class Eng, int kChunkRows>
__device__ __forceinline__ void CopyPlannedRows(const KernelParams& P, const RankParams& A,
                                                int begin, int end, int first, int stride) {
  static_assert(kChunkRows >= 1 && kChunkRows <= 32, "a chunk's plan rows are one per lane");
  const int lane = threadIdx.x & 31;
  const int H = P.hidden;
  const int nvec = H * Eng::kElemBytes / 16;
  const PeerView& v = A.view;
  const auto load_chunk = [&](int c0) {
    int4 q = make_int4(-1, -1, -1, -1);
    if (lane < kChunkRows && c0 + lane < end) {
      q = __ldcg(reinterpret_cast<const int4*>(A.copy_plan + c0 + lane));
    }
    return q;
  };
  // Counts `rows` arrivals on M-block `mblock` of rank `rank`'s pool (nothing when rows is 0).
  const auto release = [&](int rank, int mblock, int rows) {
    if (rows == 0) return;
    __syncwarp();
    sm90::detail::fence_proxy_async_global();
    if (lane == 0) {
      ep::AddReleaseSys(
          reinterpret_cast<unsigned long long*>(v.base[rank] + v.layout.ftiles) + mblock,
          static_cast<unsigned long long>(rows));
    }
  };
  for (int c0 = begin + first * kChunkRows; c0 < end; c0 += stride * kChunkRows) {
    const int4 mine = load_chunk(c0);  // lane i: plan row c0 + i
    const int n = min(kChunkRows, end - c0);
    int run_rank = -1, run_mblock = -1, run_rows = 0;
    for (int i = 0; i < n; ++i) {
      const int token = __shfl_sync(0xffffffffu, mine.x, i);
      if (token < 0) continue;  // dropped at capacity
      const int pool_row = __shfl_sync(0xffffffffu, mine.y, i);
      const int rank = __shfl_sync(0xffffffffu, mine.z, i);
      const int mblock = __shfl_sync(0xffffffffu, mine.w, i);
      if (rank != run_rank || mblock != run_mblock) {
        release(run_rank, run_mblock, run_rows);
        run_rank = rank;
        run_mblock = mblock;
        run_rows = 0;
      }
      uint4* dst = reinterpret_cast<uint4*>(A.pool[rank]) + static_cast<size_t>(pool_row) * nvec;
      const uint4* src = reinterpret_cast<const uint4*>(
          reinterpret_cast<const char*>(A.x) + static_cast<size_t>(token) * H * Eng::kElemBytes);
      ep::WarpCopyRow<kCopyUnroll>(
          nvec, [&](int c) { return __ldg(src + c); }, [&](auto&& store) { store(dst); });
      if constexpr (Eng::kFp8) {  // the row's H/128 scales, K-block-major in the pool
        const int nblk = H / 128;
        float* scales = reinterpret_cast<float*>(A.pool[rank] + P.pool_scale_offset);
        for (int b = lane; b < nblk; b += 32) {
          scales[static_cast<size_t>(b) * P.pool_scale_pitch + pool_row] =
              __ldg(A.x_scale + static_cast<size_t>(token) * nblk + b);
        }
      }
      ++run_rows;
    }
    release(run_rank, run_mblock, run_rows);
  }
}

// ------------------------------------------------------------------------ the kernel

// kBwd: the backward's pass over the same phases (FUSED_BACKWARD_PLAN.md, step 3) with the
// dgrad engine: dy rows (times w) to the pools instead of x rows, dh tiles (SwiGLU backward
// from the forward's gate_up) then dx tiles instead of L1 and L2, dx rows to the sources' comb
// rows, and the unweighted slot sum into dx. The routing is the forward's again (same ids, same
// pool rows); its plan rows name slots, for the weights and d topk_weights.
template <class Eng, bool kBwd>
__global__ void __launch_bounds__(kThreads, 1)
    FusedMoeKernel(const __grid_constant__ KernelParams P) {
  const int slot = blockIdx.x / P.ctas_per_rank;  // which local rank this CTA works for
  const int cta = blockIdx.x % P.ctas_per_rank;
  if (threadIdx.x == 0) sm90::profile::cta_begin();  // (nothing unless MEGAMOE_ENGINE_PROFILE)
  if (slot >= P.num_local || slot == P.absent) return;
  const RankParams& A = P.rank[slot];
  const PeerView& v = A.view;
  const ep::WorkspaceLayout& L = v.layout;
  FusedSmem<Eng>& S = Smem<Eng>();
  ep::FusedSignals* sig = v.fused_signals(v.rank);

  const int G = P.ctas_per_rank, T = P.num_tokens, K = P.top_k, E = P.num_experts;
  const int H = P.hidden, F = P.ffn, n_cap = P.n_cap;
  const int R = v.num_ranks, me = v.rank, El = E / R;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int gwarp = cta * kWarps + warp, nwarps = G * kWarps;
  const int gthread = cta * kThreads + threadIdx.x, nthreads = G * kThreads;

  // CTA 0's clock at each phase's end (fused_moe.h: kFusedPhases), for the breakdown benchmark.
  const unsigned long long t0 = ep::GlobalTimerNs();
  auto stamp = [&](int phase) { A.phases[phase] = static_cast<int32_t>(ep::GlobalTimerNs() - t0); };
  auto mark = [&](int phase) {
    if (cta == 0 && threadIdx.x == 0) stamp(phase);
  };
  mark(0);
  auto* rows_arrived = reinterpret_cast<unsigned long long*>(v.base[me] + L.ftiles);
  auto* l1_done = reinterpret_cast<unsigned long long*>(v.base[me] + L.fl1done);

  // ---- 1-4 route, counts, layout, plan (ffi/scheduler/fused_routing.cuh).
  const RoutingResult rr = RouteAndPlan<Engine::kBlockM, kWarps, kBwd>(
      A, RoutingShape{T, K, E, n_cap}, v, rows_arrived, l1_done,
      RoutingSmem<Engine::kBlockM, kWarps>{
          *reinterpret_cast<RankRoutingScratch*>(&S.engine.a[0][0]), S.tables, S.walk, S.totals},
      cta, G, mark);
  const unsigned long long epoch = rr.epoch;
  const bool routed = rr.routed, copying = rr.copying;
  mark(3);

  // Forward: the plan's head, copied by every warp before the tiles start: the first tiles'
  // rows, and a lead for the copy warps, which copy the rest beside the tiles (phase 5).
  // Backward: the whole copy, in token order, then the arrivals after the rank's barrier (every
  // CTA calls it, copying or not; measured: RESULTS.md session 21).
  const int copy_rows = S.totals.copy_rows;
  const int copy_head = kBwd ? 0  // (the forward's only)
                             : static_cast<int>(static_cast<int64_t>(copy_rows) *
                                                P.copy_head_percent / 100);
  if constexpr (kBwd) {
    if (copying) CopyTokenSlots(P, A, gwarp, nwarps);
    if (ep::RankBarrier(v, G) && copying) ReleaseCopiedArrivals(A, copy_rows, gwarp, nwarps);
  } else {
    if (copying) CopyPlannedRows<Eng, kHeadChunkRows>(P, A, 0, copy_head, gwarp, nwarps);
  }
  mark(4);

  // The stage ring is the engine's from here: its generic (routing) accesses are ordered before
  // the TMA writes that refill it (async proxy).
  cutlass::arch::fence_view_async_shared();
  __syncthreads();

  // ---- 5 GEMMs on the tile engine.
  if (threadIdx.x == 0) Eng::init(S.engine);
  __syncthreads();
  // Tiles per M-block of the first GEMM (L1: 128 h columns each; dh: 256 of F) and the second.
  const int l1_n = kBwd ? F / Engine::kBlockN : F / 128, l2_n = H / Engine::kBlockN;
  if (warp < Eng::kFirstMathWarp) {
    cutlass::arch::warpgroup_reg_dealloc<Eng::kProducerRegs>();
    if (warp == Eng::kProducerWarp) {
      TileSchedule sched;
      sched.walk.s = &S.walk;
      sched.walk.num_experts = El;
      sched.tile = cta;
      sched.stride = G;
      // Debug knob (fused_moe.h): no L2 tiles, or no GEMM tiles at all. Nothing waits on a
      // skipped tile (L2 waits on L1, never the reverse), so the kernel still completes.
      const bool l1_on = routed && !(P.debug & kFusedDebugNoGemm);
      const bool l2_on = l1_on && !(P.debug & kFusedDebugNoL2);
      sched.l1_tiles = l1_on ? S.totals.total_blocks * l1_n : 0;
      sched.l2_tiles = l2_on ? S.totals.total_blocks * l2_n : 0;
      sched.l1_blocks_n = l1_n;
      sched.l2_blocks_n = l2_n;
      sched.l1_n_major = P.l1_n_major != 0;
      const TileHooks hooks{&v, rows_arrived, l1_done, l1_n};
      Eng::producer(S.engine, A.engine, sched, hooks);
    } else if (warp == Eng::kSignallerWarp) {
      const TileHooks hooks{&v, rows_arrived, l1_done, l1_n};
      Eng::signaller(S.engine, A.engine, hooks);
    } else {  // the copy warps
      const int w = warp - kFirstCopyWarp;
      if constexpr (!kBwd) {
        if (copying) {
          CopyPlannedRows<Eng, kCopyChunkRows>(P, A, copy_head, S.totals.copy_rows,
                                               cta * kCopyWarps + w, G * kCopyWarps);
        }
      }
      if (cta == 0 && w == 0 && lane == 0) stamp(5);
    }
    cutlass::arch::warpgroup_reg_alloc<168>();
  } else {
    cutlass::arch::warpgroup_reg_alloc<Eng::kMathRegs>();
    Eng::math(S.engine, A.engine);
    cutlass::arch::warpgroup_reg_dealloc<168>();
  }

  // ---- 6 results: every result of this rank's tiles is stored; tell the sources, wait for ours.
  ep::RankBarrier(v, G);
  mark(6);
  if (cta == 0 && threadIdx.x == 0 && !ep::RankFailed(v)) {
    __threadfence_system();
    for (int q = 0; q < R; ++q) {
      ep::StoreReleaseSys(&v.fused_signals(q)->results_ready[me], epoch + 1);
    }
  }
  if (threadIdx.x == 0) {
    for (int q = 0; q < R; ++q) {
      if (!ep::WaitAtLeast<false>(v, &sig->results_ready[q], epoch + 1, ep::kStageFusedResults, q)) {
        break;
      }
    }
  }
  const bool failed = ep::BlockRankFailed(v);
  mark(7);

  // ---- 7 combine: y[t] = sum over slots j (in order) of w[t, j] * comb[slot row] in fp32.
  const int row_vecs_bf16 = H * static_cast<int>(sizeof(__nv_bfloat16)) / 16;  // y, comb rows
  const uint4* comb = reinterpret_cast<const uint4*>(A.comb);
  const auto load = [&](int row, int c) {
    return ep::LoadPeerWritten(comb + static_cast<size_t>(row) * row_vecs_bf16 + c);
  };
  for (int t = gwarp; t < T; t += nwarps) {
    uint4* dst = reinterpret_cast<uint4*>(A.y + static_cast<size_t>(t) * H);
    if (failed) {
      for (int c = lane; c < row_vecs_bf16; c += 32)
        dst[c] = ep::NanVec16(static_cast<const __nv_bfloat16*>(nullptr));
      if (kBwd && lane < K) A.d_weights[static_cast<size_t>(t) * K + lane] = __int_as_float(0x7fc00000);
      continue;
    }
    const size_t s0 = static_cast<size_t>(t) * K;
    const int row_j = lane < K ? __ldcg(A.slot_rows + s0 + lane) : -1;
    const float w_j = lane < K ? __ldg(A.weights + s0 + lane) : 0.f;
    const unsigned valid = __ballot_sync(0xffffffffu, row_j >= 0);
    for (int c0 = 0; c0 < row_vecs_bf16; c0 += 32 * ep::kSlotSumVecs) {
      float acc[ep::kSlotSumVecs][8];
#pragma unroll
      for (int u = 0; u < ep::kSlotSumVecs; ++u)
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[u][q] = 0.f;
      ep::WarpSlotSum<__nv_bfloat16, !kBwd>(valid, row_j, w_j, c0, row_vecs_bf16, load, acc);
#pragma unroll
      for (int u = 0; u < ep::kSlotSumVecs; ++u) {
        const int c = c0 + u * 32 + lane;
        if (c < row_vecs_bf16)
          dst[c] = ep::Pack(acc[u], static_cast<const __nv_bfloat16*>(nullptr));
      }
    }
  }

  // Rows that peers wrote out to XLA buffers, by all the rank's warps in one loop (NaN when the
  // rank failed; two loops spilled more):
  // - this rank's pool rows (residual x_sorted, several ranks; FP8 with their scales, row-major
  //   [n_cap, H/128] as cuda_fp8.QuantizedRows): every source's copies into the pool landed
  //   before its results_ready release that phase 6 acquired (and the next call's sources write
  //   only after this rank's next counts). Rows past the last group stay unwritten, as the
  //   pool's own rows with one rank alone (no GEMM of the backward reads them);
  // - then its comb rows (residual y_comb, several ranks: the backward's d topk_weights read
  //   them at the source), rows [0, the rank's slots); a dropped slot's row is never read.
  const int pool_rows = min(S.totals.total_rows, n_cap);
  const size_t pool_vecs = A.pool_rows_out != nullptr
                               ? static_cast<size_t>(pool_rows) * (H * Eng::kElemBytes / 16) : 0;
  const size_t out_vecs =
      pool_vecs + (A.comb_rows_out != nullptr
                       ? static_cast<size_t>(S.totals.copy_rows) * row_vecs_bf16 : 0);
  {
    const uint4* __restrict__ pool_src = reinterpret_cast<const uint4*>(A.pool[me]);
    const uint4* __restrict__ comb_src = reinterpret_cast<const uint4*>(A.comb);
    uint4* __restrict__ pool_dst = reinterpret_cast<uint4*>(A.pool_rows_out);
    uint4* __restrict__ comb_dst = reinterpret_cast<uint4*>(A.comb_rows_out);
    const uint4 nan = ep::NanVec16(static_cast<const __nv_bfloat16*>(nullptr));
    constexpr int kVecs = 4;  // 16-byte vectors per lane in flight; a warp's are contiguous
    for (size_t i0 = static_cast<size_t>(gwarp) * 32 * kVecs + lane; i0 < out_vecs;
         i0 += static_cast<size_t>(nwarps) * 32 * kVecs) {
      uint4 q[kVecs];
#pragma unroll
      for (int u = 0; u < kVecs; ++u) {
        const size_t i = i0 + u * 32;
        if (i < out_vecs)
          q[u] = failed ? nan
                        : ep::LoadPeerWritten(i < pool_vecs ? pool_src + i
                                                            : comb_src + (i - pool_vecs));
      }
#pragma unroll
      for (int u = 0; u < kVecs; ++u) {
        const size_t i = i0 + u * 32;
        if (i < out_vecs) *(i < pool_vecs ? pool_dst + i : comb_dst + (i - pool_vecs)) = q[u];
      }
    }
  }
  // The backward's wgrad operands of a failed rank: NaN, whole (cuda poisons its dy_sorted too),
  // so that no finite weight gradient comes out of a call that timed out.
  if (kBwd && failed) {
    const uint4 nan = ep::NanVec16(static_cast<const __nv_bfloat16*>(nullptr));
    uint4* dys = reinterpret_cast<uint4*>(A.pool_rows_out != nullptr ? A.pool_rows_out : A.pool[me]);
    uint4* dgu = reinterpret_cast<uint4*>(A.engine.dgate_up);
    const size_t dys_vecs = static_cast<size_t>(n_cap) * row_vecs_bf16;
    const size_t dgu_vecs = static_cast<size_t>(n_cap) * (2 * F) * 2 / 16;
    for (size_t i = gthread; i < dys_vecs + dgu_vecs; i += nthreads) {
      if (i < dys_vecs) dys[i] = nan; else dgu[i - dys_vecs] = nan;
    }
  }
  if (A.pool_rows_out != nullptr) {
    const int rows = pool_rows;
    if constexpr (Eng::kFp8) {  // the pool's scales are K-block-major: [H/128, pitch]
      const int nblk = H / 128;
      const float* scales = reinterpret_cast<const float*>(A.pool[me] + P.pool_scale_offset);
      for (int i = gthread; i < rows * nblk; i += nthreads) {
        const int r = i / nblk, b = i % nblk;
        A.pool_scales_out[i] =
            failed ? __int_as_float(0x7fc00000)
                   : __ldcg(scales + static_cast<size_t>(b) * P.pool_scale_pitch + r);
      }
    }
  }

  mark(8);
  if (cta == 0 && threadIdx.x == 0) {
    A.stats[0] = S.totals.total_rows;
    A.stats[1] = n_cap;
    if (S.totals.total_rows > n_cap) atomicOr(A.stats + 2, 1);
    // The rank's next call starts from the next epoch (every CTA has read this one).
    *reinterpret_cast<volatile unsigned long long*>(&sig->uses) = epoch + 1;
  }
}

}  // namespace

int64_t FusedScratchInts(int64_t num_tokens, int64_t num_experts, int64_t top_k) {
  static_assert(sizeof(CopyRow) == 4 * sizeof(int32_t), "a plan row is 4 ints");
  return CopyPlanOffsetInts(num_tokens, num_experts) + num_tokens * top_k * 4;
}

std::string FusedForwardUnsupported(const FusedForwardProblem& p, const ep::WorkspaceLayout& l,
                                    int num_ranks) {
  auto num = [](int64_t v) { return std::to_string(v); };
  if (l.fused_rows == 0) return "the symmetric workspace has no fused regions (fused_rows = 0)";
  if (l.elem_bytes != 2) return "the workspace is not sized for bf16 rows";
  if (p.n_cap < 1 || p.n_cap > l.fused_rows)
    return "n_cap " + num(p.n_cap) + " must be in [1, the workspace's fused_rows " +
           num(l.fused_rows) + "]";
  if (p.num_tokens > l.max_tokens)
    return "tokens per rank " + num(p.num_tokens) + " > workspace max_tokens " + num(l.max_tokens);
  if (p.top_k < 1 || p.top_k > l.top_k || p.top_k > 32)
    return "top_k " + num(p.top_k) + " must be in [1, min(32, workspace top_k " + num(l.top_k) +
           ")]";
  if (p.hidden > l.hidden) return "hidden " + num(p.hidden) + " > workspace hidden " + num(l.hidden);
  if (p.hidden % Engine::kBlockN != 0 || p.hidden < Engine::kBlockN)
    return "hidden " + num(p.hidden) + " must be a positive multiple of " + num(Engine::kBlockN);
  if (p.ffn % 128 != 0 || p.ffn < 128)
    return "ffn " + num(p.ffn) + " must be a positive multiple of 128";
  if (p.num_experts < num_ranks || p.num_experts % num_ranks != 0 ||
      p.num_experts > kFusedMaxExperts)
    return "num_experts " + num(p.num_experts) + " must be a multiple of the " + num(num_ranks) +
           " ranks and at most " + num(kFusedMaxExperts);
  if (static_cast<int64_t>(num_ranks) * p.num_tokens * p.top_k > (int64_t{1} << 31) - 1)
    return "ranks * tokens * top_k overflows int32 (pool positions)";
  if (p.fp8) {
    // e4m3 rows and their scales in the pool region sized for bf16 rows of the workspace's H.
    const int64_t need = l.fused_rows * int64_t(p.hidden) +
                         int64_t(p.hidden / 128) * FusedScalePitch(l.fused_rows) * 4;
    if (need > l.fused_rows * l.hidden * l.elem_bytes)
      return "the pool of " + num(l.fused_rows) + " rows cannot hold FP8 rows with their scales "
             "(fused_rows too small)";
  }
  return "";
}

namespace {

// The launch of one engine's kernel: cooperative (every CTA co-resident before any waits).
template <class Eng, bool kBwd>
std::string LaunchKernel(const KernelParams& params, int grid, cudaStream_t stream) {
  const char* what = kBwd ? "fused backward" : "fused forward";
  const size_t smem = sizeof(FusedSmem<Eng>);
  // Per device (a function attribute of the current device's context); cheap to repeat.
  if (cudaError_t e = cudaFuncSetAttribute(FusedMoeKernel<Eng, kBwd>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem));
      e != cudaSuccess) {
    return std::string(what) + ": shared memory attribute: " + cudaGetErrorString(e);
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  if (cudaError_t e = cudaLaunchKernelEx(&config, FusedMoeKernel<Eng, kBwd>, params);
      e != cudaSuccess) {
    return std::string(what) + " launch: " + cudaGetErrorString(e);
  }
  return "";
}

// The parameters every launch shares; CTAs per rank from the problem's budget. "" or why not.
std::string CommonParams(const FusedForwardProblem& p, int count, int absent,
                         KernelParams& params) {
  if (count < 1 || count > kMaxRanks) return "bad number of local ranks " + std::to_string(count);
  int device = 0;
  cudaGetDevice(&device);
  const int sms = CurrentDeviceSmCount(), major = CurrentDeviceComputeMajor();
  if (major != 9) {
    return "the fused kernel is sm_90a only (wgmma, TMA); device " + std::to_string(device) +
           " has compute capability " + std::to_string(major) + ".x";
  }
  // max_ctas > 0: at most that many; <= 0: every SM but -max_ctas (room for other kernels).
  const int budget = p.max_ctas > 0 ? std::min(p.max_ctas, sms) : sms + p.max_ctas;
  const int per_rank = budget / count;
  if (per_rank < 1)
    return "max_ctas " + std::to_string(budget) + " leaves no CTA for each of the " +
           std::to_string(count) + " local ranks";
  params.num_local = count;
  params.absent = absent;
  params.ctas_per_rank = per_rank;
  params.num_tokens = p.num_tokens;
  params.hidden = p.hidden;
  params.ffn = p.ffn;
  params.top_k = p.top_k;
  params.num_experts = p.num_experts;
  params.n_cap = p.n_cap;
  params.debug = p.debug;
  // The forward's copy head (the backward's pass copies everything first, in token order).
  return heuristics::FusedCopyHeadPercent(&params.copy_head_percent);
}

// Debug knob kFusedDebugSync: name a fault of this kernel here instead of at some later XLA
// operation.
std::string DebugSync(const FusedForwardProblem& p, const char* what, cudaStream_t stream) {
  if (!(p.debug & kFusedDebugSync)) return "";
  if (cudaError_t e = cudaStreamSynchronize(stream); e != cudaSuccess)
    return std::string(what) + " kernel failed (debug sync): " + cudaGetErrorString(e);
  return "";
}

}  // namespace

std::string LaunchFusedForward(const FusedRankOperands* ranks, int count, int absent,
                               const FusedForwardProblem& p, cudaStream_t stream) {
  // ~17.5 KB (tensor maps): on the heap, copied into the launch by cudaLaunchKernelEx.
  auto owned = std::make_unique<KernelParams>();
  KernelParams& params = *owned;
  if (std::string err = CommonParams(p, count, absent, params);
      !err.empty())
    return err;
  const ep::WorkspaceLayout& L = ranks[0].view->layout;
  const int per_rank = params.ctas_per_rank;
  bool l1_n_major = false;
  if (std::string err = heuristics::FusedL1NMajor(p.hidden, p.ffn, p.fp8 != 0, &l1_n_major);
      !err.empty())
    return "fused forward: " + err;
  params.l1_n_major = l1_n_major ? 1 : 0;
  const int R = ranks[0].view->num_ranks;
  const int64_t El = p.num_experts / R, H = p.hidden, F = p.ffn;
  const bool fp8 = p.fp8 != 0;
  // FP8 pool: e4m3 rows [fused_rows, H], then their scales [H/128, pitch] (fp32).
  params.pool_scale_offset = fp8 ? L.fused_rows * H : 0;
  params.pool_scale_pitch = FusedScalePitch(L.fused_rows);
  const int64_t h_scale_pitch = FusedScalePitch(p.n_cap);
  bool any_l2_tma = false;  // counted (launch_counts.h), so that a test sees the mode was taken
  for (int r = 0; r < count; ++r) {
    const FusedRankOperands& o = ranks[r];
    RankParams& rp = params.rank[r];
    rp.view = *o.view;
    rp.x = static_cast<const __nv_bfloat16*>(o.x);
    rp.x_scale = o.x_scale;
    rp.ids = o.ids;
    rp.weights = o.weights;
    rp.y = static_cast<__nv_bfloat16*>(o.y);
    rp.chunk_counts = o.scratch;
    rp.copy_plan = reinterpret_cast<CopyRow*>(
        o.scratch + CopyPlanOffsetInts(p.num_tokens, p.num_experts));
    rp.slot_rows = o.slot_rows;
    rp.slot_dest = o.slot_dest;
    rp.group_sizes = o.group_sizes;
    // Redirected to XLA buffers: bf16 with one rank alone, the pool is x_sorted; otherwise phase
    // 7 copies the pool out to it (FP8: with its scales, which live past the pool's rows).
    const bool pool_is_x_sorted = o.x_sorted != nullptr && !fp8 && R == 1 && count == 1;
    rp.pool_rows_out = pool_is_x_sorted ? nullptr : o.x_sorted;
    rp.pool_scales_out = fp8 && o.x_sorted != nullptr ? o.x_sorted_scale : nullptr;
    const bool comb_is_y_sorted = o.y_sorted != nullptr && R == 1 && count == 1;
    rp.comb_rows_out = R == 1 && count == 1 ? nullptr : o.y_comb;
    for (int q = 0; q < R; ++q) rp.pool[q] = o.view->base[q] + L.fpool;
    if (pool_is_x_sorted) rp.pool[0] = static_cast<char*>(o.x_sorted);
    rp.comb = comb_is_y_sorted ? static_cast<const __nv_bfloat16*>(o.y_sorted)
                               : reinterpret_cast<const __nv_bfloat16*>(o.view->base[o.view->rank] +
                                                                        L.fcomb);
    rp.stats = o.stats;
    rp.phases = o.phases;
    EngineParams& ep_ = rp.engine;
    sm90::GemmOperands& l1 = ep_.op[sm90::kL1GateUp];
    sm90::GemmOperands& l2 = ep_.op[sm90::kL2Down];
    std::string err;
    char* my_pool = rp.pool[o.view->rank];
    if (!fp8) {
      // Pool rows are packed with this call's H (the region holds fused_rows x layout.hidden).
      if (!(err = MakeRowMajorTensorMap(&l1.a_map, my_pool, pool_is_x_sorted ? p.n_cap : L.fused_rows,
                                        H, H, 64, 128))
               .empty() ||
          !(err = MakeRowMajorTensorMap(&l1.b_map, o.w_gate_up, El * H, 2 * F, 2 * F, 64, 64))
               .empty() ||
          !(err = MakeRowMajorTensorMap(&l2.a_map, o.h, p.n_cap, F, F, 64, 128)).empty() ||
          !(err = MakeRowMajorTensorMap(&l2.b_map, o.w_down, El * F, H, H, 64, 64)).empty()) {
        return "fused forward: " + err;
      }
      ep_.h = static_cast<__nv_bfloat16*>(o.h);
    } else {
      // e4m3, K-major: A rows [rows, K], B the quantised weights [E/R * N, K]; boxes of 128 K
      // bytes x 128 rows; the scales K-block-major, boxes of 128 rows.
      if (!(err = MakeRowMajorTensorMap(&l1.a_map, my_pool, L.fused_rows, H, H, 128, 128, 1))
               .empty() ||
          !(err = MakeScaleTensorMap(&l1.sa_map, my_pool + params.pool_scale_offset, H / 128,
                                     params.pool_scale_pitch, L.fused_rows))
               .empty() ||
          !(err = MakeRowMajorTensorMap(&l1.b_map, o.w_gate_up, El * 2 * F, H, H, 128, 128, 1))
               .empty() ||
          !(err = MakeRowMajorTensorMap(&l2.a_map, o.h, p.n_cap, F, F, 128, 128, 1)).empty() ||
          !(err = MakeScaleTensorMap(&l2.sa_map, o.h_scale, F / 128, h_scale_pitch, p.n_cap))
               .empty() ||
          !(err = MakeRowMajorTensorMap(&l2.b_map, o.w_down, El * H, F, F, 128, 128, 1))
               .empty()) {
        return "fused forward: " + err;
      }
      // Debug knob: the first build's unaligned A-scale box starts (A/B of the aligned ones).
      l1.sa_unaligned = l2.sa_unaligned = (p.debug & kFusedDebugUnalignedScales) ? 1 : 0;
      l1.b_scale = o.w_gate_up_scale;
      l1.n = static_cast<int32_t>(2 * F);
      l2.b_scale = o.w_down_scale;
      l2.n = static_cast<int32_t>(H);
      ep_.h = nullptr;
      ep_.h_q = static_cast<uint8_t*>(o.h);
      ep_.h_scale = o.h_scale;
      ep_.h_scale_pitch = h_scale_pitch;
      ep_.pow2 = p.pow2;
    }
    // nullptr: not stored (debug knob kFusedDebugNoGateUp: not stored even when kept). L1
    // stores it by TMA, {64, 64} boxes (both recipes keep it in bf16).
    ep_.gate_up = (p.debug & kFusedDebugNoGateUp) ? nullptr
                                                  : static_cast<__nv_bfloat16*>(o.gate_up);
    if (ep_.gate_up != nullptr &&
        !(err = MakeRowMajorTensorMap(&ep_.gate_up_map, ep_.gate_up, p.n_cap, 2 * F, 2 * F, 64,
                                      64))
             .empty()) {
      return "fused forward: " + err;
    }
    l1.k = static_cast<int32_t>(H);
    l1.a_load = static_cast<int32_t>(sm90::ALoad::kTmaBlock);
    l2.k = static_cast<int32_t>(F);
    l2.a_load = static_cast<int32_t>(sm90::ALoad::kTmaBlock);
    ep_.f = static_cast<int32_t>(F);
    for (int q = 0; q < kMaxRanks; ++q) ep_.l2_dest.base[q] = o.view->base[q];
    ep_.l2_dest.comb_offset = L.fcomb;
    if (comb_is_y_sorted) {
      ep_.l2_dest.base[0] = static_cast<char*>(o.y_sorted);
      ep_.l2_dest.comb_offset = 0;
    } else if (o.y_sorted != nullptr) {
      ep_.l2_copy = static_cast<__nv_bfloat16*>(o.y_sorted);
      ep_.l2_copy_ld = H;
    }
    ep_.l2_dest.num_ranks = R;
    ep_.l2_dest.hidden = static_cast<int32_t>(H);
    // One rank alone: a slot's comb row is its pool row (fused_routing.cuh: both are the prefix
    // of the same counts), so L2's rows are contiguous there and go out by TMA.
    const int64_t comb_rows = std::min<int64_t>(p.n_cap, int64_t(p.num_tokens) * p.top_k);
    bool l2_tma = false;
    if (!(err = heuristics::FusedL2RowsByTma(R == 1 && count == 1 && comb_rows > 0, &l2_tma))
             .empty())
      return "fused forward: " + err;
    if (l2_tma) {
      any_l2_tma = true;
      ep_.l2_rows =
          reinterpret_cast<__nv_bfloat16*>(ep_.l2_dest.base[0] + ep_.l2_dest.comb_offset);
      ep_.l2_rows_ld = H;
      if (!(err = MakeRowMajorTensorMap(&ep_.l2_rows_map, ep_.l2_rows, comb_rows, H, H, 64, 64))
               .empty())
        return "fused forward: " + err;
    }
    if (cudaError_t e = cudaMemsetAsync(o.stats, 0, 4 * sizeof(int32_t), stream); e != cudaSuccess)
      return std::string("fused forward: stats memset: ") + cudaGetErrorString(e);
  }
  std::string err = fp8 ? LaunchKernel<Fp8Engine, false>(params, per_rank * count, stream)
                         : LaunchKernel<Engine, false>(params, per_rank * count, stream);
  if (err.empty() && any_l2_tma) CountLaunch(CountedLaunch::kFusedL2RowsByTma);
  if (err.empty() && l1_n_major) CountLaunch(CountedLaunch::kFusedL1NMajor);
  if (err.empty()) err = DebugSync(p, fp8 ? "FP8 fused forward" : "bf16 fused forward", stream);
  return err;
}

std::string LaunchFusedBackward(const FusedBackwardRankOperands* ranks, int count, int absent,
                                const FusedForwardProblem& p, cudaStream_t stream) {
  if (p.fp8) return "the fused backward's pass is bf16 only";
  if (p.hidden % DgradEngine::kBlockN != 0 || p.ffn % DgradEngine::kBlockN != 0)
    return "the fused backward needs hidden and ffn multiples of 256 (the dgrad tiles); got " +
           std::to_string(p.hidden) + " and " + std::to_string(p.ffn);
  auto owned = std::make_unique<KernelParams>();
  KernelParams& params = *owned;
  if (std::string err = CommonParams(p, count, absent, params);
      !err.empty())
    return err;
  const ep::WorkspaceLayout& L = ranks[0].view->layout;
  const int per_rank = params.ctas_per_rank;
  params.l1_n_major = 0;
  const int R = ranks[0].view->num_ranks;
  const int64_t El = p.num_experts / R, H = p.hidden, F = p.ffn;
  for (int r = 0; r < count; ++r) {
    const FusedBackwardRankOperands& o = ranks[r];
    RankParams& rp = params.rank[r];
    rp.view = *o.view;
    rp.x = static_cast<const __nv_bfloat16*>(o.dy);
    rp.ids = o.ids;
    rp.weights = o.weights;
    rp.y = static_cast<__nv_bfloat16*>(o.dx);
    rp.y_comb = static_cast<const __nv_bfloat16*>(o.y_comb);
    rp.d_weights = o.d_weights;
    rp.chunk_counts = o.scratch;
    rp.copy_plan = reinterpret_cast<CopyRow*>(
        o.scratch + CopyPlanOffsetInts(p.num_tokens, p.num_experts));
    rp.slot_rows = o.slot_rows;
    rp.slot_dest = o.slot_dest;
    rp.group_sizes = o.group_sizes;
    rp.stats = o.stats;
    rp.phases = o.phases;
    // One rank alone: the pool is dy_sorted; otherwise phase 7 copies the pool out to it. The
    // dx rows go to the workspace's comb region in every case (nothing keeps them).
    const bool pool_is_dy_sorted = R == 1 && count == 1;
    for (int q = 0; q < R; ++q) rp.pool[q] = o.view->base[q] + L.fpool;
    if (pool_is_dy_sorted) rp.pool[0] = static_cast<char*>(o.dy_sorted);
    rp.pool_rows_out = pool_is_dy_sorted ? nullptr : o.dy_sorted;
    rp.comb = reinterpret_cast<const __nv_bfloat16*>(o.view->base[o.view->rank] + L.fcomb);
    EngineParams& ep_ = rp.engine;
    sm90::GemmOperands& dh = ep_.op[sm90::kDgradDh];
    sm90::GemmOperands& dx = ep_.op[sm90::kDgradDx];
    char* my_pool = rp.pool[o.view->rank];
    // A: rows in pool order, box {64 K, 128 rows}; B: the weights as stored, read as [E * N, K]
    // (w_down [E, F, H]: N = F, K = H; w_gate_up [E, H, 2F]: N = H, K = 2F), box {64, 128}.
    std::string err;
    if (!(err = MakeRowMajorTensorMap(&dh.a_map, my_pool, pool_is_dy_sorted ? p.n_cap : L.fused_rows,
                                      H, H, 64, 128))
             .empty() ||
        !(err = MakeRowMajorTensorMap(&dh.b_map, o.w_down, El * F, H, H, 64, 128)).empty() ||
        !(err = MakeRowMajorTensorMap(&dx.a_map, o.dgate_up, p.n_cap, 2 * F, 2 * F, 64, 128))
             .empty() ||
        !(err = MakeRowMajorTensorMap(&dx.b_map, o.w_gate_up, El * H, 2 * F, 2 * F, 64, 128))
             .empty()) {
      return "fused backward: " + err;
    }
    dh.n = static_cast<int32_t>(F);
    dh.k = static_cast<int32_t>(H);
    dh.a_load = static_cast<int32_t>(sm90::ALoad::kTmaBlock);
    dx.n = static_cast<int32_t>(H);
    dx.k = static_cast<int32_t>(2 * F);
    dx.a_load = static_cast<int32_t>(sm90::ALoad::kTmaBlock);
    ep_.f = static_cast<int32_t>(F);
    ep_.fwd_gate_up = static_cast<const __nv_bfloat16*>(o.gate_up);
    ep_.dgate_up = static_cast<__nv_bfloat16*>(o.dgate_up);
    for (int q = 0; q < kMaxRanks; ++q) ep_.l2_dest.base[q] = o.view->base[q];
    ep_.l2_dest.comb_offset = L.fcomb;
    ep_.l2_dest.num_ranks = R;
    ep_.l2_dest.hidden = static_cast<int32_t>(H);
    if (cudaError_t e = cudaMemsetAsync(o.stats, 0, 4 * sizeof(int32_t), stream); e != cudaSuccess)
      return std::string("fused backward: stats memset: ") + cudaGetErrorString(e);
    // Slots that no plan row covers (masked, repeated, dropped) keep d topk_weights = 0.
    if (cudaError_t e = cudaMemsetAsync(o.d_weights, 0,
                                        sizeof(float) * p.num_tokens * p.top_k, stream);
        e != cudaSuccess)
      return std::string("fused backward: d_weights memset: ") + cudaGetErrorString(e);
  }
  std::string err = LaunchKernel<DgradEngine, true>(params, per_rank * count, stream);
  if (err.empty()) err = DebugSync(p, "bf16 fused backward", stream);
  return err;
}

std::string ReadFusedEngineProfile(void* dst, size_t bytes, cudaStream_t stream) {
#if MEGAMOE_ENGINE_PROFILE
  constexpr size_t kBytes = sizeof(sm90::profile::g_engine_profile);
  if (bytes != kBytes) {
    return "fused engine profile: the output must be " + std::to_string(kBytes) +
           " bytes, got " + std::to_string(bytes);
  }
  if (cudaError_t e = cudaMemcpyFromSymbolAsync(dst, sm90::profile::g_engine_profile, kBytes, 0,
                                                cudaMemcpyDeviceToDevice, stream);
      e != cudaSuccess)
    return std::string("fused engine profile: ") + cudaGetErrorString(e);
  return "";
#else
  (void)dst;
  (void)bytes;
  (void)stream;
  return "fused engine profile: this extension was built without it (rebuild with "
         "JAX_MEGAMOE_ENGINE_PROFILE=ON)";
#endif
}

}  // namespace megamoe::fused

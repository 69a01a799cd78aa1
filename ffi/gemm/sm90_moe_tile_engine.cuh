// The GEMM roles of the fused MoE kernel on sm_90a (bf16): a persistent, warp-specialised tile
// engine that runs the two expert GEMMs of a SwiGLU MLP over tiles that the caller hands it,
// one tile after another, with one shared-memory ring that keeps running across tiles.
//
//   L1 ("gate/up"): gate_up = A @ w_gate_up[e], A = token rows gathered by index (or contiguous
//        rows in group order); epilogue h = silu(gate) * up (ffi/kernels/swiglu_math.cuh), h
//        stored bf16 to rows of h [rows, F] in group order, optionally also gate_up [rows, 2F].
//   L2 ("down"):     y = h @ w_down[e], A = rows of h in group order; each result row stored
//        bf16 to a per-row destination (a functor: row of the tile -> address, possibly on a
//        peer GPU over NVLink).
//
// Tile: BLOCK_M 128 (two consumer warpgroups of 64 rows) x BLOCK_N 256 x BLOCK_K 64, one
// wgmma m64n256k16 per 16 of K per warpgroup. For L1 a tile of h-columns [c, c + 128) loads gate
// columns [c, c + 128) and up columns [F + c, F + c + 128) side by side into one B stage, so one
// accumulator holds matching gate (columns 0..127) and up (128..255) values: a thread's fragment
// holds accumulator columns 8i + 2(lane % 4) + {0, 1} for i = 0..31, so it owns column j and
// j + 128 together (i and i + 16) and SwiGLU needs no data exchange.
//
// Roles (warps of a 384-thread CTA; the caller's kernel picks the branch, see run_roles()):
//   warp 0        producer: asks the caller's scheduler for the next tile (ExpertTile), calls
//                 hooks.wait_rows_ready(tile) before the tile's first A load, publishes the tile
//                 in a small job ring, then fills the stage ring: B by TMA (4 boxes of 64 N x
//                 64 K, 128B swizzle, natural [E, K, N] layout = N-major B), A by one of
//                   kTmaBlock:     one TMA box {64 K, 128 rows} over rows contiguous in group
//                                  order (the fast path: see FUSED_CORE_NOTES.md),
//                   kTmaRows:      one TMA box {64 K, 1 row} per row, row index from a list
//                                  (the 128B swizzle is a function of the smem address, so a
//                                  row written at stage + r * 128 lands exactly where the
//                                  128-row box would have put it) — correct but op-bound,
//                   kCpAsyncRows:  cp.async 16-byte copies with the 128B swizzle applied by
//                                  hand (8 lanes per row, 4 rows per instruction).
//   warps 1..W    storer (kStorerWarps = W): reads the staged bf16 tile from shared memory with
//                 16-byte loads and writes whole 16-byte vectors per row with generic stores (any
//                 address, a peer's over NVLink too), releases the staging smem, fences, calls
//                 hooks.tile_done(tile). The consumer warpgroups never wait for global stores.
//   other warps   of warpgroup 0: free for the caller (dispatch / combine roles).
//   warps 4..11   two consumer warpgroups: wgmma mainloop, fp32 accumulators (128 regs), then
//                 the epilogue math (SwiGLU or plain cast) into the staging smem.
//
// Epilogue staging lives inside the stage ring: the consumers do not release the stages of a
// tile's last two K-blocks (96 KB) but write the bf16 tile there; the storer releases them
// once it has read them. The producer meanwhile fills the other kStages - 2 stages with the
// next tile, so no smem is set aside for the epilogue and the ring keeps 4 stages. Staging
// slots (128 rows x 128 columns bf16, 256 B per row, 16-byte chunks XOR-swizzled by row % 8,
// conflict-free for both sides): slot 0 = B of the last stage, slot 1 = B of the one before,
// slot 2 = A of the last (rows 0..63) and of the one before (rows 64..127). L1: h -> 0,
// gate -> 1, up -> 2; L2: columns 0..127 -> 0, 128..255 -> 1.
//
// Synchronisation (all mbarriers; the storer warps use one named barrier among themselves):
//   full[s]/empty[s]       the K-stage ring (32 producer-lane arrivals + TMA bytes / 8 warps;
//                          the storer arrives for the two held stages)
//   job_full/job_empty     the job ring, producer -> 8 math warps + storer warps
//   epi_full[2]            staged tile ready, 256 math threads -> storer (tile parity)
// The ring's counters run on across tiles, so the producer loads tile i+1 while the consumers
// finish tile i and the storer writes tile i-1.
//
// Memory-ordering contract of the hooks (the caller implements them):
//   wait_rows_ready(tile): called by lane 0 of the producer warp; return once the A rows of the
//     tile may be read (spin with ld.acquire). The engine then runs __syncwarp() and
//     fence.proxy.async.global on every producer lane before any TMA of the tile, so writes that
//     the acquire made visible (generic stores, NVLink stores, TMA stores) are seen by TMA.
//   tile_done(tile): called by one storer thread once every row of the tile is stored and
//     fenced at Hooks::kStoreFence scope (0: none, 1: fence.acq_rel.gpu, 2: .sys for stores to
//     peers); bump a counter with a release reduction there.
#pragma once

#include <cstdint>

#include <cuda.h>
#include <cuda_bf16.h>

#include "cute/arch/copy_sm90_desc.hpp"
#include "cute/arch/copy_sm90_tma.hpp"
#include "cute/arch/mma_sm90_desc.hpp"
#include "cute/arch/mma_sm90_gmma.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"
#include "ffi/kernels/swiglu_math.cuh"
#include "ffi/scheduler/expert_tile_walk.cuh"

namespace megamoe::fused::sm90 {

// How the producer brings in a tile's A rows.
enum class ALoad : int32_t { kTmaBlock = 0, kTmaRows = 1, kCpAsyncRows = 2 };

// The two GEMMs of the MLP (ExpertTile::kind).
enum GemmKind : int32_t { kL1GateUp = 0, kL2Down = 1 };

// Operands of one GEMM kind. Lives in the caller's __grid_constant__ kernel parameters (TMA
// descriptors must sit in param, const or global memory).
struct alignas(128) GemmOperands {
  CUtensorMap a_map;  // kTmaBlock: rows in group order [R, K], box {64, 128};
                      // kTmaRows: source rows [R, K], box {64, 1}; both bf16, 128B swizzle
  CUtensorMap b_map;  // weights as [E * K, N] (N contiguous), box {64, 64}, 128B swizzle
  const __nv_bfloat16* a_ptr;  // kCpAsyncRows: source rows, row stride lda elements
  int64_t lda;
  const int32_t* row_index;  // kTmaRows / kCpAsyncRows: source row of group row r
  int32_t k;                 // K, a multiple of 64
  int32_t a_load;            // ALoad
};

// Per-row destination of L2 results for the plain standalone GEMM: row r of the tile goes to
// base + dest_row[row_begin + r] * ld (a permutation stands in for combine slots).
struct IndexedRowDest {
  __nv_bfloat16* base;
  const int32_t* dest_row;
  int64_t ld;
  __device__ __forceinline__ __nv_bfloat16* row(const ExpertTile& t, int r) const {
    const int d = __ldg(dest_row + t.row_begin + r);
    return d < 0 ? nullptr : base + int64_t(d) * ld;
  }
};

// Hooks that do nothing (a plain grouped GEMM).
struct NoHooks {
  static constexpr int kStoreFence = 0;  // nothing waits on the stores inside the kernel
  __device__ __forceinline__ void wait_rows_ready(const ExpertTile&) const {}
  __device__ __forceinline__ void tile_done(const ExpertTile&) const {}
};

template <class RowDest>
struct alignas(128) EngineParams {
  GemmOperands op[2];     // [kL1GateUp], [kL2Down]
  __nv_bfloat16* h;       // L1 output [rows, f]
  __nv_bfloat16* gate_up; // optional L1 output [rows, 2f] (nullptr: not stored)
  int32_t f;              // F (L1 gate/up split, h width), a multiple of 128
  int32_t l1_raw_gate;    // benchmark only: 1 = store the gate half as h (no SwiGLU math)
  RowDest l2_dest;        // L2 output rows
};

namespace detail {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// wgmma shared-memory descriptor, 128B swizzle (layout type 1 in bits 62-63).
__device__ __forceinline__ uint64_t gmma_desc_sw128(uint32_t smem_addr, uint32_t lbo_bytes,
                                                    uint32_t sbo_bytes) {
  cute::GmmaDescriptor d;
  d.bitfield.start_address_ = static_cast<uint16_t>(smem_addr >> 4);
  d.bitfield.leading_byte_offset_ = static_cast<uint16_t>(lbo_bytes >> 4);
  d.bitfield.stride_byte_offset_ = static_cast<uint16_t>(sbo_bytes >> 4);
  d.bitfield.base_offset_ = 0;
  d.bitfield.layout_type_ = static_cast<uint8_t>(cute::SM90::GMMA::LayoutType::B128);
  return d.desc_;
}

using Wgmma = cute::SM90::GMMA::MMA_64x256x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K,
                                                              cute::SM90::GMMA::Major::MN>;

template <size_t... I>
__device__ __forceinline__ void wgmma_call(uint64_t da, uint64_t db, float (&d)[128], bool acc,
                                           cute::index_sequence<I...>) {
  Wgmma::fma(da, db, d[I]...,
             acc ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
}

__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

__device__ __forceinline__ void st_shared_b32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ float round_bf16(float x) {
  return __bfloat162float(__float2bfloat16_rn(x));
}

__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

__device__ __forceinline__ void st_global_v4(void* p, uint4 v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive_cnt(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(count)
               : "memory");
}

__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

template <int kScope>
__device__ __forceinline__ void store_fence() {
  if constexpr (kScope == 1) asm volatile("fence.acq_rel.gpu;" ::: "memory");
  if constexpr (kScope == 2) asm volatile("fence.acq_rel.sys;" ::: "memory");
}

__device__ __forceinline__ void cp_async_16(uint32_t smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem), "l"(gmem),
               "r"(valid ? 16 : 0)
               : "memory");
}

}  // namespace detail

template <int kStages_ = 4, int kStorerWarps_ = 1, int kJobSlots_ = 4>
struct Sm90MoeTileEngine {
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = 256;
  static constexpr int kBlockK = 64;
  static constexpr int kStages = kStages_;
  static constexpr int kStorerWarps = kStorerWarps_;
  static constexpr int kJobSlots = kJobSlots_;
  static_assert(kStages >= 3, "two stages hold the staged tile; at least one must stream");
  static_assert(kStorerWarps == 1 || kStorerWarps == 2, "1 or 2 storer warps (warpgroup 0)");

  static constexpr int kThreads = 384;
  static constexpr int kProducerWarp = 0;
  static constexpr int kFirstStorerWarp = 1;
  static constexpr int kFirstMathWarp = 4;
  static constexpr int kMathThreads = 256;
  static constexpr int kProducerRegs = 56;  // warpgroup 0 (producer, storer, free warps)
  static constexpr int kMathRegs = 224;     // 2 x 128 x 224 + 128 x 56 = 64 K registers
  static constexpr uint32_t kStorerBarrier = 1;  // named barrier id among the storer warps

  static constexpr int kABytes = kBlockM * kBlockK * 2;  // 16 KB
  static constexpr int kBBytes = kBlockK * kBlockN * 2;  // 32 KB
  static constexpr int kBBoxBytes = kBlockK * 64 * 2;    // 8 KB: 64 K-rows x 64 N
  static constexpr int kSlotRowBytes = 256;              // 128 bf16 columns per staging slot

  struct alignas(1024) SharedStorage {
    alignas(1024) uint8_t a[kStages][kABytes];
    alignas(1024) uint8_t b[kStages][kBBytes];
    ExpertTile jobs[kJobSlots];
    int32_t row_src[kBlockM];  // kCpAsyncRows: source row of each tile row (producer only)
    __nv_bfloat16* row_dst[kBlockM];  // L2: destination of each tile row (storer only)
    uint64_t full[kStages], empty[kStages];
    uint64_t epi_full[2];
    uint64_t job_full[kJobSlots], job_empty[kJobSlots];
  };

  using Barrier = cutlass::arch::ClusterTransactionBarrier;

  // One thread, before the CTA-wide sync that precedes run_roles().
  __device__ static void init(SharedStorage& ss) {
    for (int s = 0; s < kStages; ++s) {
      Barrier::init(&ss.full[s], 32);  // one arrival per producer lane (+ TMA bytes)
      Barrier::init(&ss.empty[s], kMathThreads / 32);
    }
    for (int b = 0; b < 2; ++b) Barrier::init(&ss.epi_full[b], kMathThreads);
    for (int j = 0; j < kJobSlots; ++j) {
      Barrier::init(&ss.job_full[j], 1);
      Barrier::init(&ss.job_empty[j], kMathThreads / 32 + kStorerWarps);
    }
    cutlass::arch::fence_barrier_init();
  }

  // Base (shared address) of half h (rows 64h .. 64h+63) of staging slot `slot`, for a tile
  // whose last K-block used stage s_last and the one before s_prev.
  __device__ __forceinline__ static uint32_t slot_half(SharedStorage& ss, int slot, int h,
                                                       int s_last, int s_prev) {
    if (slot == 0) return detail::smem_u32(ss.b[s_last]) + h * (64 * kSlotRowBytes);
    if (slot == 1) return detail::smem_u32(ss.b[s_prev]) + h * (64 * kSlotRowBytes);
    return detail::smem_u32(h == 0 ? ss.a[s_last] : ss.a[s_prev]);
  }

  // ---------------------------------------------------------------- producer (one warp)
  // Scheduler: `__device__ bool next(ExpertTile&)`, called by all 32 lanes, warp-uniform.
  template <class Params, class Scheduler, class Hooks>
  __device__ static void producer(SharedStorage& ss, const Params& p, Scheduler& sched,
                                  const Hooks& hooks) {
    const int lane = threadIdx.x & 31;
    if (lane == 0) {
      for (int g = 0; g < 2; ++g) {
        if (p.op[g].k <= 0) continue;  // a GEMM kind the caller does not use
        if (p.op[g].a_load != int32_t(ALoad::kCpAsyncRows))
          cute::prefetch_tma_descriptor(&p.op[g].a_map);
        cute::prefetch_tma_descriptor(&p.op[g].b_map);
      }
    }
    uint32_t it = 0, jn = 0;
    while (true) {
      ExpertTile job;
      const bool more = sched.next(job);
      if (!more) job.kind = -1;
      const int slot = jn % kJobSlots;
      Barrier::wait(&ss.job_empty[slot], ((jn / kJobSlots) & 1) ^ 1);
      if (lane == 0) {
        ss.jobs[slot] = job;
        Barrier::arrive(&ss.job_full[slot]);
      }
      ++jn;
      if (!more) break;

      const GemmOperands& op = p.op[job.kind];
      const ALoad mode = static_cast<ALoad>(op.a_load);
      // Source rows of this tile (the index list is read once per tile).
      int32_t src[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = lane + 32 * i;
        src[i] = -1;
        if (mode != ALoad::kTmaBlock) {
          src[i] = r < job.rows ? __ldg(op.row_index + job.row_begin + r) : -1;
          if (mode == ALoad::kCpAsyncRows)
            ss.row_src[r] = src[i] >= 0 ? src[i] : __ldg(op.row_index + job.row_begin);
        }
      }
      __syncwarp();
      const uint32_t a_bytes = mode == ALoad::kTmaBlock ? uint32_t(kABytes)
                               : mode == ALoad::kTmaRows ? uint32_t(job.rows) * 128u
                                                         : 0u;
      const int num_kb = op.k / kBlockK;
      const int b_row0 = job.expert * op.k;
      // B columns of box j (0..3): L1 = gate [c, c+128) then up [F+c, F+c+128); L2 = 4 x 64.
      const int nb = job.n_block;
      const int b_col = job.kind == kL1GateUp
                            ? ((lane < 2) ? nb * 128 + lane * 64 : p.f + nb * 128 + (lane - 2) * 64)
                            : nb * kBlockN + lane * 64;
      for (int kb = 0; kb < num_kb; ++kb, ++it) {
        const int s = it % kStages;
        Barrier::wait(&ss.empty[s], ((it / kStages) & 1) ^ 1);
        if (lane == 0) Barrier::expect_transaction(&ss.full[s], kBBytes + a_bytes);
        __syncwarp();
        if (lane < 4) {
          cute::SM90_TMA_LOAD_2D::copy(&op.b_map, &ss.full[s], 0ull,
                                       ss.b[s] + lane * kBBoxBytes, b_col, b_row0 + kb * kBlockK);
        }
        if (kb == 0) {
          // B of the first stage is already on its way; now wait for the tile's rows.
          if (lane == 0) hooks.wait_rows_ready(job);
          __syncwarp();
          detail::fence_proxy_async_global();
        }
        if (mode == ALoad::kTmaBlock) {
          if (lane == 0)
            cute::SM90_TMA_LOAD_2D::copy(&op.a_map, &ss.full[s], 0ull, ss.a[s], kb * kBlockK,
                                         job.row_begin);
          Barrier::arrive(&ss.full[s]);
        } else if (mode == ALoad::kTmaRows) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            if (src[i] >= 0)
              cute::SM90_TMA_LOAD_2D::copy(&op.a_map, &ss.full[s], 0ull,
                                           ss.a[s] + (lane + 32 * i) * 128, kb * kBlockK, src[i]);
          }
          Barrier::arrive(&ss.full[s]);
        } else {
          // 8 lanes per row (16 B each), 4 rows per instruction, 32 instructions per stage.
          const uint32_t a_base = detail::smem_u32(ss.a[s]);
          const int c = lane & 7;
          const int r0 = lane >> 3;
          const uint32_t sw_even = uint32_t((c ^ r0) << 4);
          const uint32_t sw_odd = uint32_t((c ^ (r0 + 4)) << 4);
          const __nv_bfloat16* col = op.a_ptr + kb * kBlockK + c * 8;
#pragma unroll 8
          for (int j = 0; j < 32; ++j) {
            const int r = 4 * j + r0;
            const int srow = ss.row_src[r];
            detail::cp_async_16(a_base + r * 128 + ((j & 1) ? sw_odd : sw_even),
                                col + int64_t(srow) * op.lda, r < job.rows);
          }
          cutlass::arch::cpasync_barrier_arrive_noinc(&ss.full[s]);
        }
      }
    }
  }

  // ---------------------------------------------------------------- math (two warpgroups)
  template <class Params>
  __device__ static void math(SharedStorage& ss, const Params& p) {
    const int wg = (threadIdx.x / 128) - kFirstMathWarp / 4;  // 0 or 1 = staging half
    const int warp_in_wg = (threadIdx.x / 32) & 3;
    const int lane = threadIdx.x & 31;
    float acc[128];
    uint32_t it = 0, jn = 0, tn = 0;
    // This thread's rows inside its half: warp_in_wg * 16 + lane / 4 (+ 8); row % 8 = lane / 4.
    const uint32_t row_off = uint32_t(warp_in_wg * 16 + (lane >> 2)) * kSlotRowBytes;
    const uint32_t sw = uint32_t(lane >> 2);
    const uint32_t col_off = uint32_t(lane & 3) * 4;
    while (true) {
      const int slot = jn % kJobSlots;
      Barrier::wait(&ss.job_full[slot], (jn / kJobSlots) & 1);
      const ExpertTile job = ss.jobs[slot];
      __syncwarp();
      if (lane == 0) Barrier::arrive(&ss.job_empty[slot]);
      ++jn;
      if (job.kind < 0) break;

      const GemmOperands& op = p.op[job.kind];
      const bool fence_a = op.a_load == int32_t(ALoad::kCpAsyncRows);
      const int num_kb = op.k / kBlockK;
      if (num_kb < 2) __trap();  // K >= 128: the tile's last two stages become the staging
      for (int kb = 0; kb < num_kb; ++kb, ++it) {
        const int s = it % kStages;
        Barrier::wait(&ss.full[s], (it / kStages) & 1);
        if (fence_a) cutlass::arch::fence_view_async_shared();  // cp.async (generic) -> wgmma
        const uint32_t a_addr = detail::smem_u32(ss.a[s]) + wg * (64 * 128);
        const uint32_t b_addr = detail::smem_u32(ss.b[s]);
#pragma unroll
        for (int i = 0; i < 128; ++i) cute::warpgroup_fence_operand(acc[i]);
        cute::warpgroup_arrive();
#pragma unroll
        for (int k = 0; k < kBlockK / 16; ++k) {
          // A K-major: +32 B per 16 of K inside the swizzled 128 B row; SBO = 8 rows = 1024 B.
          // B N-major: +16 K-rows = 2048 B; LBO = next 64-column box (8 KB); SBO = 1024 B.
          const uint64_t da = detail::gmma_desc_sw128(a_addr + k * 32, 16, 1024);
          const uint64_t db = detail::gmma_desc_sw128(b_addr + k * 2048, kBBoxBytes, 1024);
          detail::wgmma_call(da, db, acc, (kb | k) != 0, cute::make_index_sequence<128>{});
        }
        cute::warpgroup_commit_batch();
#pragma unroll
        for (int i = 0; i < 128; ++i) cute::warpgroup_fence_operand(acc[i]);
        // Release the previous stage, except the second-to-last one of the tile (staging).
        if (kb > 0) {
          cute::warpgroup_wait<1>();
          if (kb != num_kb - 1 && lane == 0) Barrier::arrive(&ss.empty[(it - 1) % kStages]);
        }
      }
      cute::warpgroup_wait<0>();
#pragma unroll
      for (int i = 0; i < 128; ++i) cute::warpgroup_fence_operand(acc[i]);
      // The last two stages of this tile are now ours until the storer releases them.
      const int s_last = (it - 1) % kStages, s_prev = (it - 2) % kStages;
      auto put = [&](int slot, auto&& value) {
        const uint32_t base = slot_half(ss, slot, wg, s_last, s_prev) + row_off + col_off;
#pragma unroll
        for (int ii = 0; ii < 16; ++ii) {
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            detail::st_shared_b32(base + hh * 8 * kSlotRowBytes + ((uint32_t(ii) ^ sw) << 4),
                                  detail::pack_bf16x2(value(ii, hh, 0), value(ii, hh, 1)));
          }
        }
      };
      // value(ii, hh, e): this thread's fp32 value of slot column 8 ii + 2 (lane % 4) + e, row
      // (lane / 4) + 8 hh of its 16-row slice; accumulator column c <-> acc[4 (c / 8) + ...].
      if (job.kind == kL1GateUp) {
        if (p.l1_raw_gate) {
          put(0, [&](int ii, int hh, int e) { return acc[4 * ii + 2 * hh + e]; });
        } else {
          // h = silu(g) * u from the bf16-rounded gate/up (what the stored gate_up holds, as
          // the cuda backend's SwigluForward and the reference compute it).
          put(0, [&](int ii, int hh, int e) {
            const float g = detail::round_bf16(acc[4 * ii + 2 * hh + e]);
            const float u = detail::round_bf16(acc[4 * (ii + 16) + 2 * hh + e]);
            return megamoe::grouped::Swiglu(g, u);
          });
        }
        if (p.gate_up != nullptr) {
          put(1, [&](int ii, int hh, int e) { return acc[4 * ii + 2 * hh + e]; });
          put(2, [&](int ii, int hh, int e) { return acc[4 * (ii + 16) + 2 * hh + e]; });
        }
      } else {
        put(0, [&](int ii, int hh, int e) { return acc[4 * ii + 2 * hh + e]; });
        put(1, [&](int ii, int hh, int e) { return acc[4 * (ii + 16) + 2 * hh + e]; });
      }
      // st.shared (generic) now, TMA (async proxy) refills these stages after the storer.
      cutlass::arch::fence_view_async_shared();
      Barrier::arrive(&ss.epi_full[tn & 1]);
      ++tn;
    }
  }

  // ---------------------------------------------------------------- storer (kStorerWarps)
  // Row pairs: instruction j of warp w covers rows 2 (w + W j) and 2 (w + W j) + 1, 16 lanes
  // (16 bytes each) per 256-byte row slice.
  template <class Params, class Hooks>
  __device__ static void storer(SharedStorage& ss, const Params& p, const Hooks& hooks) {
    const int lane = threadIdx.x & 31;
    const int w = threadIdx.x / 32 - kFirstStorerWarp;
    const int half_lane = lane >> 4;  // which row of the pair
    const int cc = lane & 15;         // 16-byte chunk of the row slice
    uint32_t it = 0, jn = 0, tn = 0;
    while (true) {
      const int slot = jn % kJobSlots;
      Barrier::wait(&ss.job_full[slot], (jn / kJobSlots) & 1);
      const ExpertTile job = ss.jobs[slot];
      __syncwarp();
      if (lane == 0) Barrier::arrive(&ss.job_empty[slot]);
      ++jn;
      if (job.kind < 0) break;
      const bool l1 = job.kind == kL1GateUp;
      it += p.op[job.kind].k / kBlockK;
      const int s_last = (it - 1) % kStages, s_prev = (it - 2) % kStages;

      // L2: destination row pointers into smem (each warp for the rows it stores).
      if (!l1) {
        for (int pr = w + kStorerWarps * (lane >> 1); pr < kBlockM / 2;
             pr += kStorerWarps * 16) {
          const int r = 2 * pr + (lane & 1);
          __nv_bfloat16* d = r < job.rows ? p.l2_dest.row(job, r) : nullptr;
          ss.row_dst[r] = d == nullptr ? nullptr : d + job.n_block * kBlockN;
        }
        __syncwarp();
      }
      Barrier::wait(&ss.epi_full[tn & 1], (tn >> 1) & 1);
      ++tn;

      const int slots = l1 ? (p.gate_up != nullptr ? 3 : 1) : 2;
      for (int sl = 0; sl < slots; ++sl) {
        const uint32_t half0 = slot_half(ss, sl, 0, s_last, s_prev);
        const uint32_t half1 = slot_half(ss, sl, 1, s_last, s_prev);
#pragma unroll 2
        for (int pr = w; pr < kBlockM / 2; pr += kStorerWarps) {
          const int r = 2 * pr + half_lane;
          if (r >= job.rows) continue;
          __nv_bfloat16* d;
          if (l1) {
            const int64_t row = job.row_begin + r;
            d = sl == 0   ? p.h + row * p.f + job.n_block * 128
                : sl == 1 ? p.gate_up + row * 2 * p.f + job.n_block * 128
                          : p.gate_up + row * 2 * p.f + p.f + job.n_block * 128;
          } else {
            d = ss.row_dst[r];
            if (d == nullptr) continue;
            d += sl * 128;
          }
          const int rr = r & 63;
          const uint32_t src = (r < 64 ? half0 : half1) + rr * kSlotRowBytes +
                               ((uint32_t(cc) ^ uint32_t(rr & 7)) << 4);
          detail::st_global_v4(d + cc * 8, detail::ld_shared_v4(src));
        }
      }
      // This warp's reads are done (each store consumed its load): hand the stages back.
      cutlass::arch::fence_view_async_shared();  // generic reads before the TMA refill
      __syncwarp();
      if (lane == 0) {
        detail::mbar_arrive_cnt(&ss.empty[s_last], kMathThreads / 32 / kStorerWarps);
        detail::mbar_arrive_cnt(&ss.empty[s_prev], kMathThreads / 32 / kStorerWarps);
      }
      detail::store_fence<Hooks::kStoreFence>();
      if constexpr (kStorerWarps > 1)
        detail::named_barrier_sync(kStorerBarrier, 32 * kStorerWarps);
      if (w == 0 && lane == 0) hooks.tile_done(job);
    }
  }

  // ---------------------------------------------------------------- the roles of a CTA
  // Convenience dispatch for a kernel that uses exactly this engine's 384 threads (the
  // standalone harness does). A fused kernel may call producer / storer / math itself from its
  // own role branches (it must keep warps 4..11 as the two consumer warpgroups, give them
  // kMathRegs with setmaxnreg, and call init() + a CTA barrier first).
  template <class Params, class Scheduler, class Hooks>
  __device__ static void run_roles(SharedStorage& ss, const Params& p, Scheduler& sched,
                                   const Hooks& hooks) {
    const int warp = threadIdx.x / 32;
    if (warp < kFirstMathWarp) {
      cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
      if (warp == kProducerWarp) producer(ss, p, sched, hooks);
      else if (warp < kFirstStorerWarp + kStorerWarps) storer(ss, p, hooks);
    } else {
      cutlass::arch::warpgroup_reg_alloc<kMathRegs>();
      math(ss, p);
    }
  }
};

}  // namespace megamoe::fused::sm90

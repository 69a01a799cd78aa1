// The GEMM roles of the fused MoE kernel on sm_90a (bf16, or blockwise FP8: see "FP8" below): a
// persistent, warp-specialised tile
// engine that runs the two expert GEMMs of a SwiGLU MLP over tiles that the caller hands it,
// one tile after another, with one shared-memory ring that keeps running across tiles.
//
//   L1 ("gate/up"): gate_up = A @ w_gate_up[e], A = rows contiguous in group order (a receive
//        pool; fast) or token rows gathered by index (correct, 2.5-5x slower: see the notes);
//        epilogue h = silu(gate) * up, bit-identical to ffi/common/swiglu_math.cuh, h stored
//        bf16 to rows of h [rows, F] in group order, optionally also gate_up [rows, 2F].
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
// Constraints (checked by the caller): K of both GEMMs a multiple of 64 and >= 128, F a
// multiple of 128, H a multiple of 256, row strides 16-byte aligned, K <= 2^31 elements per
// expert slice. Measured numbers, runs and what each design change did:
// benchmarks/kernels/FUSED_CORE_NOTES.md; harness: benchmarks/kernels/fused_core_bench.cu.
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
//   warp 1        signaller: looks up where each row of a published tile goes (the caller's
//                 RowDest::row, which may load from global memory) into the job slot's
//                 row_dst table, off the consumers' path (they wait on dst_ready only at the
//                 epilogue); then, once both consumer warpgroups have issued the tile's stores,
//                 fences at Hooks::kStoreFence scope and calls hooks.tile_done(tile).
//   warps 2, 3    free for the caller (dispatch / combine roles of the fused kernel).
//   warps 4..11   two consumer warpgroups: wgmma mainloop, fp32 accumulators (128 regs), then
//                 the epilogue: SwiGLU or plain cast into staging smem, and each warpgroup
//                 writes its 64 rows with 16-byte generic stores (whole 16-byte vectors, any
//                 address, a peer's over NVLink too); L1's residual gate_up by TMA stores.
//
// Epilogue staging lives inside the stage ring: the consumers keep the stages of a tile's last
// two K-blocks (warpgroup 0 the last, warpgroup 1 the one before: 48 KB each), stage their bf16
// rows there, store them, and release the stage. Meanwhile the producer fills the other
// kStages - 2 stages with the next tile, so no smem is set aside for the epilogue. A staging
// slot is 64 rows x 128 columns bf16, 256 B per row, 16-byte chunks XOR-swizzled by row % 8
// (conflict-free for the fragment writes and the row reads): slots 0, 1 = the B region of the
// warpgroup's stage, slot 2 = its A region. L1: h -> 0, gate -> 1, up -> 2; L2: columns
// 0..127 -> 0, 128..255 -> 1. Gate and up are laid out for TMA instead (kTmaHalfBytes): two
// 64-column halves of 64 rows x 128 B each, the same XOR swizzle. One thread stores them with
// four {64, 64} boxes, and the stage goes back once TMA has read them, not written them.
//
// Deferred L2 epilogue (kDeferL2Epilogue, built with MEGAMOE_DEFER_L2_EPILOGUE=1, benchmarks;
// bf16, not the dgrad engine; only where an L2 tile's rows go to row_dst alone: no l2_copy, not
// l2_rows): the tensor cores idle while both warpgroups run a tile's epilogue (~20% of their
// cycles at 30B: FUSED_CORE_NOTES, session 31). With it on, an L2 tile's epilogue stages
// nothing: it hands all its stages back, writes the first half of its columns straight from the
// accumulators, keeps the other half as bf16 pairs in 32 registers and goes on to the next
// tile, whose first kL2DeferParts stages write one 32-column group each, after the stage's
// wgmma issue and the release of the stage before it. A row is written from registers thus: within
// each quad of lanes a 4 x 4 transpose of 32-bit words (4 shuffles) gives each lane 16
// contiguous bytes of one row, so a warp instruction writes 64 contiguous bytes in each of 8
// rows. The tile's `stored` arrival follows its last part (after the last tile: before the role
// ends).
// L1 likewise (kDeferL1Epilogue, MEGAMOE_DEFER_L1_EPILOGUE, on by default: engine_build_options.h;
// only without the gate_up residual): h groups 0-1 (64 of the tile's 128 h columns) get their
// SwiGLU and go out at the epilogue; groups 2-3 keep their bf16 gate and up pairs (32
// registers) and get their SwiGLU in the next tile's first stages, one part a stage
// (MEGAMOE_DEFER_L1_PARTS_PER_GROUP parts a group; 2: half a group each, four stages). A
// pending L1 tile is finished as soon as the next job is an L2 tile, before that tile's
// mainloop: L2 tiles wait on L1 tiles' tile_done (the producer publishes a job before it waits
// for the job's rows, so the consumers see it first).
// Contract: a deferred tile's tile_done waits for the next tile's rows (wait_rows_ready) and,
// after the last tile, for the scheduler's end; so neither may depend on the tile_done of an L2
// tile, nor, with L1 deferred, of an L1 tile that no L2 tile follows (true of the fused kernel,
// whose L2 tiles signal nothing and whose CTAs take all their L1 tiles before their L2 tiles,
// and of the harness). Performance, not correctness: a deferred L1 tile's tile_done also waits
// for the next L1 tile's rows, so L2 tiles may wait longer where rows arrive late (the fused
// kernel's copy beside the tiles). Both pass the harness's checks, bit for bit the staged
// epilogue's outputs (H100, session 33; FUSED_CORE_NOTES).
//
// Synchronisation (mbarriers + two named barriers):
//   full[s]/empty[s]       the K-stage ring (32 producer-lane arrivals + TMA bytes / 8 warps)
//   job_full/job_empty     the job ring, producer -> 8 math warps + signaller
//   stored[kJobSlots]      a tile's stores issued, 256 math threads -> signaller, one per job
//                          slot: the signaller frees the slot (job_empty) only after the tile's
//                          tile_done, so the math warps can never lap a stored barrier
//   dst_ready[kJobSlots]   the slot's row_dst table written, signaller lane 0 -> the math
//                          threads, once per real job (also when the tile needs no table);
//                          waited on just before the epilogue's row reads
//   named barrier 1 (256)  both warpgroups done reading the tile's stages (before staging)
//   named barrier 2, 3     per warpgroup: staging written (before the row reads)
// The ring's counters run on across tiles, so the producer loads tile i+1 while the consumers
// finish tile i.
//
// Memory-ordering contract of the hooks (the caller implements them):
//   wait_rows_ready(tile): called by lane 0 of the producer warp; return once the A rows of the
//     tile may be read (spin with ld.acquire). The engine then runs __syncwarp() and
//     fence.proxy.async.global on every producer lane before any TMA of the tile, so writes that
//     the acquire made visible (generic stores, NVLink stores, TMA stores) are seen by TMA.
//   tile_done(tile): called by lane 0 of the signaller warp after every consumer thread issued
//     its stores of the tile and arrived on an mbarrier (release, CTA scope), the signaller
//     acquired it and ran fence.acq_rel.{gpu,sys} (Hooks::kStoreFence = 1, 2; 0: no fence):
//     the CUTLASS pattern of a CTA barrier followed by one thread's fenced release. Bump a
//     counter with a red.release / red.relaxed after that fence. It must not block: the next
//     tile's row destinations (signaller) follow it, and that tile's epilogue waits for them.
//     Not covered: L1's residual gate_up, whose TMA stores may still be in flight at tile_done
//     (store_gate_up; they complete before the block exits). Nothing in a kernel reads it; a
//     reader would need the issuing thread's cp.async.bulk.wait_group 0 before its `stored`
//     arrival.
//   RowDest::row(tile, r): called by the signaller's lanes while the consumers run the tile's
//     mainloop; it may load from global memory but must not block.
//
// FP8 (Elems = E4m3Operands; recipes "fp8" / "fp8_pow2", jax_megamoe/fp8.py defines them): e4m3
// operands with fp32 scales, A (rows) in 1 x 128 blocks along K, B (weights) in 128 x 128 blocks.
// A stage is 128 of K (128 bytes per row: one scale block, the same 128B swizzle and the same
// bytes per stage as bf16's 64 of K: A 16 KB, B 32 KB), plus the stage's A scales (one TMA box
// of 132 fp32 from a K-block-major [K/128, rows] scale matrix, starting at the tile's first row
// rounded down to a multiple of 4: a 16-byte aligned start, see load_tile_fp8) and B scales
// (2 fp32, written by the producer from [E, K/128, N/128]). B is K-major (FP8 wgmma takes no
// transposed operand): the quantised weights [E, N, K], two TMA boxes of {128 K, 128 N rows} per
// stage (L1: the gate block and the up block of the tile; L2: the tile's two 128-column
// blocks). Each consumer
// warpgroup runs, per stage and per 128-column half, 4 x wgmma m64n128k32 e4m3 into a
// temporary fragment (64 fp32), waits for it and promotes it: acc += tmp * (sa[row] * sb[half]).
// The promoted accumulator holds the same columns in the same registers as bf16's m64n256
// fragment (half h = acc[64 h ..]), so the epilogues are shared: 128 + 64 accumulator registers.
// L1's epilogue quantises h = silu(g) * u (its bf16 rounding, as the reference stores it) in
// 1 x 128 blocks: a row's 128 h columns sit in the 4 lanes of a quad, amax by two shuffles,
// scale = Fp8BlockScale (ffi/layout/fp8_blocks.h), e4m3 = satfinite(h / scale), the rule of
// ffi/impls/fp8_quantize.cu bit for bit; h stored as e4m3 rows [rows, F] and its scales into
// h_scale [F/128, pitch] (L2's A and A scales), and, when gate_up is given (residuals), the
// bf16 gate_up rows as bf16's epilogue stores them (store_gate_up). A tile whose K is one stage
// (K = 128) still takes two stages of the ring (the second carries no data) so that the
// epilogue has its two staging stages.
//
// Backward (engine kDgrad, bf16, B K-major): the two dgrad GEMMs of the MLP, which read the
// forward's stored weights K-major (no transposed copy: FUSED_BACKWARD_PLAN.md):
//   kDgradDh (op[0]): dh = dy @ w_down[e]^T, B = w_down [E, F, H] as [E * F, H] (N = F, a
//        multiple of 256); epilogue the SwiGLU backward from the forward's gate_up rows (same
//        rows as A): dgate = dh u s (1 + g (1 - s)), dup = dh g s with dh rounded to bf16 first,
//        the math of ffi/common/swiglu_math.cuh bit for bit (backend cuda's SwigluBackward on the
//        same dh), stored to dgate_up [rows, 2F] (gate columns [c, c + 256), up F + c ..).
//   kDgradDx (op[1]): dx = dgate_up @ w_gate_up[e]^T, B = w_gate_up [E, H, 2F] as [E * H, 2F]
//        (N = H); epilogue the forward L2's: each row to a per-row destination.
// Tile, staging and stores as L2's; the dh epilogue reads each staged 16-byte vector of dh,
// loads the matching gate and up vectors (prefetched into L2 when the tile starts) and stores
// dgate and dup.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "cute/arch/cluster_sm90.hpp"
#include "cute/arch/copy_sm90_desc.hpp"
#include "cute/arch/copy_sm90_tma.hpp"
#include "cute/arch/mma_sm90_desc.hpp"
#include "cute/arch/mma_sm90_gmma.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"
#include "ffi/common/fp8_quotient.cuh"
#include "ffi/common/swiglu_math.cuh"
#include "ffi/gemm/engine_build_options.h"  // MEGAMOE_DEFER_L2_EPILOGUE, ..._L1_EPILOGUE
#include "ffi/gemm/sm90_engine_profile.cuh"
#include "ffi/layout/fp8_blocks.h"
#include "ffi/scheduler/expert_tile_walk.cuh"

namespace megamoe::fused::sm90 {

// How the producer brings in a tile's A rows.
enum class ALoad : int32_t { kTmaBlock = 0, kTmaRows = 1, kCpAsyncRows = 2 };

// The two GEMMs of the MLP (ExpertTile::kind); the dgrad engine (kDgrad) names them kDgradDh,
// kDgradDx (see the header).
enum GemmKind : int32_t { kL1GateUp = 0, kL2Down = 1, kDgradDh = 0, kDgradDx = 1 };

// The operands' element type: bf16 (64 of K per stage), or e4m3 with blockwise fp32 scales (128
// of K per stage, one scale block).
struct Bf16Operands {
  static constexpr bool kFp8 = false;
  static constexpr int kBlockK = 64;
};
struct E4m3Operands {
  static constexpr bool kFp8 = true;
  static constexpr int kBlockK = 128;
};

// Operands of one GEMM kind. Lives in the caller's __grid_constant__ kernel parameters (TMA
// descriptors must sit in param, const or global memory).
struct alignas(128) GemmOperands {
  CUtensorMap a_map;  // kTmaBlock: rows in group order [R, K], box {64, 128};
                      // kTmaRows: source rows [R, K], box {64, 1}; both bf16, 128B swizzle
  CUtensorMap b_map;  // weights as [E * K, N] (N contiguous), box {64, 64}, 128B swizzle
                      // (engine kBKMajor: as [E * N, K], box {64, 128})
  const __nv_bfloat16* a_ptr;  // kCpAsyncRows: source rows, row stride lda elements
  int64_t lda;
  const int32_t* row_index;  // kTmaRows / kCpAsyncRows: source row of group row r
  int32_t k;                 // K, a multiple of 64 (FP8: of 128)
  int32_t a_load;            // ALoad (FP8: kTmaBlock only)
  // FP8 only (E4m3Operands): a_map / b_map are then e4m3 (box {128, 128}; b_map over the
  // K-major weights [E * N, K]), and the scales:
  CUtensorMap sa_map;        // A's scales, fp32 [K/128, pitch] (K-block-major), box {132, 1}
  const float* b_scale;      // B's 128 x 128 block scales [E, K/128, N/128]
  int32_t n;                 // N: B rows per expert (L1 2F, L2 H); FP8 and kBKMajor
  // Debug only (0 normally): 1 = the A-scale box starts at the tile's first row itself, not at
  // it rounded down to 16 bytes (the first build's unaligned start, kept to A/B it on a GPU).
  int32_t sa_unaligned;
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
  // With gate_up: its TMA map, [rows, 2f] bf16, box {64, 64}, 128B swizzle
  // (MakeRowMajorTensorMap(map, gate_up, rows, 2f, 2f, 64, 64)): L1 stores it by TMA.
  CUtensorMap gate_up_map;
  __nv_bfloat16* h;       // L1 output [rows, f]
  __nv_bfloat16* gate_up; // optional L1 output [rows, 2f] (nullptr: not stored)
  int32_t f;              // F (L1 gate/up split, h width), a multiple of 128
  int32_t l1_raw_gate;    // benchmark only: 1 = store the gate half as h (no SwiGLU math)
  // Benchmark only: 1 = compute, no epilogue at all (mainloop rate); 2 = the whole epilogue
  // (math, staging, smem reads) but no global stores (what the stores cost); 3 = the staging
  // only: the bf16 / L2 epilogue writes its slots, then hands the stages back without reading
  // them (with 1 and 2: what staging costs, and what holding the stages costs the producer;
  // FP8 L1's own epilogue ignores it); 4 = as 1, but each tile's row destinations are still
  // looked up (by the signaller since session 17: what the lookup still costs off the path).
  int32_t bench_skip_epilogue;
  RowDest l2_dest;        // L2 output rows
  // Optional second store of every L2 output row, at its group row: l2_copy + (row_begin + r) *
  // l2_copy_ld (nullptr: none). The fused forward keeps L2's rows there for the backward.
  __nv_bfloat16* l2_copy = nullptr;
  int64_t l2_copy_ld = 0;
  // Optional (the forward, either element type: L2's output is bf16; l2_copy unset): every L2
  // output row r of a tile goes to l2_rows + (row_begin + r) * l2_rows_ld, i.e. the rows are
  // contiguous in group order (the fused kernel's comb buffer with one rank alone). L2 then
  // stages its tile in TMA layout and a full warpgroup's 64 rows go out as four {64, 64} boxes
  // of l2_rows_map ([rows, N] bf16, 128B swizzle): the stage goes back once TMA has read it,
  // while the stores drain beside the next tile (FUSED_CORE_NOTES, session 31: the generic
  // stores took ~2,800 cycles a 30B tile). The stores complete before the role ends
  // (bulk_store_wait_all). l2_dest is not used then.
  CUtensorMap l2_rows_map;
  __nv_bfloat16* l2_rows = nullptr;
  int64_t l2_rows_ld = 0;
  // FP8 only: L1 stores h as e4m3 rows h_q [rows, f] and its 1 x 128 scales
  // h_scale[(c / 128) * h_scale_pitch + row] (h is not stored in bf16; gate_up is when given).
  uint8_t* h_q;
  float* h_scale;
  int64_t h_scale_pitch;
  int32_t pow2;           // power-of-two scales (recipe "fp8_pow2")
  // Engine kDgrad only: the forward's gate_up rows [rows, 2F] (read by the dh tiles' SwiGLU
  // backward) and its output dgate_up [rows, 2F] (the dx tiles' A). l2_copy, when given, then
  // receives the dh tiles' bf16 dh at their group rows, pitch l2_copy_ld (a check of the SwiGLU
  // backward alone); the dx tiles do not store there.
  const __nv_bfloat16* fwd_gate_up = nullptr;
  __nv_bfloat16* dgate_up = nullptr;
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
// B K-major (Sm90MoeTileEngine<..., kBKMajor = true>): the weights as [E * N, K].
using WgmmaBK = cute::SM90::GMMA::MMA_64x256x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K,
                                                                cute::SM90::GMMA::Major::K>;

using WgmmaFp8N64 = cute::SM90::GMMA::MMA_64x64x32_F32E4M3E4M3_SS_TN<>;

// f(cute::Int<0>{}), ..., f(cute::Int<N - 1>{}): a loop whose index is a constant expression.
template <class F, int... I>
__device__ __forceinline__ void static_for(F&& f, cute::int_sequence<I...>) {
  (f(cute::Int<I>{}), ...);
}

// One m64n64k32 e4m3 wgmma into d[kOff .. kOff + 32).
template <int kOff, size_t... I>
__device__ __forceinline__ void wgmma_fp8_n64_call(uint64_t da, uint64_t db, float (&d)[64],
                                                   bool acc, cute::index_sequence<I...>) {
  WgmmaFp8N64::fma(da, db, d[kOff + I]...,
                   acc ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
}

// One exchange with lane ^ lane_xor: a lane with `upper` set trades x[a0], x[a1], the others
// x[b0], x[b1] (each gets its partner's two words in their place).
__device__ __forceinline__ void quad_exchange(uint32_t (&x)[4], bool upper, int lane_xor, int a0,
                                              int a1, int b0, int b1) {
  uint32_t v0 = upper ? x[a0] : x[b0], v1 = upper ? x[a1] : x[b1];
  v0 = __shfl_xor_sync(0xffffffffu, v0, lane_xor);
  v1 = __shfl_xor_sync(0xffffffffu, v1, lane_xor);
  if (upper) {
    x[a0] = v0;
    x[a1] = v1;
  } else {
    x[b0] = v0;
    x[b1] = v1;
  }
}

// 4 x 4 transpose of 32-bit words over the lanes of a quad: lane q holds x[j] = M[q][j] and
// gets M[j][q] (two exchanges, across bit 1 then bit 0 of the lane).
__device__ __forceinline__ void quad_transpose(uint32_t (&x)[4], int q) {
  quad_exchange(x, q & 2, 2, 0, 1, 2, 3);
  quad_exchange(x, q & 1, 1, 0, 2, 1, 3);
}

template <class Mma = Wgmma, size_t... I>
__device__ __forceinline__ void wgmma_call(uint64_t da, uint64_t db, float (&d)[128], bool acc,
                                           cute::index_sequence<I...>) {
  Mma::fma(da, db, d[I]...,
           acc ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
}

__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// The thread's TMA stores (bulk groups) complete, their global writes included
// (cute::tma_store_wait waits for their shared-memory reads only).
__device__ __forceinline__ void bulk_store_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

__device__ __forceinline__ void st_shared_b16(uint32_t addr, uint16_t v) {
  asm volatile("st.shared.b16 [%0], %1;" ::"r"(addr), "h"(v) : "memory");
}

// Two values as e4m3 bytes (lo first), the conversion of ffi/impls/fp8_quantize.cu.
__device__ __forceinline__ uint16_t e4m3x2(float lo, float hi) {
  const uint32_t a = __nv_cvt_float_to_fp8(lo, __NV_SATFINITE, __NV_E4M3);
  const uint32_t b = __nv_cvt_float_to_fp8(hi, __NV_SATFINITE, __NV_E4M3);
  return static_cast<uint16_t>(a | (b << 8));
}

__device__ __forceinline__ float bf16_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }

__device__ __forceinline__ void st_shared_b32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// megamoe::grouped::Swiglu (ffi/common/swiglu_math.cuh) bit for bit, without its branch: nvcc
// compiles the IEEE 1.0f / d of Sigmoid() into MUFU.RCP + 2 FFMA behind a range test with a
// called slow path per element (BSSY/CALL: no ILP across the 64 values of a thread). This is
// the same fast-path sequence, so the result is identical whenever the range test passes;
// `slow` reports an element where it does not (d = 1 + exp(-g) >= 2^126 or NaN, i.e. g < -87
// or NaN), and the caller then recomputes with Swiglu() itself. The harness checks equality
// over all bf16 values of g.
// Two instruction savers, same bits: __expf(-g) is ex2.approx(g * -log2 e), whose non-ftz form
// rescales inputs below -126 (a compare and two predicated multiplies an element); its ftz form
// returns 0 there instead of a value below 2^-126, and 1 + either is 1. The range test as one
// float compare (d >= 1, so only the top and NaN matter) instead of integer ops on the bits.
__device__ __forceinline__ float sigmoid_fast_path(float gate, bool& slow) {
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(gate * __uint_as_float(0xbfb8aa3bu)));
  const float d = 1.0f + e;
  slow |= !(d < 0x1p126f);
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  return fmaf(r, -fmaf(d, r, -1.0f), r);
}

__device__ __forceinline__ float swiglu_fast_path(float gate, float up, bool& slow) {
  const float sig = sigmoid_fast_path(gate, slow);
  return gate * sig * up;
}

// megamoe::grouped::SwigluGrad the same way (its expressions verbatim, the sigmoid above).
__device__ __forceinline__ void swiglu_grad_fast_path(float d, float gate, float up,
                                                      float* d_gate, float* d_up, bool& slow) {
  const float s = sigmoid_fast_path(gate, slow);
  *d_gate = d * up * s * (1.0f + gate * (1.0f - s));
  *d_up = d * gate * s;
}

// The SwiGLU backward of 8 bf16 columns (16-byte vectors of dh, gate, up), as backend cuda's
// SwigluBackwardKernel computes them: fast path, or exactly (SwigluGrad) when `exact`.
__device__ __forceinline__ void swiglu_grad_x8(uint4 dv, uint4 gv, uint4 uv, bool exact,
                                               uint4& dgv, uint4& duv, bool& slow) {
  const uint32_t d[4] = {dv.x, dv.y, dv.z, dv.w}, g[4] = {gv.x, gv.y, gv.z, gv.w},
                 u[4] = {uv.x, uv.y, uv.z, uv.w};
  uint32_t dg[4], du[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    float dg2[2], du2[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float de = e ? bf16_hi(d[k]) : bf16_lo(d[k]);
      const float ge = e ? bf16_hi(g[k]) : bf16_lo(g[k]);
      const float ue = e ? bf16_hi(u[k]) : bf16_lo(u[k]);
      if (exact) megamoe::grouped::SwigluGrad(de, ge, ue, &dg2[e], &du2[e]);
      else swiglu_grad_fast_path(de, ge, ue, &dg2[e], &du2[e], slow);
    }
    dg[k] = pack_bf16x2(dg2[0], dg2[1]);
    du[k] = pack_bf16x2(du2[0], du2[1]);
  }
  dgv = make_uint4(dg[0], dg[1], dg[2], dg[3]);
  duv = make_uint4(du[0], du[1], du[2], du[3]);
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

// Keeps the compiler from moving memory accesses across this point (CUTLASS's mbarrier wait and
// arrive are asm volatile without a "memory" clobber).
__device__ __forceinline__ void compiler_barrier() { asm volatile("" ::: "memory"); }

__device__ __forceinline__ void mbar_arrive_cnt(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(count)
               : "memory");
}

// Arrive `count` times on the mbarrier at bar's offset in CTA `cta` of the cluster: CUTLASS's
// consumer release of a multicast pipeline (ClusterBarrier::arrive, default .release.cta), with
// a count. The arriving warp's reads of the stage (wgmma) are complete before it arrives.
// Measured (session 17): with .release.cluster the 30B cluster dgrad harness took 2.86 ms,
// with this form 2.20.
__device__ __forceinline__ void mbar_arrive_cnt_cluster(uint64_t* bar, uint32_t cta,
                                                        uint32_t count) {
  asm volatile(
      "{\n\t.reg .b32 remAddr32;\n\t"
      "mapa.shared::cluster.u32 remAddr32, %0, %1;\n\t"
      "mbarrier.arrive.shared::cluster.b64 _, [remAddr32], %2;\n\t}" ::"r"(smem_u32(bar)),
      "r"(cta), "r"(count)
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

// kBKMajor (bf16 only): B is read K-major, from the weights as [E * N, K] (b_map box {64 K, 128
// N-rows}, GemmOperands::n rows per expert), as the backward's dgrad GEMMs read W^T without a
// transposed copy; the stage holds the same 256 N x 64 K, so the epilogues are unchanged.
// kDgrad (needs kBKMajor): the backward's dgrad GEMMs, kDgradDh and kDgradDx (see the header).
// kClusterM = 2 (bf16, kBKMajor; experimental, harness only): the CTAs of a 2-CTA cluster run
// tiles of the same expert and N-block on two M-blocks (the caller's scheduler pairs them) and
// share B: each CTA loads one of the stage's two 128-N-row boxes and multicasts it to both, so
// each stage reads half the B bytes from L2. A stage is refilled once the consumers of both
// CTAs released it (empty[] counts both CTAs' arrivals). The caller launches with a cluster of
// 2, syncs the cluster after init() and before the CTAs exit, and gives a CTA with no M-block
// left a tile of 0 rows (it still loads its half of B for its peer). Measured (session 17,
// FUSED_CORE_NOTES): every check passes; mainloop rates at parity with kClusterM = 1, L2 with
// its epilogue 20% slower (a CTA's epilogue holds stages its peer waits for). Not in the product.
template <int kStages_ = 4, int kJobSlots_ = 4, class Elems = Bf16Operands, bool kBKMajor = false,
          bool kDgrad = false, int kClusterM = 1>
struct Sm90MoeTileEngine {
  static constexpr bool kFp8 = Elems::kFp8;
  // See "Deferred L2 epilogue" above. A warpgroup's 64 x 256 output is 8 groups of 32 columns;
  // the epilogue stores the first kFirstDeferredGroup of them, and the next tile's first
  // kL2DeferParts stages one more each. Deferring all 8 (64 registers) spilled them, even with
  // 232 registers for the consumers; 4 (32 registers) fit in kMathRegs (nvcc 13.0: no spill in
  // the harness's math warps; in the fused kernel one 4-byte spill, in an epilogue).
  static constexpr bool kDeferL2Epilogue =
      !kFp8 && !kDgrad && kClusterM == 1 && MEGAMOE_DEFER_L2_EPILOGUE != 0;
  static constexpr int kFirstDeferredGroup = 4;
  static constexpr int kL2DeferParts = 8 - kFirstDeferredGroup;
  // L1 (no gate_up residual): a warpgroup's h is 64 x 128, 4 groups of 32 columns; groups 0-1
  // at the epilogue, 2-3 in the next tile's first stages, kL1PartsPerGroup parts a group (2:
  // half a group's SwiGLU a stage; a whole group's, ~1,300 cycles, outran a stage's wgmma),
  // kept as the bf16 gate and up pairs they are computed from (32 registers, as L2's). A
  // pending L1 tile is finished before any L2 tile starts: L2 tiles wait on L1 tiles'
  // tile_done.
  static constexpr bool kDeferL1Epilogue =
      !kFp8 && !kDgrad && kClusterM == 1 && MEGAMOE_DEFER_L1_EPILOGUE != 0;
  static constexpr int kFirstDeferredL1Group = 2;
  static constexpr int kL1DeferredGroups = 4 - kFirstDeferredL1Group;
  static constexpr int kL1PartsPerGroup = MEGAMOE_DEFER_L1_PARTS_PER_GROUP;
  static constexpr int kL1DeferParts = kL1DeferredGroups * kL1PartsPerGroup;
  static constexpr bool kDeferEpilogue = kDeferL1Epilogue || kDeferL2Epilogue;
  // The first stages of a tile that may carry a part; the pending words.
  static constexpr int kMaxDeferParts =
      (kDeferL1Epilogue && kL1DeferParts > kL2DeferParts) ? kL1DeferParts : kL2DeferParts;
  static constexpr int kPendWords = 8 * kL2DeferParts;
  static_assert(!kDeferEpilogue || kJobSlots_ >= 2,
                "a pending tile holds its job slot while the next tile runs");
  static_assert(kL1PartsPerGroup == 1 || kL1PartsPerGroup == 2 || kL1PartsPerGroup == 4,
                "MEGAMOE_DEFER_L1_PARTS_PER_GROUP: 1, 2 or 4 (a group's 4 blocks split evenly)");
  static_assert(16 * kL1DeferredGroups <= kPendWords,
                "a pending L1 tile's gate and up pairs fit in pend, sized for L2");
  static_assert(!(kFp8 && kBKMajor), "the FP8 path reads B K-major always (its own loads)");
  static_assert(!kDgrad || kBKMajor, "the dgrad GEMMs read the stored weights K-major");
  static_assert(kClusterM == 1 || (kClusterM == 2 && kBKMajor && !kFp8),
                "B multicast over a 2-CTA cluster: bf16 with K-major B only");
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = 256;
  static constexpr int kBlockK = Elems::kBlockK;
  static constexpr int kElemBytes = kFp8 ? 1 : 2;
  static constexpr int kStages = kStages_;
  static constexpr int kJobSlots = kJobSlots_;
  static_assert(kStages >= 3, "two stages hold the staged tile; at least one must stream");

  static constexpr int kThreads = 384;
  static constexpr int kProducerWarp = 0;
  static constexpr int kSignallerWarp = 1;
  static constexpr int kFirstMathWarp = 4;
  static constexpr int kMathThreads = 256;
  static constexpr int kProducerRegs = 56;  // warpgroup 0 (producer, signaller, free warps)
  static constexpr int kMathRegs = 224;     // 2 x 128 x 224 + 128 x 56 = 64 K registers
  static constexpr uint32_t kBothWgBarrier = 1;   // named barrier ids used by the consumers
  static constexpr uint32_t kFirstWgBarrier = 2;  // 2, 3

  static constexpr int kABytes = kBlockM * kBlockK * kElemBytes;  // 16 KB
  static constexpr int kBBytes = kBlockK * kBlockN * kElemBytes;  // 32 KB
  static constexpr int kBBoxBytes = kBlockK * 64 * 2;    // bf16: 8 KB, 64 K-rows x 64 N
  static constexpr int kBHalfBytes = kBBytes / 2;        // FP8: 16 KB, 128 N-rows x 128 K
  // FP8: a stage's A scales, one TMA box of kAScaleBox fp32 from the tile's first row rounded
  // down to a multiple of 4 (16 bytes): the 128 rows of the tile start at offset row_begin % 4.
  static constexpr int kAScaleBox = kBlockM + 4;          // 132 rows, 528 B
  static constexpr int kAScaleBytes = kAScaleBox * 4;
  static constexpr int kAScaleStride = 160;               // floats per stage: 640 B, 128-aligned
  static_assert(kABytes == 16384 && kBBytes == 32768, "both element types share the stage sizes");
  static constexpr int kSlotRowBytes = 256;              // 128 bf16 columns per staging slot
  static constexpr int kSlotBytes = 64 * kSlotRowBytes;  // 16 KB
  // L1's gate and up slots (residuals) are stored by TMA: each holds two 64-column halves of
  // 64 rows x 128 B, 16-byte chunks XOR-swizzled by row % 8, which is what a {64, 64} box with
  // 128B swizzle reads (every slot starts 1024-aligned).
  static constexpr int kTmaHalfBytes = 64 * 128;  // 8 KB
  // Byte offset of row r's 16-byte chunk c (0..15: columns 8 c ..) in a TMA-layout slot.
  __device__ __forceinline__ static uint32_t tma_slot_offset(int r, int c) {
    return uint32_t(c >> 3) * kTmaHalfBytes + uint32_t(r) * 128 +
           ((uint32_t(c & 7) ^ uint32_t(r & 7)) << 4);
  }

  struct alignas(1024) SharedStorage {
    alignas(1024) uint8_t a[kStages][kABytes];
    alignas(1024) uint8_t b[kStages][kBBytes];
    ExpertTile jobs[kJobSlots];
    int32_t row_src[kBlockM];  // kCpAsyncRows: source row of each tile row (producer only)
    // Destination of each row of the tile in job slot j (null = skip), written by the
    // signaller (dst_ready[j] then completes), read by the consumers' epilogue; the slot is
    // reused only after its tile is stored (the signaller's job_empty arrival).
    __nv_bfloat16* row_dst[kJobSlots][kBlockM];
    uint64_t full[kStages], empty[kStages];
    uint64_t stored[kJobSlots];
    uint64_t dst_ready[kJobSlots];
    uint64_t job_full[kJobSlots], job_empty[kJobSlots];
    struct Fp8Scales {
      alignas(128) float a[kStages][kAScaleStride];  // a stage's A scales (TMA, kAScaleBox)
      float b[kStages][2];                     // its two B blocks' scales (producer stores)
    };
    struct NoScales {};
    std::conditional_t<kFp8, Fp8Scales, NoScales> scales;
  };

  using Barrier = cutlass::arch::ClusterTransactionBarrier;

  // One thread, before the CTA-wide sync that precedes run_roles().
  __device__ static void init(SharedStorage& ss) {
    for (int s = 0; s < kStages; ++s) {
      Barrier::init(&ss.full[s], 32);  // one arrival per producer lane (+ TMA bytes)
      Barrier::init(&ss.empty[s], kMathThreads / 32 * kClusterM);  // every CTA's math warps
    }
    for (int j = 0; j < kJobSlots; ++j) Barrier::init(&ss.stored[j], kMathThreads);
    for (int j = 0; j < kJobSlots; ++j) Barrier::init(&ss.dst_ready[j], 1);
    for (int j = 0; j < kJobSlots; ++j) {
      Barrier::init(&ss.job_full[j], 1);
      Barrier::init(&ss.job_empty[j], kMathThreads / 32 + 1);
    }
    cutlass::arch::fence_barrier_init();
  }

  // Whether an L2 tile's rows go out by TMA to p.l2_rows (see EngineParams::l2_rows).
  template <class Params>
  __device__ static bool l2_rows_by_tma(const Params& p, const ExpertTile& job) {
    return !kDgrad && job.kind == kL2Down && p.l2_rows != nullptr && p.l2_copy == nullptr;
  }

  // Whether a tile's epilogue stores through ss.row_dst: not FP8 L1 (its own epilogue), not a
  // dgrad dh tile (the SwiGLU backward writes dgate_up itself), not bench mode 1.
  template <class Params>
  __device__ static bool uses_row_dst(const Params& p, const ExpertTile& job) {
    const bool l1 = job.kind == kL1GateUp && !kDgrad;
    if (kFp8 && l1) return false;
    if (kDgrad && job.kind == kDgradDh) return false;
    if (l2_rows_by_tma(p, job)) return false;
    return p.bench_skip_epilogue != 1;
  }

  // Where row r of the tile's output block goes: L1's h row, or the caller's L2 row functor.
  template <class Params>
  __device__ static __nv_bfloat16* row_destination(const Params& p, const ExpertTile& job,
                                                   int r) {
    if (job.kind == kL1GateUp && !kDgrad)
      return p.h + int64_t(job.row_begin + r) * p.f + job.n_block * 128;
    __nv_bfloat16* d = p.l2_dest.row(job, r);
    return d == nullptr ? nullptr : d + job.n_block * kBlockN;
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
        if constexpr (kFp8) cute::prefetch_tma_descriptor(&p.op[g].sa_map);
      }
    }
    uint32_t it = 0, jn = 0;
    profile::RoleSums<profile::kProducerSlots> prof;  // (empty unless MEGAMOE_ENGINE_PROFILE)
    prof.set(profile::kPBeginClk, profile::clock32());
    while (true) {
      ExpertTile job;
      const bool more = sched.next(job);
      if (!more) job.kind = -1;
      const int slot = jn % kJobSlots;
      const uint32_t job_clk = profile::clock32();
      Barrier::wait(&ss.job_empty[slot], ((jn / kJobSlots) & 1) ^ 1);
      prof.since(profile::kPJobEmptyWait, job_clk);
      if (lane == 0) ss.jobs[slot] = job;
      __syncwarp();  // the job's store before the arrive (ClusterBarrier::arrive has no clobber)
      if (lane == 0) Barrier::arrive(&ss.job_full[slot]);
      ++jn;
      if (!more) break;
      prof.count(profile::kPTiles, 1);

      const GemmOperands& op = p.op[job.kind];
      if constexpr (kFp8) {
        load_tile_fp8(ss, p, op, job, it, lane, hooks);
        continue;
      }
      const ALoad mode = static_cast<ALoad>(op.a_load);
      // kClusterM = 2: contiguous A only; a 0-row tile (its B half is loaded for the peer) loads
      // no A and computes nothing.
      if (kClusterM == 2 && mode != ALoad::kTmaBlock) __trap();
      const bool load_a = kClusterM == 1 || job.rows > 0;
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
      const uint32_t a_bytes = mode == ALoad::kTmaBlock ? (load_a ? uint32_t(kABytes) : 0u)
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
        const uint32_t empty_clk = profile::clock32();
        Barrier::wait(&ss.empty[s], ((it / kStages) & 1) ^ 1);
        prof.since(profile::kPEmptyWait, empty_clk);
        if (lane == 0) Barrier::expect_transaction(&ss.full[s], kBBytes + a_bytes);
        __syncwarp();
        if constexpr (kBKMajor) {
          // Two boxes of 128 N-rows: L1 the gate rows [c, c+128) and the up rows [F+c, ...),
          // L2 the tile's two halves; each 16 KB, 128B-swizzled rows of 64 K.
          // kClusterM = 2: this CTA's box only, multicast into both CTAs' stage.
          const int box = kClusterM == 2 ? int(cute::block_rank_in_cluster()) : lane;
          if (kClusterM == 2 ? lane == 0 : lane < 2) {
            const int n_row = job.kind == kL1GateUp && !kDgrad
                                  ? (box == 0 ? nb * 128 : p.f + nb * 128)
                                  : nb * kBlockN + box * 128;
            if constexpr (kClusterM == 2) {
              cute::SM90_TMA_LOAD_MULTICAST_2D::copy(&op.b_map, &ss.full[s], uint16_t(0x3), 0ull,
                                                     ss.b[s] + box * kBHalfBytes, kb * kBlockK,
                                                     job.expert * op.n + n_row);
            } else {
              cute::SM90_TMA_LOAD_2D::copy(&op.b_map, &ss.full[s], 0ull,
                                           ss.b[s] + box * kBHalfBytes, kb * kBlockK,
                                           job.expert * op.n + n_row);
            }
          }
        } else if (lane < 4) {
          cute::SM90_TMA_LOAD_2D::copy(&op.b_map, &ss.full[s], 0ull,
                                       ss.b[s] + lane * kBBoxBytes, b_col, b_row0 + kb * kBlockK);
        }
        if (kb == 0) {
          // B of the first stage is already on its way; now wait for the tile's rows.
          const uint32_t rows_clk = profile::clock32();
          if (lane == 0) hooks.wait_rows_ready(job);
          __syncwarp();
          prof.since(profile::kPRowsWait, rows_clk);
          detail::fence_proxy_async_global();
        }
        if (mode == ALoad::kTmaBlock) {
          if (lane == 0 && load_a)
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
    prof.set(profile::kPEndClk, profile::clock32());
    if (lane == 0) prof.flush(profile::kProducer, profile::kProducerEndNs);
  }

  // One FP8 tile's stages (producer warp, all lanes): per 128 of K the two B blocks (lanes 0, 1),
  // their scales, A and A's scales (lane 0); at least two stages (see the header: staging).
  template <class Params, class Hooks>
  __device__ static void load_tile_fp8(SharedStorage& ss, const Params& p, const GemmOperands& op,
                                       const ExpertTile& job, uint32_t& it, int lane,
                                       const Hooks& hooks) {
    const int num_kb = op.k / kBlockK;
    const int num_stages = num_kb < 2 ? 2 : num_kb;
    const int nbs = op.n / 128;
    // 128-column block of B half h (lane & 1): L1 gate [c, c + 128) and up [F + c, ...),
    // L2 the tile's two blocks.
    const int half = lane & 1;
    const int bcol = job.kind == kL1GateUp ? (half == 0 ? job.n_block : p.f / 128 + job.n_block)
                                           : 2 * job.n_block + half;
    const int b_row = job.expert * op.n + bcol * 128;
    const float* b_scale = op.b_scale + int64_t(job.expert) * num_kb * nbs + bcol;
    // B scales of the first 16 K-blocks, lane 2 kb + h holding (kb, h): loaded once per tile.
    const float b_scale_first = lane / 2 < num_kb ? __ldg(b_scale + int64_t(lane / 2) * nbs) : 0.f;
    for (int kb = 0; kb < num_stages; ++kb, ++it) {
      const int s = it % kStages;
      const bool loads = kb < num_kb;
      const float sb = kb < 16 ? __shfl_sync(0xffffffffu, b_scale_first, 2 * kb + half)
                               : (loads && lane < 2 ? __ldg(b_scale + int64_t(kb) * nbs) : 0.f);
      Barrier::wait(&ss.empty[s], ((it / kStages) & 1) ^ 1);
      if (lane == 0 && loads)
        Barrier::expect_transaction(&ss.full[s], kBBytes + kABytes + kAScaleBytes);
      __syncwarp();
      if (loads && lane < 2) {
        cute::SM90_TMA_LOAD_2D::copy(&op.b_map, &ss.full[s], 0ull,
                                     ss.b[s] + lane * kBHalfBytes, kb * kBlockK, b_row);
        ss.scales.b[s][lane] = sb;  // published by this lane's arrive (release) below
      }
      if (kb == 0) {
        // B of the first stage is already on its way; now wait for the tile's rows (and, for
        // L2, their scales: written by the L1 tiles beside h).
        if (lane == 0) hooks.wait_rows_ready(job);
        __syncwarp();
        detail::fence_proxy_async_global();
      }
      if (loads && lane == 0) {
        cute::SM90_TMA_LOAD_2D::copy(&op.a_map, &ss.full[s], 0ull, ss.a[s], kb * kBlockK,
                                     job.row_begin);
        // The scale box's innermost coordinate is a row index (fp32 elements) and experts'
        // rows sit in the pool at any offset, so row_begin * 4 bytes is in general not 16-byte
        // aligned: a TMA whose innermost start address is not 16-byte aligned faults on Hopper
        // (illegal instruction, sticky; reported in triton-lang/triton#7385 and
        // tile-ai/tilelang#2681): the fault of the first GPU run, confirmed on the H200 (the
        // harness's --unaligned-scales, the first build's start, faults; this start runs).
        // Every other TMA box of this engine, bf16's too, starts at a multiple of 128 bytes.
        // So the box starts at row_begin rounded down to 4 rows, 132 rows, the tile's at
        // row_begin % 4 (mainloop_fp8).
        const int sa_row0 = op.sa_unaligned ? job.row_begin : (job.row_begin & ~3);
        cute::SM90_TMA_LOAD_2D::copy(&op.sa_map, &ss.full[s], 0ull, ss.scales.a[s], sa_row0,
                                     kb);
      }
      Barrier::arrive(&ss.full[s]);
    }
  }

  // ---------------------------------------------------------------- math (two warpgroups)
  // One FP8 tile's mainloop (a consumer warpgroup): per stage, four 64-column chunks of 4 x
  // wgmma m64n64k32, chunk c into tmp[32 (c % 2) ..], then acc[chunk] += tmp * (sa[row] *
  // sb[half]). Each chunk's batch is committed before the previous chunk is waited for
  // (wait<1>) and promoted, so the warpgroup keeps a batch in the tensor pipe while it
  // promotes; only the stage's last chunk is waited for alone (wait<0>). (Session 23's first
  // schedule, per 128-column half, drained the pipe twice per stage before 64 FFMA each: the
  // chunks took 10% off L1 and 5% off L2 at 30B, bit for bit the same outputs; RESULTS
  // sessions 24-25.) Chunk c is columns 64 c .. of the tile: acc[32 c + i]. Promoting a
  // stage's last chunk during the next stage's first made ptxas serialise every wgmma (C7514,
  // nvcc 13.0), so a stage ends with its own wait. A stage is released once read, except the
  // tile's last two (the epilogue's staging); a one-stage tile also waits for the padding stage
  // the producer adds. sa_off: where the tile's first row sits in a stage's A-scale box
  // (load_tile_fp8).
  __device__ static void mainloop_fp8(SharedStorage& ss, int num_kb, int sa_off, int wg,
                                      int warp_in_wg, int lane, uint32_t& it, float (&acc)[128],
                                      float (&tmp)[kFp8 ? 64 : 1]) {
    if constexpr (kFp8) {
      const int num_stages = num_kb < 2 ? 2 : num_kb;
      const int row = 64 * wg + warp_in_wg * 16 + (lane >> 2);  // fragment rows row, row + 8
      const int sa_row = sa_off + row;
      // acc[kDst ..] += tmp[kBuf ..] x (s0: row, s1: row + 8); tmp[kBuf + i] is row + 8 ((i / 2)
      // % 2), column 8 (i / 4) + 2 (lane % 4) + i % 2 of its chunk.
      auto promote = [&](auto buf, auto dst, float s0, float s1) {
        constexpr int kBuf = decltype(buf)::value, kDst = decltype(dst)::value;
#pragma unroll
        for (int i = 0; i < 32; ++i) cute::warpgroup_fence_operand(tmp[kBuf + i]);
#pragma unroll
        for (int i = 0; i < 32; ++i)
          acc[kDst + i] = fmaf(tmp[kBuf + i], (i & 2) ? s1 : s0, acc[kDst + i]);
      };
      for (int kb = 0; kb < num_stages; ++kb, ++it) {
        const int s = it % kStages;
        Barrier::wait(&ss.full[s], (it / kStages) & 1);
        if (kb < num_kb) {
          const float sa0 = ss.scales.a[s][sa_row], sa1 = ss.scales.a[s][sa_row + 8];
          const float sb0 = ss.scales.b[s][0], sb1 = ss.scales.b[s][1];
          const uint32_t a_addr = detail::smem_u32(ss.a[s]) + wg * (64 * 128);
          detail::static_for([&](auto chunk) {
            constexpr int c = decltype(chunk)::value;
            constexpr int kBuf = 32 * (c & 1);
            // B K-major: the chunk's 64 N-rows of 128 B start 8 KB into its half.
            const uint32_t b_addr =
                detail::smem_u32(ss.b[s]) + (c >> 1) * kBHalfBytes + (c & 1) * 64 * 128;
#pragma unroll
            for (int i = 0; i < 32; ++i) cute::warpgroup_fence_operand(tmp[kBuf + i]);
            cute::warpgroup_arrive();
#pragma unroll
            for (int k = 0; k < kBlockK / 32; ++k) {
              // A and B K-major, 128 B rows (128B swizzle): +32 B per 32 of K; SBO = 8 rows.
              const uint64_t da = detail::gmma_desc_sw128(a_addr + k * 32, 16, 1024);
              const uint64_t db = detail::gmma_desc_sw128(b_addr + k * 32, 16, 1024);
              detail::wgmma_fp8_n64_call<kBuf>(da, db, tmp, k > 0,
                                               cute::make_index_sequence<32>{});
            }
            cute::warpgroup_commit_batch();
#pragma unroll
            for (int i = 0; i < 32; ++i) cute::warpgroup_fence_operand(tmp[kBuf + i]);
            if constexpr (c > 0) {  // chunk c - 1, while chunk c runs
              const float sb = ((c - 1) >> 1) ? sb1 : sb0;
              cute::warpgroup_wait<1>();
              promote(cute::Int<32 - kBuf>{}, cute::Int<32 * (c - 1)>{}, sa0 * sb, sa1 * sb);
            }
          }, cute::make_int_sequence<4>{});
          cute::warpgroup_wait<0>();
          promote(cute::Int<32>{}, cute::Int<96>{}, sa0 * sb1, sa1 * sb1);  // chunk 3
        }
        if (kb < num_stages - 2 && lane == 0) Barrier::arrive(&ss.empty[s]);
      }
    }
  }

  // L1's residual gate_up of one consumer warpgroup, staged in slots 1 (gate) and 2 (up) in the
  // TMA layout (kTmaHalfBytes) and made visible to the async proxy before the warpgroup's
  // barrier. A warpgroup whose 64 rows all lie in the tile hands them to TMA: thread 0 issues
  // four {64, 64} boxes and returns true (store_slots_tma). The stores themselves then drain
  // while the next tile runs. (Stored by generic stores, as before session 22, they held up the
  // release: +0.94 ms of the 235B one-rank forward, RESULTS session 21; with TMA +0.18.)
  template <class Params>
  __device__ static bool store_gate_up(SharedStorage& ss, const Params& p, const ExpertTile& job,
                                       const uint32_t (&slot_base)[3], int s_w, int wg, int t) {
    if (p.bench_skip_epilogue == 2) return false;
    return store_slots_tma(p.gate_up_map, p.gate_up, 2 * int64_t(p.f),
                           {ss.b[s_w] + kSlotBytes, ss.a[s_w]}, {slot_base[1], slot_base[2]},
                           {job.n_block * 128, p.f + job.n_block * 128}, job, wg, t);
  }

  // Two TMA-layout staging slots of warpgroup wg (64 rows x 128 columns each: slot i holds the
  // destination's columns col[i] ..) to rows row_begin + 64 wg .. of a row-major bf16 matrix
  // `dst` (row pitch ld elements; `map` its TMA map, box {64, 64}). A full warpgroup: thread 0
  // issues four boxes and commits them as one bulk group (returns true there: that thread must
  // wait for TMA's reads, cute::tma_store_wait<0>, before the stage goes back). A part-filled
  // one (an expert's last tile): 16-byte stores of the rows inside the tile, rows t / 16 + 8 k,
  // chunk t % 16; the rows past the tile belong to the next expert, so no box may write them.
  __device__ static bool store_slots_tma(const CUtensorMap& map, __nv_bfloat16* dst, int64_t ld,
                                         uint8_t* const (&slot_ptr)[2],
                                         const uint32_t (&slot_addr)[2], const int (&col)[2],
                                         const ExpertTile& job, int wg, int t) {
    const int row0 = 64 * wg;
    if (job.rows >= row0 + 64) {
      if (t != 0) return false;
#pragma unroll
      for (int sl = 0; sl < 2; ++sl)
#pragma unroll
        for (int half = 0; half < 2; ++half)
          cute::SM90_TMA_STORE_2D::copy(&map, slot_ptr[sl] + half * kTmaHalfBytes,
                                        col[sl] + half * 64, job.row_begin + row0);
      cute::tma_store_arrive();
      return true;
    }
    const int r0 = t >> 4, chunk = t & 15;
#pragma unroll
    for (int sl = 0; sl < 2; ++sl) {
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const int r = r0 + 8 * k;
        if (row0 + r >= job.rows) continue;
        const uint4 val = detail::ld_shared_v4(slot_addr[sl] + tma_slot_offset(r, chunk));
        detail::st_global_v4(dst + int64_t(job.row_begin + row0 + r) * ld + col[sl] + chunk * 8,
                             val);
      }
    }
    return false;
  }

  // FP8 L1 epilogue of one consumer warpgroup: h (hv: this thread's bf16 pairs, as the bf16
  // epilogue stages them) quantised in 1 x 128 blocks (the tile's 128 h columns of a row sit in
  // one quad of lanes), e4m3 staged in slot 0 (64 rows x 128 B at a 256 B pitch, 16-byte chunks
  // XOR-swizzled by row % 8), the scales stored; with p.gate_up (residuals) the bf16 gate and up
  // staged by the caller in slots 1 and 2 go out first (store_gate_up); then the stage s_w is
  // handed back and the h rows stored.
  template <class Params>
  __device__ static void epilogue_h_fp8(SharedStorage& ss, const Params& p, const ExpertTile& job,
                                        const uint32_t (&hv)[32], const uint32_t (&slot_base)[3],
                                        int s_w, int wg, int warp_in_wg, int lane, int t) {
    const uint32_t slot = slot_base[0];
    float scale[2];
    bool fast_div = true;  // "fp8": every block of this thread has a scale where DivByScale holds
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float amax = 0.0f;
#pragma unroll
      for (int ii = 0; ii < 16; ++ii) {
        const uint32_t v = hv[2 * ii + hh];
        amax = fmaxf(amax, fmaxf(fabsf(detail::bf16_lo(v)), fabsf(detail::bf16_hi(v))));
      }
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
      scale[hh] = Fp8BlockScale(amax, p.pow2 != 0);
      // amax 0: every value is +-0 (or NaN, which fmaxf skips), and 0 r = 0 as 0 / s.
      fast_div = fast_div && (amax == 0.0f || DivByScaleHolds(scale[hh]));
    }
    // One rule per warp (no divergence in the loop below).
    const bool warp_fast_div = __all_sync(0xffffffffu, fast_div);
    const int frag_row = warp_in_wg * 16 + (lane >> 2);
    const uint32_t frag_base = slot + uint32_t(frag_row) * kSlotRowBytes + uint32_t(lane & 3) * 2;
    const uint32_t frag_sw = uint32_t(lane >> 2);  // frag_row % 8
    // q = satfinite(h / s) as fp8_quantize.cu, by the same quotient rule (fp8_quotient.cuh).
    WithQuotient(p.pow2 != 0, warp_fast_div, [&](auto quotient) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const float s = scale[hh], inv = 1.0f / s;
#pragma unroll
        for (int ii = 0; ii < 16; ++ii) {
          const uint32_t v = hv[2 * ii + hh];
          const float lo = detail::bf16_lo(v), hi = detail::bf16_hi(v);
          const uint16_t q = detail::e4m3x2(quotient(lo, s, inv), quotient(hi, s, inv));
          // byte column c = 8 ii + 2 (lane % 4): chunk c / 16 = ii / 2, offset 8 (ii % 2) + ..
          detail::st_shared_b16(frag_base + hh * 8 * kSlotRowBytes +
                                    (((uint32_t(ii >> 1) ^ frag_sw) << 4) | (uint32_t(ii & 1) << 3)),
                                q);
        }
      }
    });
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = 64 * wg + frag_row + 8 * hh;
      if ((lane & 3) == 0 && r < job.rows && p.bench_skip_epilogue != 2)
        p.h_scale[int64_t(job.n_block) * p.h_scale_pitch + job.row_begin + r] = scale[hh];
    }
    // gate_up's slots (written by the caller) are read by TMA: generic writes -> async proxy.
    if (p.gate_up != nullptr) cutlass::arch::fence_view_async_shared();
    detail::named_barrier_sync(kFirstWgBarrier + wg, 128);
    const bool gate_up_tma =
        p.gate_up != nullptr && store_gate_up(ss, p, job, slot_base, s_w, wg, t);
    // 8 lanes per 128-byte row (chunk t % 8), rows t / 8 + 16 k.
    const int chunk = t & 7, row0 = t >> 3;
    uint4 v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
      v[k] = detail::ld_shared_v4(slot + uint32_t(row0 + 16 * k) * kSlotRowBytes +
                                  ((uint32_t(chunk) ^ uint32_t(row0 & 7)) << 4));
    cutlass::arch::fence_view_async_shared();
    if (gate_up_tma) cute::tma_store_wait<0>();  // TMA has read gate_up's slots
    __syncwarp();
    if (lane == 0) detail::mbar_arrive_cnt(&ss.empty[s_w], 2);  // 4 warps x 2 = 8
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int r = 64 * wg + row0 + 16 * k;
      if (r < job.rows && p.bench_skip_epilogue != 2)
        detail::st_global_v4(p.h_q + int64_t(job.row_begin + r) * p.f + job.n_block * 128 +
                                 chunk * 16,
                             v[k]);
    }
  }

  // kDgrad's dh epilogue, one consumer warpgroup, after its dh is staged (slots 0, 1: columns
  // [c, c + 128), [c + 128, c + 256) of F, c = n_block * 256). Per slot, a thread loads the gate
  // and up vectors of its 8 rows (16 loads in flight), then per row reads its 16-byte vector of
  // dh from the slot, computes dgate and dup and stores them to dgate_up (and dh to l2_copy).
  // The exact path is taken warp-wide when any element leaves the fast path's range.
  template <class Params>
  __device__ static void epilogue_swiglu_backward(const Params& p, const ExpertTile& job,
                                                  const uint32_t (&slot_base)[3], int read_slots,
                                                  int wg, int rd_row0, int rd_chunk,
                                                  uint32_t rd_off) {
    const int64_t ld = 2 * int64_t(p.f);
    for (int sl = 0; sl < read_slots; ++sl) {
      const int col = job.n_block * kBlockN + sl * 128 + rd_chunk * 8;
      uint4 g[8], u[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const int r = 64 * wg + rd_row0 + 8 * k;
        g[k] = u[k] = make_uint4(0u, 0u, 0u, 0u);
        if (r < job.rows) {
          const __nv_bfloat16* row = p.fwd_gate_up + int64_t(job.row_begin + r) * ld + col;
          g[k] = __ldg(reinterpret_cast<const uint4*>(row));
          u[k] = __ldg(reinterpret_cast<const uint4*>(row + p.f));
        }
      }
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const int r = 64 * wg + rd_row0 + 8 * k;
        const uint4 dv = detail::ld_shared_v4(slot_base[sl] + rd_off + k * 8 * kSlotRowBytes);
        uint4 dgv, duv;
        bool slow = false;
        detail::swiglu_grad_x8(dv, g[k], u[k], false, dgv, duv, slow);
        if (__any_sync(0xffffffffu, slow))
          detail::swiglu_grad_x8(dv, g[k], u[k], true, dgv, duv, slow);
        if (r >= job.rows || p.bench_skip_epilogue == 2) continue;
        __nv_bfloat16* out = p.dgate_up + int64_t(job.row_begin + r) * ld + col;
        detail::st_global_v4(out, dgv);
        detail::st_global_v4(out + p.f, duv);
        if (p.l2_copy != nullptr)
          detail::st_global_v4(p.l2_copy + int64_t(job.row_begin + r) * p.l2_copy_ld + col, dv);
      }
    }
  }

  template <class Params>
  __device__ static void math(SharedStorage& ss, const Params& p) {
    const int wg = (threadIdx.x / 128) - kFirstMathWarp / 4;  // 0 or 1: rows 64 wg ..
    const int t = threadIdx.x & 127;                           // thread in the warpgroup
    const int warp_in_wg = t >> 5;
    const int lane = t & 31;
    float acc[128];
    uint32_t it = 0, jn = 0;
    // Fragment writes: rows warp_in_wg * 16 + lane / 4 (+ 8), row % 8 = lane / 4.
    const uint32_t frag_off = uint32_t(warp_in_wg * 16 + (lane >> 2)) * kSlotRowBytes +
                              uint32_t(lane & 3) * 4;
    const uint32_t frag_sw = uint32_t(lane >> 2);
    const uint32_t frag_off_tma = uint32_t(warp_in_wg * 16 + (lane >> 2)) * 128 +
                                  uint32_t(lane & 3) * 4;
    if (p.gate_up != nullptr && t == 0) cute::prefetch_tma_descriptor(&p.gate_up_map);
    // Row reads: rows (t / 16) + 8 k (k = 0..7), chunk t % 16; row % 8 = (t / 16) % 8.
    const int rd_row0 = t >> 4;
    const int rd_chunk = t & 15;
    const uint32_t rd_off = uint32_t(rd_row0) * kSlotRowBytes +
                            ((uint32_t(rd_chunk) ^ uint32_t(rd_row0 & 7)) << 4);
    // FP8: one 128-column half of a stage, before its promotion.
    [[maybe_unused]] float tmp[kFp8 ? 64 : 1];
    profile::RoleSums<profile::kWgSlots> prof;  // (empty unless MEGAMOE_ENGINE_PROFILE)
    prof.set(profile::kWgBeginClk, profile::clock32());
    uint32_t epilogue_clk = 0;
    // Register-direct L2 rows (kDeferL2Epilogue): column group m (32 columns: accumulator
    // blocks i = 4 m + j of 8 columns, j = 0..3) of this thread's rows pend_row + 8 hh in the
    // tile (hh = 0, 1), word(j, hh) = the bf16 pair of columns 8 i + 2 (lane % 4) + {0, 1}: a
    // quad transpose per row, then one 16-byte store of columns 32 m + 8 (lane % 4) .. + 7 to
    // row_dst[slot][row] (null: a row past the tile). Warp-uniform (shuffles).
    const int pend_row = 64 * wg + 16 * warp_in_wg + (lane >> 2);
    [[maybe_unused]] auto store_group = [&](int slot, int m, auto&& word) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        __nv_bfloat16* const dst = ss.row_dst[slot][pend_row + 8 * hh];
        uint32_t x[4] = {word(0, hh), word(1, hh), word(2, hh), word(3, hh)};
        detail::quad_transpose(x, lane & 3);
        if (dst != nullptr && p.bench_skip_epilogue != 2)
          detail::st_global_v4(dst + 32 * m + 8 * (lane & 3), make_uint4(x[0], x[1], x[2], x[3]));
      }
    };
    // L1's SwiGLU, h = silu(g) * u from the bf16-rounded gate and up (what the gate_up residual
    // holds, as the cuda backend's SwigluForward and the reference compute it), for blocks of 8
    // columns j = j_begin..j_end - 1 (cute::Int) and rows hh = 0, 1 of this thread: gate(j, hh)
    // and up(j, hh) are packed bf16 pairs, out(j, hh, word) takes the pair of h. The fast path,
    // or Swiglu() itself for all the blocks where the fast path's range test fails somewhere in
    // the warp (where it passes both give the same bits, so the vote's span changes no bit).
    // Warp-uniform. The staged epilogue calls it on a tile's 16 blocks, the deferred one on
    // parts of an h group (4 blocks).
    auto swiglu_blocks = [&](auto j_begin, auto j_end, auto&& gate, auto&& up, auto&& out) {
      bool slow = false;
#pragma unroll
      for (int j = j_begin; j < j_end; ++j)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const uint32_t g = gate(j, hh), u = up(j, hh);
          const float h0 = detail::swiglu_fast_path(detail::bf16_lo(g), detail::bf16_lo(u), slow);
          const float h1 = detail::swiglu_fast_path(detail::bf16_hi(g), detail::bf16_hi(u), slow);
          out(j, hh, detail::pack_bf16x2(h0, h1));
        }
      if (__any_sync(0xffffffffu, slow)) {
#pragma unroll
        for (int j = j_begin; j < j_end; ++j)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const uint32_t g = gate(j, hh), u = up(j, hh);
            const float h0 = megamoe::grouped::Swiglu(detail::bf16_lo(g), detail::bf16_lo(u));
            const float h1 = megamoe::grouped::Swiglu(detail::bf16_hi(g), detail::bf16_hi(u));
            out(j, hh, detail::pack_bf16x2(h0, h1));
          }
      }
    };
    // The tile whose last groups are still to be written (pend_slot its job slot, -1: none;
    // pend_l1: an L1 tile). L2: pend[8 g + 2 j + hh] = word(j, hh) of group kFirstDeferredGroup
    // + g. L1: pend[16 g + 2 j + hh] and pend[16 g + 8 + 2 j + hh] = the bf16 gate and up pairs
    // of h group kFirstDeferredL1Group + g. The slot's row_dst table stays until the tile's
    // `stored` arrival.
    [[maybe_unused]] uint32_t pend[kDeferEpilogue ? kPendWords : 1];
    int pend_slot = -1;
    [[maybe_unused]] bool pend_l1 = false;
    // Part P of the pending tile: L2 (P < kL2DeferParts) its group kFirstDeferredGroup + P; L1
    // (P < kL1DeferParts) the SwiGLU of blocks j0 .. j0 + 4 / kL1PartsPerGroup - 1 of h group
    // kFirstDeferredL1Group + P / kL1PartsPerGroup, and in the group's last part its stores.
    [[maybe_unused]] auto defer_part = [&](auto part) {
      if constexpr (kDeferEpilogue) {
        constexpr int P = decltype(part)::value;
        if (!pend_l1) {
          if constexpr (kDeferL2Epilogue && P < kL2DeferParts)
            store_group(pend_slot, kFirstDeferredGroup + P,
                        [&](int j, int hh) { return pend[8 * P + 2 * j + hh]; });
        } else if constexpr (kDeferL1Epilogue && P < kL1DeferParts) {
          // A group's earlier parts keep their h words where their gate pairs were
          // (pend[16 g + 2 j + hh], j < j0), its last part stores the group.
          constexpr int g = P / kL1PartsPerGroup, q = P % kL1PartsPerGroup;
          constexpr int nb = 4 / kL1PartsPerGroup, j0 = q * nb;
          uint32_t hw[4][2];
          swiglu_blocks(cute::Int<j0>{}, cute::Int<j0 + nb>{},
                        [&](int j, int hh) { return pend[16 * g + 2 * j + hh]; },
                        [&](int j, int hh) { return pend[16 * g + 8 + 2 * j + hh]; },
                        [&](int j, int hh, uint32_t w) { hw[j][hh] = w; });
          if constexpr (q + 1 < kL1PartsPerGroup) {
#pragma unroll
            for (int j = j0; j < j0 + nb; ++j)
#pragma unroll
              for (int hh = 0; hh < 2; ++hh) pend[16 * g + 2 * j + hh] = hw[j][hh];
          } else {
            store_group(pend_slot, kFirstDeferredL1Group + g, [&](int j, int hh) {
              return j < j0 ? pend[16 * g + 2 * j + hh] : hw[j][hh];
            });
          }
        }
      }
    };
    // Every part of the pending tile, outside a mainloop.
    [[maybe_unused]] auto defer_all = [&]() {
      detail::static_for([&](auto part) { defer_part(part); },
                         cute::make_int_sequence<kMaxDeferParts>{});
    };
    // The cycle accounting of deferred parts run since `since` (inside a mainloop or not).
    [[maybe_unused]] auto count_parts = [&](uint32_t since, bool in_mainloop) {
      const uint32_t cycles = profile::clock32() - since;
      prof.count(profile::kWgDeferredParts, cycles);
      if (in_mainloop) prof.count(profile::kWgDeferredPartsInMainloop, cycles);
    };
    // The pending tile's stores are issued: its `stored` arrival.
    [[maybe_unused]] auto defer_finish = [&]() {
      Barrier::arrive(&ss.stored[pend_slot]);
      pend_slot = -1;
    };
    while (true) {
      const int slot = jn % kJobSlots;
      const uint32_t job_phase = (jn / kJobSlots) & 1;
      const uint32_t job_clk = profile::clock32();
      Barrier::wait(&ss.job_full[slot], job_phase);
      prof.since(profile::kWgJobWait, job_clk);
      detail::compiler_barrier();  // the wait's asm has no memory clobber: read the job after it
      const ExpertTile job = ss.jobs[slot];
      __syncwarp();
      if (lane == 0) Barrier::arrive(&ss.job_empty[slot]);
      ++jn;
      if constexpr (kDeferEpilogue) {
        // The last tile's rows; and a pending L1 tile before an L2 tile, which may wait for it.
        if (pend_slot >= 0 && (job.kind < 0 || (pend_l1 && job.kind == kL2Down))) {
          const uint32_t parts_clk = profile::clock32();
          defer_all();
          defer_finish();
          count_parts(parts_clk, false);
        }
      }
      if (job.kind < 0) break;

      const GemmOperands& op = p.op[job.kind];
      const bool fence_a = op.a_load == int32_t(ALoad::kCpAsyncRows);
      const int num_kb = op.k / kBlockK;
      // bf16: K >= 128, the tile's last two stages become the staging (FP8: K >= 128 and the
      // producer pads a one-stage tile to two).
      if (!kFp8 && num_kb < 2) __trap();
      const bool l1 = job.kind == kL1GateUp && !kDgrad;
      const bool dh_tile = kDgrad && job.kind == kDgradDh;  // SwiGLU-backward epilogue
      const int nslots = p.bench_skip_epilogue == 1 || p.bench_skip_epilogue == 4 ? 0
                         : l1 ? (!kFp8 && p.gate_up != nullptr ? 3 : 1)
                              : 2;
      // L2's rows by TMA (EngineParams::l2_rows): staged in the TMA layout.
      const bool l2_tma = nslots > 0 && l2_rows_by_tma(p, job);
      // kDeferL2Epilogue: this tile's rows are written from registers, half of them during the
      // next tile's mainloop (see the header).
      [[maybe_unused]] const bool defer_l2 = kDeferL2Epilogue && !l1 && nslots > 0 && !l2_tma &&
                                             p.l2_copy == nullptr && p.bench_skip_epilogue != 3;
      // kDeferL1Epilogue: the same for L1 without gate_up (nslots 1), h from SwiGLU.
      [[maybe_unused]] const bool defer_l1 = kDeferL1Epilogue && l1 && nslots == 1 &&
                                             !p.l1_raw_gate && p.bench_skip_epilogue != 3;
      // (Each row's destination is in ss.row_dst[slot], from the signaller: dst_ready[slot].)
      if (dh_tile && nslots > 0) {
        // The epilogue's gate and up columns into L2 while the mainloop runs: 128 rows x
        // (gate, up) x 4 lines of 128 B, 4 lines per math thread.
        const int i = threadIdx.x - kFirstMathWarp * 32;  // 0..255
        const int r = i >> 1;
        if (r < job.rows) {
          const __nv_bfloat16* line = p.fwd_gate_up + int64_t(job.row_begin + r) * 2 * p.f +
                                      (i & 1) * p.f + job.n_block * kBlockN;
#pragma unroll
          for (int j = 0; j < 4; ++j)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(line + 64 * j));
        }
      }
      // Zeroed here rather than with scale-D = 0 on the first wgmma, so that the compiler sees
      // the accumulators die at the end of each epilogue (else they stay live across tiles and
      // the staging vectors spill).
#pragma unroll
      for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
      const uint32_t mainloop_clk = profile::clock32();
      if constexpr (kFp8) {
        mainloop_fp8(ss, num_kb, op.sa_unaligned ? 0 : (job.row_begin & 3), wg, warp_in_wg,
                     lane, it, acc, tmp);
      } else {
      // One stage kb (it: its ring counter). parts = std::true_type: a part of the pending tile
      // goes after the stage's wgmma issue and the previous stage's release (kDeferEpilogue).
      auto stage = [&](int kb, auto parts) {
        const int s = it % kStages;
        const uint32_t full_clk = profile::clock32();
        Barrier::wait(&ss.full[s], (it / kStages) & 1);
        prof.since(profile::kWgFullWait, full_clk);
        if (fence_a) cutlass::arch::fence_view_async_shared();  // cp.async (generic) -> wgmma
        const uint32_t a_addr = detail::smem_u32(ss.a[s]) + wg * (64 * 128);
        const uint32_t b_addr = detail::smem_u32(ss.b[s]);
#pragma unroll
        for (int i = 0; i < 128; ++i) cute::warpgroup_fence_operand(acc[i]);
        cute::warpgroup_arrive();
        // kClusterM = 2: a 0-row tile (its B half loaded for the peer) has no A of its own in
        // the stage and multiplies what the A region last held, which no one writes while this
        // warpgroup owns the stage; its epilogue stores no row. Not skipped: a branch around
        // the wgmmas made ptxas serialise them in every tile (C7519, "warpgroup.arrive is
        // injected"; without it the 30B cluster dgrad harness went from 3.15 to 2.86 ms).
#pragma unroll
        for (int k = 0; k < kBlockK / 16; ++k) {
          // A K-major: +32 B per 16 of K inside the swizzled 128 B row; SBO = 8 rows = 1024 B.
          // B N-major: +16 K-rows = 2048 B; LBO = next 64-column box (8 KB); SBO = 1024 B.
          // B K-major: as A, over its 256 N-rows.
          const uint64_t da = detail::gmma_desc_sw128(a_addr + k * 32, 16, 1024);
          if constexpr (kBKMajor) {
            const uint64_t db = detail::gmma_desc_sw128(b_addr + k * 32, 16, 1024);
            detail::wgmma_call<detail::WgmmaBK>(da, db, acc, true,
                                                cute::make_index_sequence<128>{});
          } else {
            const uint64_t db = detail::gmma_desc_sw128(b_addr + k * 2048, kBBoxBytes, 1024);
            detail::wgmma_call(da, db, acc, true, cute::make_index_sequence<128>{});
          }
        }
        cute::warpgroup_commit_batch();
#pragma unroll
        for (int i = 0; i < 128; ++i) cute::warpgroup_fence_operand(acc[i]);
        // Release the previous stage, except the second-to-last one of the tile (staging).
        if (kb > 0) {
          cute::warpgroup_wait<1>();
          if (kb != num_kb - 1 && lane == 0) release_stage(ss, (it - 1) % kStages, 1);
        }
        // A part after the release, not before the wait: before it, each part delayed the
        // stage's refill by its own length, and the L1 + L2 deferred harness waited for data in
        // 32% of its cycles (1,232 cycles a stage; session 33).
        if constexpr (decltype(parts)::value) {
          if (pend_slot >= 0) {
            const uint32_t parts_clk = profile::clock32();
            detail::static_for(
                [&](auto part) {
                  if (kb == decltype(part)::value) defer_part(part);
                },
                cute::make_int_sequence<kMaxDeferParts>{});
            if (kb == (pend_l1 ? kL1DeferParts : kL2DeferParts) - 1) defer_finish();
            count_parts(parts_clk, true);
          }
        }
      };
      int kb = 0;
      if constexpr (kDeferEpilogue) {
        // The first stages carry the parts, peeled off so that the loop below stays as the
        // compiler unrolls it without them (with the parts inside, it was not unrolled).
        for (; kb < num_kb && kb < kMaxDeferParts; ++kb, ++it) stage(kb, std::true_type{});
      }
      for (; kb < num_kb; ++kb, ++it) stage(kb, std::false_type{});
      cute::warpgroup_wait<0>();
#pragma unroll
      for (int i = 0; i < 128; ++i) cute::warpgroup_fence_operand(acc[i]);
      if constexpr (kDeferEpilogue) {
        if (pend_slot >= 0) {  // a tile shorter than its pending tile's parts: the parts left
          const uint32_t parts_clk = profile::clock32();
          detail::static_for(
              [&](auto part) {
                if (decltype(part)::value >= num_kb) defer_part(part);
              },
              cute::make_int_sequence<kMaxDeferParts>{});
          defer_finish();
          count_parts(parts_clk, true);
        }
        // Dead from here on every path (a constant), or the compiler keeps them live through
        // the epilogues below, where L1's SwiGLU then spilled.
#pragma unroll
        for (int i = 0; i < kPendWords; ++i) pend[i] = 0u;
        // A deferred tile needs no staging: this warp's wgmma have read the tile's last two
        // stages (wait<0> above), so both go back now.
        if ((defer_l2 || defer_l1) && lane == 0) {
          release_stage(ss, (it - 2) % kStages, 1);
          release_stage(ss, (it - 1) % kStages, 1);
        }
      }
      }
      prof.since(profile::kWgMainloop, mainloop_clk);
      prof.count(profile::kWgKBlocks, uint32_t(num_kb));
      prof.count(profile::kWgTiles, 1);
      epilogue_clk = profile::clock32();
      // The bf16 pair of accumulator columns 8 col8 + 2 (lane % 4) + {0, 1}, row hh.
      auto acc_pair = [&](int col8, int hh) {
        return detail::pack_bf16x2(acc[4 * col8 + 2 * hh], acc[4 * col8 + 2 * hh + 1]);
      };

      if constexpr (kDeferEpilogue) {
        if (defer_l2 || defer_l1) {
          // Deferred (see the header; its stages went back after the mainloop): the first
          // groups are stored now, the others' bf16 pairs kept for the next tile's mainloop.
          if (!uses_row_dst(p, job)) __trap();
          Barrier::wait(&ss.dst_ready[slot], job_phase);
          detail::compiler_barrier();  // the wait's asm has no memory clobber: row_dst after it
          bool l1_tile = false;
          if constexpr (kDeferL1Epilogue) {
            if (defer_l1) {  // h group m: gate blocks 4 m + j, up blocks 16 + 4 m + j
              l1_tile = true;
#pragma unroll
              for (int m = 0; m < kFirstDeferredL1Group; ++m) {
                uint32_t hw[4][2];
                swiglu_blocks(cute::Int<0>{}, cute::Int<4>{},
                              [&](int j, int hh) { return acc_pair(4 * m + j, hh); },
                              [&](int j, int hh) { return acc_pair(16 + 4 * m + j, hh); },
                              [&](int j, int hh, uint32_t w) { hw[j][hh] = w; });
                store_group(slot, m, [&](int j, int hh) { return hw[j][hh]; });
              }
#pragma unroll
              for (int g = 0; g < kL1DeferredGroups; ++g)
#pragma unroll
                for (int j = 0; j < 4; ++j)
#pragma unroll
                  for (int hh = 0; hh < 2; ++hh) {
                    const int i = 4 * (kFirstDeferredL1Group + g) + j;
                    pend[16 * g + 2 * j + hh] = acc_pair(i, hh);
                    pend[16 * g + 8 + 2 * j + hh] = acc_pair(16 + i, hh);
                  }
            }
          }
          if constexpr (kDeferL2Epilogue) {
            if (!l1_tile) {
#pragma unroll
              for (int m = 0; m < kFirstDeferredGroup; ++m)
                store_group(slot, m, [&](int j, int hh) { return acc_pair(4 * m + j, hh); });
#pragma unroll
              for (int g = 0; g < kL2DeferParts; ++g)
#pragma unroll
                for (int j = 0; j < 4; ++j)
#pragma unroll
                  for (int hh = 0; hh < 2; ++hh)
                    pend[8 * g + 2 * j + hh] = acc_pair(4 * (kFirstDeferredGroup + g) + j, hh);
            }
          }
          pend_slot = slot;
          pend_l1 = l1_tile;
          const uint32_t epi_cycles = profile::clock32() - epilogue_clk;
          prof.count(profile::kWgEpilogue, epi_cycles);
          prof.count(profile::kWgEpiDeferred, epi_cycles);
          prof.count(profile::kWgDeferredTiles, 1);
          continue;
        }
      }

      // Warpgroup wg stages into stage s_w (0: the tile's last, 1: the one before), once both
      // warpgroups are done reading the tile's stages.
      const int s_w = (it - 1 - wg) % kStages;
      const uint32_t slot_base[3] = {detail::smem_u32(ss.b[s_w]),
                                     detail::smem_u32(ss.b[s_w]) + kSlotBytes,
                                     detail::smem_u32(ss.a[s_w])};
      detail::named_barrier_sync(kBothWgBarrier, kMathThreads);
      prof.since(profile::kWgEpiBothWg, epilogue_clk);
      uint32_t part_clk = profile::clock32();

      // Fragment -> staging slot: v(ii, hh) is this thread's packed bf16x2 of slot columns
      // 8 ii + 2 (lane % 4) + {0, 1}, row (lane / 4) + 8 hh of its 16-row slice; accumulator
      // column c <-> acc[4 (c / 8) + 2 hh + (c % 2)].
      auto put = [&](int sl, auto&& v) {
        const uint32_t base = slot_base[sl] + frag_off;
#pragma unroll
        for (int ii = 0; ii < 16; ++ii) {
#pragma unroll
          for (int hh = 0; hh < 2; ++hh)
            detail::st_shared_b32(base + hh * 8 * kSlotRowBytes + ((uint32_t(ii) ^ frag_sw) << 4),
                                  v(ii, hh));
        }
      };
      // The same fragments into a TMA-layout slot (L1's gate and up): tma_slot_offset(row, ii)
      // spelled out with row % 8 = lane / 4 (as frag_off does for put).
      auto put_tma = [&](int sl, auto&& v) {
        const uint32_t base = slot_base[sl] + frag_off_tma;
#pragma unroll
        for (int ii = 0; ii < 16; ++ii) {
#pragma unroll
          for (int hh = 0; hh < 2; ++hh)
            detail::st_shared_b32(base + uint32_t(ii >> 3) * kTmaHalfBytes + hh * 8 * 128 +
                                      ((uint32_t(ii & 7) ^ frag_sw) << 4),
                                  v(ii, hh));
        }
      };
      if (nslots > 0) {
        if (l1) {
          if (!kFp8 && p.l1_raw_gate) {  // (FP8: below, the gate quantised as h)
            put(0, [&](int ii, int hh) { return acc_pair(ii, hh); });
          } else {
            uint32_t hv[32];
            if (kFp8 && p.l1_raw_gate) {  // benchmark only: the gate as h, no SwiGLU math
#pragma unroll
              for (int ii = 0; ii < 16; ++ii)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) hv[2 * ii + hh] = acc_pair(ii, hh);
            } else {
              swiglu_blocks(cute::Int<0>{}, cute::Int<16>{},
                            [&](int ii, int hh) { return acc_pair(ii, hh); },
                            [&](int ii, int hh) { return acc_pair(ii + 16, hh); },
                            [&](int ii, int hh, uint32_t w) { hv[2 * ii + hh] = w; });
            }
            if constexpr (kFp8) {
              if (p.gate_up != nullptr) {  // residual gate_up, staged beside h (slots 1, 2)
                put_tma(1, [&](int ii, int hh) { return acc_pair(ii, hh); });
                put_tma(2, [&](int ii, int hh) { return acc_pair(ii + 16, hh); });
              }
              epilogue_h_fp8(ss, p, job, hv, slot_base, s_w, wg, warp_in_wg, lane, t);
              prof.since(profile::kWgEpilogue, epilogue_clk);
              Barrier::arrive(&ss.stored[slot]);
              continue;
            }
            put(0, [&](int ii, int hh) { return hv[2 * ii + hh]; });
          }
          if (nslots == 3) {  // gate_up's slots are read by TMA: generic writes -> async proxy
            put_tma(1, [&](int ii, int hh) { return acc_pair(ii, hh); });
            put_tma(2, [&](int ii, int hh) { return acc_pair(ii + 16, hh); });
            cutlass::arch::fence_view_async_shared();
          }
        } else if (l2_tma) {  // read by TMA: generic writes -> async proxy
          put_tma(0, [&](int ii, int hh) { return acc_pair(ii, hh); });
          put_tma(1, [&](int ii, int hh) { return acc_pair(ii + 16, hh); });
          cutlass::arch::fence_view_async_shared();
        } else {
          put(0, [&](int ii, int hh) { return acc_pair(ii, hh); });
          put(1, [&](int ii, int hh) { return acc_pair(ii + 16, hh); });
        }
        detail::named_barrier_sync(kFirstWgBarrier + wg, 128);
      }
      prof.since(profile::kWgEpiStage, part_clk);
      part_clk = profile::clock32();
      // Each row of a slot is 256 contiguous bytes of the destination row: 16 lanes per row,
      // 2 rows per warp instruction. Slot by slot (h; L2's two column halves): a thread's 8
      // vectors of the slot read and stored, then the stage handed back to the producer (the
      // proxy fence orders the generic reads before the TMA refill). L1's gate and up
      // (residuals) go first, by TMA (store_gate_up).
      // Reading both of L2's slots into registers first, so that the fence had no stores to
      // wait for, spilled them to local memory (64 registers; 104 B of bf16 stack, 352 B of
      // FP8; the spills go to L2, the smem carve-out leaving little L1): slot by slot measured
      // faster on both cores at 30B: bf16 L1+L2 2.104 vs 2.217 ms, FP8 L2 0.683 vs 0.908 ms
      // (benchmarks/RESULTS.md, session 9).
      // Destination of (staging slot sl, row k of this thread), or null.
      auto dest = [&](int sl, int k) -> __nv_bfloat16* {
        const int r = 64 * wg + rd_row0 + 8 * k;
        __nv_bfloat16* d = ss.row_dst[slot][r];
        if (d == nullptr) return nullptr;
        return d + (l1 ? 0 : sl * 128) + rd_chunk * 8;
      };
      const int read_slots = p.bench_skip_epilogue == 3 ? 0 : nslots;
      const bool gate_up_tma =
          l1 && read_slots == 3 && store_gate_up(ss, p, job, slot_base, s_w, wg, t);
      const bool l2_rows_tma =
          l2_tma && read_slots > 0 && p.bench_skip_epilogue != 2 &&
          store_slots_tma(p.l2_rows_map, p.l2_rows, p.l2_rows_ld,
                          {ss.b[s_w], ss.b[s_w] + kSlotBytes}, {slot_base[0], slot_base[1]},
                          {job.n_block * kBlockN, job.n_block * kBlockN + 128}, job, wg, t);
      if (read_slots > 0 && !dh_tile && !l2_tma) {
        // The rows' destinations (the signaller's); uses_row_dst must agree with this path.
        if (!uses_row_dst(p, job)) __trap();
        Barrier::wait(&ss.dst_ready[slot], job_phase);
      }
      prof.since(profile::kWgEpiDst, part_clk);
      part_clk = profile::clock32();
      if constexpr (kDgrad) {
        if (dh_tile)
          epilogue_swiglu_backward(p, job, slot_base, read_slots, wg, rd_row0, rd_chunk, rd_off);
      }
      const int generic_slots = dh_tile || l2_tma ? 0 : l1 ? (read_slots > 0 ? 1 : 0) : read_slots;
      // (dh tiles: above; gate_up: store_gate_up; L2 by TMA: store_slots_tma)
      for (int sl = 0; sl < generic_slots; ++sl) {
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const uint4 val = detail::ld_shared_v4(slot_base[sl] + rd_off + k * 8 * kSlotRowBytes);
          __nv_bfloat16* d = p.bench_skip_epilogue == 2 ? nullptr : dest(sl, k);
          if (d == nullptr) continue;
          detail::st_global_v4(d, val);
          // L2's second store (the fused forward's copy; kDgrad: the dh tiles' check copy only)
          if (!l1 && !kDgrad && p.l2_copy != nullptr) {
            const int r = 64 * wg + rd_row0 + 8 * k;
            detail::st_global_v4(p.l2_copy + int64_t(job.row_begin + r) * p.l2_copy_ld +
                                     job.n_block * kBlockN + sl * 128 + rd_chunk * 8,
                                 val);
          }
        }
      }
      prof.since(profile::kWgEpiStore, part_clk);
      cutlass::arch::fence_view_async_shared();
      if (gate_up_tma || l2_rows_tma) cute::tma_store_wait<0>();  // TMA has read the slots
      __syncwarp();
      if (lane == 0) release_stage(ss, s_w, 2);  // 4 warps x 2 = 8
      prof.since(profile::kWgEpilogue, epilogue_clk);
      Barrier::arrive(&ss.stored[slot]);
    }
    // The TMA stores complete before the kernel's blocks may exit; L2's rows (read by the
    // caller's later phases, e.g. the fused kernel's combine) are then made visible to generic
    // reads as well.
    if ((p.gate_up != nullptr || p.l2_rows != nullptr) && t == 0) {
      detail::bulk_store_wait_all();
      if (p.l2_rows != nullptr) detail::fence_proxy_async_global();
    }
    prof.set(profile::kWgEndClk, profile::clock32());
    if (t == 0) prof.flush(wg == 0 ? profile::kWg0 : profile::kWg1,
                           wg == 0 ? profile::kWg0EndNs : profile::kWg1EndNs);
  }

  // A math warp hands stage s back (bf16 path): `count` arrivals on this CTA's empty[s] and,
  // with kClusterM = 2, on the peer's (its producer multicasts into this CTA's stage too).
  __device__ static void release_stage(SharedStorage& ss, int s, uint32_t count) {
    if (kClusterM == 1 && count == 1)
      Barrier::arrive(&ss.empty[s]);  // the instruction the engine always used
    else
      detail::mbar_arrive_cnt(&ss.empty[s], count);
    if constexpr (kClusterM == 2)
      detail::mbar_arrive_cnt_cluster(&ss.empty[s], cute::block_rank_in_cluster() ^ 1u, count);
  }

  // ---------------------------------------------------------------- signaller (one warp)
  template <class Params, class Hooks>
  __device__ static void signaller(SharedStorage& ss, const Params& p, const Hooks& hooks) {
    const int lane = threadIdx.x & 31;
    uint32_t jn = 0;
    while (true) {
      const int slot = jn % kJobSlots;
      const uint32_t phase = (jn / kJobSlots) & 1;
      Barrier::wait(&ss.job_full[slot], phase);
      detail::compiler_barrier();  // the wait's asm has no memory clobber: read the job after it
      const ExpertTile job = ss.jobs[slot];
      __syncwarp();
      ++jn;
      if (job.kind >= 0) {
        // The rows' destinations while the consumers run the tile's mainloop: a row functor
        // may load from global memory, and done by the consumers at the tile's start that
        // load delayed its first wgmma (FUSED_CORE_NOTES, session 17).
        if (uses_row_dst(p, job)) {
          // Two rows in flight per lane: the fused forward's producer warpgroup has 56
          // registers (all four unrolled spilled more there).
#pragma unroll 2
          for (int i = 0; i < kBlockM / 32; ++i) {
            const int r = lane + 32 * i;
            ss.row_dst[slot][r] = r < job.rows ? row_destination(p, job, r) : nullptr;
          }
        }
        __syncwarp();  // every lane's row_dst before lane 0's release of dst_ready
        if (lane == 0) Barrier::arrive(&ss.dst_ready[slot]);
        Barrier::wait(&ss.stored[slot], phase);
        if (lane == 0) {
          detail::store_fence<Hooks::kStoreFence>();
          hooks.tile_done(job);
        }
        __syncwarp();
      }
      // The slot is free once its tile is signalled (see stored[] above).
      if (lane == 0) Barrier::arrive(&ss.job_empty[slot]);
      if (job.kind < 0) break;
    }
  }

  // ---------------------------------------------------------------- the roles of a CTA
  // Convenience dispatch for a kernel that uses exactly this engine's 384 threads (the
  // standalone harness does). A fused kernel may call producer / signaller / math itself from
  // its own role branches (it must keep warps 4..11 as the two consumer warpgroups, give them
  // kMathRegs with setmaxnreg, leave named barriers 1..3 to them, and call init() + a CTA
  // barrier first).
  template <class Params, class Scheduler, class Hooks>
  __device__ static void run_roles(SharedStorage& ss, const Params& p, Scheduler& sched,
                                   const Hooks& hooks) {
    const int warp = threadIdx.x / 32;
    if (threadIdx.x == 0) profile::cta_begin();
    if (warp < kFirstMathWarp) {
      cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
      if (warp == kProducerWarp) producer(ss, p, sched, hooks);
      else if (warp == kSignallerWarp) signaller(ss, p, hooks);
    } else {
      cutlass::arch::warpgroup_reg_alloc<kMathRegs>();
      math(ss, p);
    }
  }
};

}  // namespace megamoe::fused::sm90

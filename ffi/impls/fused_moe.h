// Host interface of the fused MoE kernel (ffi/impls/sm90_fused_moe.cu): one persistent sm_90a
// kernel per call that routes, dispatches token rows over NVLink into the expert ranks' pools,
// runs L1 + SwiGLU and L2 on the tile engine and combines the results at the sources; its
// backward pass (LaunchFusedBackward) does the same with w * dy rows and the dgrad GEMMs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "ffi/comm/symmetric_memory.h"

namespace megamoe::fused {

// One rank's operands: a GPU of a real EP group, or one rank of a virtual group. FP8
// (FusedForwardProblem::fp8, recipes "fp8" / "fp8_pow2"; ffi/layout/fp8_blocks.h): the rows and
// weights are e4m3 with fp32 block scales, quantised by the caller (cuda_fp8's quantisers).
struct FusedRankOperands {
  const ep::PeerView* view;
  const void* x;           // [T, H] bf16 tokens of this rank (FP8: e4m3)
  const float* x_scale;    // FP8: [T, H/128] x's 1 x 128 scales (else nullptr)
  const int32_t* ids;      // [T, k] global expert ids, -1 masks a slot
  const float* weights;    // [T, k] routing weights
  const void* w_gate_up;   // [E/R, H, 2F] bf16, this rank's experts (FP8: e4m3 [E/R, 2F, H])
  const float* w_gate_up_scale;  // FP8: [E/R, H/128, 2F/128]
  const void* w_down;      // [E/R, F, H] bf16 (FP8: e4m3 [E/R, H, F])
  const float* w_down_scale;     // FP8: [E/R, F/128, H/128]
  void* y;                 // [T, H] bf16 result
  void* h;                 // [n_cap, F] bf16 scratch: L1's output, L2's A (FP8: e4m3)
  float* h_scale;          // FP8: [F/128, FusedScalePitch(n_cap)] h's 1 x 128 scales (scratch)
  int32_t* scratch;        // [FusedScratchInts(T, E, k)]: the routing's chunk counts, then the
                           // copy plan (4 ints per slot, in copy order)
  int32_t* slot_rows;      // [T, k] scratch: each slot's row in this rank's comb (-1: none)
  int32_t* slot_dest;      // [T, k] scratch: each slot's row in its expert rank's pool (-1)
  int32_t* group_sizes;    // [E/R]: pool rows of each local expert (after capacity)
  // Residuals for the backward (nullptr: not kept), rows in pool order (slot (t, j)'s row is
  // slot_dest[t, j] at one rank): gate_up, L1's output before SwiGLU; y_sorted, L2's output
  // rows (one rank: they replace the comb region, whose rows are the pool's there; several: a
  // second store in L2's epilogue); x_sorted, the pool rows (bf16 with one rank alone: they
  // replace the pool region; otherwise the kernel copies the pool out after every source's rows
  // landed; FP8: e4m3 rows and their scales x_sorted_scale).
  void* x_sorted;          // [n_cap, H] bf16 (FP8: e4m3)
  float* x_sorted_scale;   // FP8: [n_cap, H/128] x_sorted's 1 x 128 scales (else nullptr)
  void* gate_up;           // [n_cap, 2F] bf16
  void* y_sorted;          // [n_cap, H] bf16
  void* y_comb;            // [T * k, H] bf16: several ranks, this rank's comb rows (L2's rows of
                           // its slots, in comb order: slot (t, j)'s row is slot_rows[t, j]),
                           // copied out after the combine (one rank alone: y_sorted is that)
  int32_t* stats;          // [4]: rows routed here, n_cap, overflow (0/1), repeated expert ids
  int32_t* phases;         // [kFusedPhases]: ns from the start to each phase's end (CTA 0)
};

// The phases whose end the kernel stamps (the breakdown of benchmarks/fused_phases.py): start,
// route, counts exchanged, slot positions and copy plan, the plan's head copied (before the
// GEMMs), the rest copied (by CTA 0's first copy warp, beside the GEMMs), every GEMM tile of
// the rank done, every expert rank's results here, CTA 0's combine done.
constexpr int kFusedPhases = 9;

struct FusedForwardProblem {
  int num_tokens;   // T per rank
  int hidden;       // H, a multiple of 256
  int ffn;          // F, a multiple of 128
  int top_k;        // k <= 32
  int num_experts;  // E (global) <= ep::kFusedMaxExperts, a multiple of R
  int n_cap;        // pool rows per rank (<= the workspace's fused_rows)
  int max_ctas;     // CTAs of the launch: > 0 at most that many, <= 0 every SM but -max_ctas
  int fp8;          // 1: recipe "fp8" / "fp8_pow2" (e4m3 operands), 0: bf16
  int pow2;         // FP8: power-of-two scales for h (recipe "fp8_pow2")
  int debug = 0;    // kFusedDebug* bits (MEGAMOE_FUSED_DEBUG, read by the handler); 0 normally
};

// Debug knob (environment variable MEGAMOE_FUSED_DEBUG, an integer of these bits, read by the
// handler at every call; 0 or unset: the normal kernel). Fault localisation only: with bits
// 1 / 2 / 4 the results are wrong by construction (y is not the layer's), the kernel still
// runs every other phase and never waits on work it skipped.
constexpr int kFusedDebugNoL2 = 1;       // compute no L2 tile (L1 still runs and stores h)
constexpr int kFusedDebugNoGemm = 2;     // compute no GEMM tile at all (route, dispatch, combine)
constexpr int kFusedDebugNoGateUp = 4;   // store no gate_up residual (the epilogue without it)
constexpr int kFusedDebugSync = 8;       // synchronise the stream after the launch and report a
                                         // kernel fault as this call's error (needs XLA command
                                         // buffers off: --xla_gpu_enable_command_buffer=)
constexpr int kFusedDebugUnalignedScales = 16;  // FP8: A-scale TMA boxes start at the tile's
                                                // first row itself (the first build's unaligned
                                                // start) instead of at it rounded down to 16 B
constexpr int kFusedDebugAllBits =            // every bit above (the override's upper bound)
    kFusedDebugNoL2 | kFusedDebugNoGemm | kFusedDebugNoGateUp | kFusedDebugSync |
    kFusedDebugUnalignedScales;

// Rows of a K-block-major scale matrix [K/128, pitch] over `rows` rows (FP8: the pool's and h's
// scales; a multiple of 128 rows, which keeps TMA's 16-byte row stride).
constexpr int64_t FusedScalePitch(int64_t rows) { return (rows + 127) / 128 * 128; }

// Why this problem cannot run on the fused kernel ("" when it can).
std::string FusedForwardUnsupported(const FusedForwardProblem& p, const ep::WorkspaceLayout& l,
                                    int num_ranks);

// The int32 scratch of one rank: slots per expert per 32-token chunk ([E, ceil(T / 32)]), then,
// 16-byte aligned, the copy plan ([T * k] x 4 ints: which token row goes to which pool row).
int64_t FusedScratchInts(int64_t num_tokens, int64_t num_experts, int64_t top_k);

// Launches the kernel for `count` local ranks (rank `absent` of a virtual group is left out:
// tests of the timeout path), for a problem FusedForwardUnsupported accepts (the handler checks
// it). "" on success, else what failed.
std::string LaunchFusedForward(const FusedRankOperands* ranks, int count, int absent,
                               const FusedForwardProblem& problem, cudaStream_t stream);

// The backward's pass (bf16; benchmarks/kernels/FUSED_BACKWARD_PLAN.md, step 3): the same
// kernel's phases with the dgrad engine. One rank's operands; rows in pool order are the
// forward's (the routing runs again on the same ids and gives the same pool rows).
struct FusedBackwardRankOperands {
  const ep::PeerView* view;
  const void* dy;          // [T, H] bf16, d loss / d y of this rank's tokens
  const int32_t* ids;      // [T, k] the forward's ids
  const float* weights;    // [T, k] the forward's routing weights
  const void* y_comb;      // the forward's y rows in this rank's comb order, [T * k, H] bf16
                           // (one rank alone: its y_sorted, whose order is the comb's there)
  const void* gate_up;     // [n_cap, 2F] bf16 the forward's residual (expert side)
  const void* w_gate_up;   // [E/R, H, 2F] bf16, this rank's experts (read K-major)
  const void* w_down;      // [E/R, F, H] bf16 (read K-major)
  void* dx;                // [T, H] bf16: the sum over each token's slots of their dx rows
  float* d_weights;        // [T, k] fp32: <dy[t], y of slot (t, j)>, 0 for slots not routed
  void* dy_sorted;         // [n_cap, H] bf16: w * dy rows in pool order (the wgrads' operand;
                           // one rank alone it is the pool, otherwise the kernel copies it out)
  void* dgate_up;          // [n_cap, 2F] bf16: the SwiGLU backward's output (L1 dgrad's A)
  int32_t* scratch;        // [FusedScratchInts(T, E, k)], as the forward's
  int32_t* slot_rows;      // [T, k] scratch, as the forward's
  int32_t* slot_dest;      // [T, k] scratch, as the forward's
  int32_t* group_sizes;    // [E/R] (equal to the forward's)
  int32_t* stats;          // [4] as the forward's
  int32_t* phases;         // [kFusedPhases]
};

// Launches the backward's pass for a bf16 problem (fp8 = 0) that FusedForwardUnsupported accepts
// and whose hidden and ffn are multiples of 256 (the dgrad tiles); "" on success.
std::string LaunchFusedBackward(const FusedBackwardRankOperands* ranks, int count, int absent,
                                const FusedForwardProblem& problem, cudaStream_t stream);

// Copies the tile engine's cycle accounting of the last fused kernel on this device
// (ffi/gemm/engine_profile_layout.h: kMaxCtas x kSlots uint64) into `dst`, `bytes` long, on
// `stream`. Only an extension built with JAX_MEGAMOE_ENGINE_PROFILE=ON keeps it; otherwise
// returns what to do instead. "" on success.
std::string ReadFusedEngineProfile(void* dst, size_t bytes, cudaStream_t stream);

}  // namespace megamoe::fused

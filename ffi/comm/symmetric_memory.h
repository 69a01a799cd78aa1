// Symmetric workspace for expert-parallel communication: one allocation per GPU of an EP group,
// identical layout on every rank, mapped on every peer (peer access within a process, CUDA IPC
// across processes). Kernels receive a PeerView by value: {base of every rank as mapped here,
// rank, layout}.
//
// Layout of one rank's workspace (byte offsets identical on every rank, 256-byte aligned):
//   signals   SignalArea: monotonic uint64 counters (device-resident epochs, see peer_signal.cuh)
//   meta_ids  int32 [R][max_tokens][top_k]   dispatch-shaped traffic: local expert id or -1
//   meta_w    f32   [R][max_tokens][top_k]   dispatch-shaped traffic: routing weight
//   pool_d    elem  [R][max_tokens][hidden]  dispatch-shaped rows, slot (source rank, token)
//   meta_c    f32   [R][max_tokens][top_k]   combine-shaped traffic: per-slot scalars
//   pool_c    elem  [R][max_tokens][hidden]  combine-shaped rows, slot (expert rank, token)
// Source rank s writes its token t into slot (s, t) of the receiver, so the pools can never
// overflow: each token travels at most once per destination rank.
// With fused_rows > 0, the regions of the fused kernel (ffi/impls/sm90_fused_moe.cu) follow:
//   fsig      FusedSignals: its epoch, flags, the rank group's grid barrier
//   fcounts   int32 [2][kMaxRanks][kFusedMaxExperts]   routing counts of every source (parity)
//   ftiles    uint64 [FusedMBlocks]    rows arrived per M-block of the pool (added by sources)
//   fl1done   uint64 [FusedMBlocks]    L1 tiles done per M-block (this rank's CTAs)
//   fpool     elem  [fused_rows][hidden]           rows in expert order (the L1 GEMM's A)
//   fcomb     elem  [max_tokens * top_k][hidden]   expert outputs of this rank's slots, in the
//                                                  rank's own expert-sorted slot order
// Python mirrors this arithmetic in jax_megamoe/symmetric.py (workspace_layout); keep the two in
// step.
#pragma once

#include <cstdint>

#include "ffi/common/align.h"

namespace megamoe::ep {

constexpr int kMaxRanks = 8;

// Two traffic regions, each with its own pool and counters. Every use of a region is
// send -> arrive -> read -> release, and every rank uses the regions in the same order (SPMD).
enum Region : int { kRegionDispatch = 0, kRegionCombine = 1, kNumRegions = 2 };

struct alignas(128) SignalArea {
  // Completed uses of each region on this rank (written only by this rank's release kernel).
  unsigned long long uses[kNumRegions];
  unsigned long long pad0[16 - kNumRegions];
  // arrive[region][s]: blocks of source rank s that finished writing into this rank (monotonic).
  unsigned long long arrive[kNumRegions][kMaxRanks];
  // consumed[region][r]: times receiver rank r released what this rank wrote to it (monotonic).
  unsigned long long consumed[kNumRegions][kMaxRanks];
  // Elects the one block that records an error for this rank.
  unsigned int error_claim;
  unsigned int pad1[31];
};

// The fused kernel's signals: its own epoch and flags (the separate kernels' SignalArea is not
// touched by it), plus the barrier of this rank's CTAs.
struct alignas(128) FusedSignals {
  unsigned long long uses;  // completed fused calls on this rank (its epoch e)
  unsigned long long pad0[15];
  // counts_ready[s] = e + 1: source s's routing counts of call e are in fcounts, and s has
  // zeroed its own arrival counters for call e (so rows for call e may be sent to it).
  unsigned long long counts_ready[kMaxRanks];
  unsigned long long pad1[16 - kMaxRanks];
  // results_ready[q] = e + 1: expert rank q stored every result of call e for this rank.
  unsigned long long results_ready[kMaxRanks];
  unsigned long long pad2[16 - kMaxRanks];
  unsigned int barrier_count, barrier_generation;  // this rank's grid barrier
  unsigned int pad3[30];
};

constexpr int64_t kFusedMaxExperts = 1024;  // global experts the fused kernel takes
constexpr int64_t kFusedBlockM = 128;       // rows of a pool M-block (the GEMM tile's M)

// M-blocks of the fused pool: every expert's rows padded to whole blocks.
inline constexpr int64_t FusedMBlocks(int64_t fused_rows) {
  return fused_rows == 0 ? 0 : (fused_rows + kFusedBlockM - 1) / kFusedBlockM + kFusedMaxExperts;
}

struct WorkspaceLayout {
  int64_t num_ranks = 0, max_tokens = 0, hidden = 0, top_k = 0, elem_bytes = 0;
  int64_t fused_rows = 0;
  int64_t signals = 0, meta_ids = 0, meta_w = 0, pool_d = 0, meta_c = 0, pool_c = 0;
  int64_t fsig = 0, fcounts = 0, ftiles = 0, fl1done = 0, fpool = 0, fcomb = 0;
  int64_t total_bytes = 0;
};

inline WorkspaceLayout MakeWorkspaceLayout(int64_t num_ranks, int64_t max_tokens, int64_t hidden,
                                           int64_t top_k, int64_t elem_bytes,
                                           int64_t fused_rows = 0) {
  WorkspaceLayout l;
  l.num_ranks = num_ranks;
  l.max_tokens = max_tokens;
  l.hidden = hidden;
  l.top_k = top_k;
  l.elem_bytes = elem_bytes;
  l.fused_rows = fused_rows;
  const int64_t slots = num_ranks * max_tokens;
  int64_t off = 0;
  l.signals = off;
  off = AlignUp(off + static_cast<int64_t>(sizeof(SignalArea)), 256);
  l.meta_ids = off;
  off = AlignUp(off + slots * top_k * 4, 256);
  l.meta_w = off;
  off = AlignUp(off + slots * top_k * 4, 256);
  l.pool_d = off;
  off = AlignUp(off + slots * hidden * elem_bytes, 256);
  l.meta_c = off;
  off = AlignUp(off + slots * top_k * 4, 256);
  l.pool_c = off;
  off = AlignUp(off + slots * hidden * elem_bytes, 256);
  const bool fused = fused_rows > 0;
  const int64_t mblocks = FusedMBlocks(fused_rows);
  l.fsig = off;
  off = AlignUp(off + (fused ? static_cast<int64_t>(sizeof(FusedSignals)) : 0), 256);
  l.fcounts = off;
  off = AlignUp(off + (fused ? 2 * kMaxRanks * kFusedMaxExperts * 4 : 0), 256);
  l.ftiles = off;
  off = AlignUp(off + mblocks * 8, 256);
  l.fl1done = off;
  off = AlignUp(off + mblocks * 8, 256);
  l.fpool = off;
  off = AlignUp(off + fused_rows * hidden * elem_bytes, 256);
  l.fcomb = off;
  off = AlignUp(off + (fused ? max_tokens * top_k * hidden * elem_bytes : 0), 256);
  l.total_bytes = off;
  return l;
}

// What a failed wait leaves behind, in host-mapped memory (readable by the host without a sync).
struct ErrorRecord {
  int code;   // 0: none, 1: timeout waiting for a peer
  int rank;   // rank that timed out
  int stage;  // Stage code (workspace_ops.h)
  int peer;   // rank waited on
  unsigned long long value;     // counter value seen last
  unsigned long long expected;  // value waited for
  long long waited_ns;
  int index;  // which counter of the stage (the fused kernel's pool M-block), -1 when one
  int pad;
};

// Everything a kernel needs to reach its group's workspaces. Passed by value.
struct PeerView {
  char* base[kMaxRanks];   // base[r]: rank r's workspace as mapped on this device
  int rank = 0;
  int num_ranks = 0;
  int comm_blocks = 0;     // blocks of every send kernel (fixed per workspace: arrival counts)
  int pad = 0;
  long long timeout_ns = 0;
  ErrorRecord* error = nullptr;       // this rank's record (host-mapped; device pointer)
  ErrorRecord* error_host = nullptr;  // the same record, host pointer
  WorkspaceLayout layout;

#ifdef __CUDACC__
  __host__ __device__
#endif
  SignalArea* signals(int r) const {
    return reinterpret_cast<SignalArea*>(base[r] + layout.signals);
  }

  // Rank r's fused-kernel signals (a workspace with fused regions).
#ifdef __CUDACC__
  __host__ __device__
#endif
  FusedSignals* fused_signals(int r) const {
    return reinterpret_cast<FusedSignals*>(base[r] + layout.fsig);
  }
};

}  // namespace megamoe::ep

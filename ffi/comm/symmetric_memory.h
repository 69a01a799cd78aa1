// Symmetric workspace for expert-parallel communication: one allocation per GPU of an EP group,
// identical layout on every rank, mapped on every peer (peer access within a process, CUDA IPC
// across processes). Kernels receive a PeerView by value: {base of every rank as mapped here,
// rank, layout}.
//
// Layout of one rank's workspace (byte offsets identical on every rank, 256-byte aligned):
//   signals   SignalArea: monotonic uint64 counters (device-resident epochs, see peer_signal.h)
//   meta_ids  int32 [R][max_tokens][top_k]   dispatch-shaped traffic: local expert id or -1
//   meta_w    f32   [R][max_tokens][top_k]   dispatch-shaped traffic: routing weight
//   pool_d    elem  [R][max_tokens][hidden]  dispatch-shaped rows, slot (source rank, token)
//   meta_c    f32   [R][max_tokens][top_k]   combine-shaped traffic: per-slot scalars
//   pool_c    elem  [R][max_tokens][hidden]  combine-shaped rows, slot (expert rank, token)
// Source rank s writes its token t into slot (s, t) of the receiver, so the pools can never
// overflow: each token travels at most once per destination rank. Python mirrors this arithmetic
// in jax_megamoe/symmetric.py (workspace_bytes); keep the two in step.
#pragma once

#include <cstdint>
#include <string>

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

struct WorkspaceLayout {
  int64_t num_ranks = 0, max_tokens = 0, hidden = 0, top_k = 0, elem_bytes = 0;
  int64_t signals = 0, meta_ids = 0, meta_w = 0, pool_d = 0, meta_c = 0, pool_c = 0;
  int64_t total_bytes = 0;
};

inline WorkspaceLayout MakeWorkspaceLayout(int64_t num_ranks, int64_t max_tokens, int64_t hidden,
                                           int64_t top_k, int64_t elem_bytes) {
  WorkspaceLayout l;
  l.num_ranks = num_ranks;
  l.max_tokens = max_tokens;
  l.hidden = hidden;
  l.top_k = top_k;
  l.elem_bytes = elem_bytes;
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
  l.total_bytes = off;
  return l;
}

// What a failed wait leaves behind, in host-mapped memory (readable by the host without a sync).
struct ErrorRecord {
  int code;   // 0: none, 1: timeout waiting for a peer
  int rank;   // rank that timed out
  int stage;  // Stage code (peer_signal.h)
  int peer;   // rank waited on
  unsigned long long value;     // counter value seen last
  unsigned long long expected;  // value waited for
  long long waited_ns;
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
};

// The ranks of a workspace that one EP custom call runs on this device, in rank order: one view
// (a GPU of a real EP group), or all R views of a virtual group (R workspaces on one GPU, each
// rank's peer bases pointing at the others': EP at any R with a single GPU, for tests). A call
// on a virtual group takes operands with a leading axis of one entry per rank.
struct LocalRanks {
  const PeerView* views[kMaxRanks] = {};
  int count = 0;
  bool stacked = false;  // a virtual group: operands carry the leading rank axis (even for R=1)
  int absent = -1;       // virtual groups only: a rank whose kernels are never launched (tests)
};

// Host-side registry (ffi/comm/workspace_registry.cu): the local ranks of workspace
// `workspace_id` on `device_ordinal`; false with `message` saying why when there are none.
// Thread-safe; the views stay valid until the workspace is destroyed.
bool FindLocalRanks(int64_t workspace_id, int device_ordinal, LocalRanks* out,
                    std::string* message);

// Human-readable report of the error recorded for this view's rank, or "" when there is none.
std::string DescribeError(const PeerView& view);

}  // namespace megamoe::ep

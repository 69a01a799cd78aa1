// The host-side registry of symmetric workspaces (comm/workspace_registry.cu, which also holds
// the C ABI Python drives them through): how a handler finds its device's PeerView.
#pragma once

#include <cstdint>
#include <string>

#include "ffi/comm/symmetric_memory.h"

namespace megamoe::ep {

// The ranks of a workspace that one EP custom call runs on this device, in rank order: one view
// (a GPU of a real EP group), or all R views of a virtual group (R workspaces on one GPU, each
// rank's peer bases pointing at the others': EP at any R with a single GPU, for tests). A call
// on a virtual group takes operands with a leading axis of one entry per rank.
struct LocalRanks {
  const PeerView* views[kMaxRanks] = {};
  int count = 0;
  bool stacked = false;  // a virtual group: operands carry the leading rank axis (even for R=1)
  int absent = -1;       // virtual groups only: a rank whose kernels are never launched (tests)
  int cuda_device = -1;  // the CUDA device the shares live on, where their kernels must run
};

// The local ranks of workspace `workspace_id` on `device_ordinal`; false with `message` saying
// why when there are none. Thread-safe; the views stay valid until the workspace is destroyed.
bool FindLocalRanks(int64_t workspace_id, int device_ordinal, LocalRanks* out,
                    std::string* message);

// Human-readable report of the error recorded for this view's rank, or "" when there is none.
std::string DescribeError(const PeerView& view);

}  // namespace megamoe::ep

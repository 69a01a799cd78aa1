// The host-side registry of symmetric workspaces (comm/workspace_registry.cu, which also holds
// the C ABI Python drives them through): how a handler finds its device's PeerView.
#pragma once

#include <cstdint>
#include <string>

#include "ffi/comm/symmetric_memory.h"

namespace megamoe::ep {

// The view for (workspace id, device ordinal), or nullptr; `message` says why when it fails.
// Thread-safe; the pointer stays valid until the workspace is destroyed.
const PeerView* FindPeerView(int64_t workspace_id, int device_ordinal, std::string* message);

// Human-readable report of the error recorded for this view's rank, or "" when there is none.
std::string DescribeError(const PeerView& view);

}  // namespace megamoe::ep

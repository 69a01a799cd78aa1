// The operations that signal through a symmetric workspace, as a wait's stage code names them
// when it times out (comm/peer_signal.cuh records the code, the workspace registry describes it).
// stage = op * 2 + wait kind. A new kernel that signals through the workspace (a fused one) adds
// its op here.
#pragma once

#include "ffi/common/host_device.h"

namespace megamoe::ep {

enum Op : int { kOpDispatchFwd = 0, kOpDispatchBwd = 1, kOpCombineFwd = 2, kOpCombineBwd = 3 };

// What the wait was for: a receiver releasing this rank's previous data, or a source's blocks
// arriving (the two waits of the protocol in peer_signal.cuh).
enum WaitKind : int { kWaitConsumed = 0, kWaitArrive = 1 };

MEGAMOE_HOST_DEVICE inline constexpr int Stage(int op, int wait_kind) {
  return op * 2 + wait_kind;
}

// For the host's report (DescribeError).
inline const char* OpName(int op) {
  switch (op) {
    case kOpDispatchFwd: return "dispatch (forward)";
    case kOpDispatchBwd: return "dispatch backward (combine-shaped)";
    case kOpCombineFwd: return "combine (forward)";
    case kOpCombineBwd: return "combine backward (dispatch-shaped)";
    default: return "?";
  }
}
inline const char* WaitName(int wait_kind) {
  return wait_kind == kWaitConsumed
             ? "send: waiting for the peer to release this rank's previous data (consumed)"
             : "receive: waiting for the peer's blocks to arrive (arrive)";
}

// For the device's printf: short names.
MEGAMOE_HOST_DEVICE inline const char* OpShortName(int op) {
  return op == kOpDispatchFwd ? "dispatch" : op == kOpDispatchBwd ? "dispatch-bwd"
         : op == kOpCombineFwd ? "combine" : "combine-bwd";
}
MEGAMOE_HOST_DEVICE inline const char* WaitShortName(int wait_kind) {
  return wait_kind == kWaitConsumed ? "send/consumed" : "receive/arrive";
}

}  // namespace megamoe::ep

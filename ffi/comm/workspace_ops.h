// The operations that signal through a symmetric workspace, as a wait's stage code names them
// when it times out (comm/peer_signal.cuh records the code, the workspace registry describes it).
// stage = op * 2 + wait kind for the separate kernels; the fused kernel's waits have their own
// stage codes (FusedStage). A new kernel that signals through the workspace adds its own here.
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

// The waits of the fused kernel (ffi/impls/sm90_fused_moe.cu), numbered after the separate
// kernels' stages.
enum FusedStage : int {
  kStageFusedCounts = 16,   // every source's routing counts of this call
  kStageFusedRows = 17,     // the rows of a pool M-block (sent by the sources)
  kStageFusedL1 = 18,       // the L1 tiles of an M-block (this rank's CTAs)
  kStageFusedResults = 19,  // every expert rank's results for this rank's slots
  kStageFusedBarrier = 20,  // this rank's CTAs at a grid barrier
};

// What a rank was waiting for at `stage`: the host's report (DescribeError) and the device's
// printf.
MEGAMOE_HOST_DEVICE inline const char* StageName(int stage) {
  switch (stage) {
    case Stage(kOpDispatchFwd, kWaitConsumed):
      return "dispatch (forward), send: waiting for the peer to release this rank's previous data "
             "(consumed)";
    case Stage(kOpDispatchFwd, kWaitArrive):
      return "dispatch (forward), receive: waiting for the peer's blocks to arrive (arrive)";
    case Stage(kOpDispatchBwd, kWaitConsumed):
      return "dispatch backward (combine-shaped), send: waiting for the peer to release this "
             "rank's previous data (consumed)";
    case Stage(kOpDispatchBwd, kWaitArrive):
      return "dispatch backward (combine-shaped), receive: waiting for the peer's blocks to "
             "arrive (arrive)";
    case Stage(kOpCombineFwd, kWaitConsumed):
      return "combine (forward), send: waiting for the peer to release this rank's previous data "
             "(consumed)";
    case Stage(kOpCombineFwd, kWaitArrive):
      return "combine (forward), receive: waiting for the peer's blocks to arrive (arrive)";
    case Stage(kOpCombineBwd, kWaitConsumed):
      return "combine backward (dispatch-shaped), send: waiting for the peer to release this "
             "rank's previous data (consumed)";
    case Stage(kOpCombineBwd, kWaitArrive):
      return "combine backward (dispatch-shaped), receive: waiting for the peer's blocks to "
             "arrive (arrive)";
    case kStageFusedCounts: return "fused forward: waiting for the peer's routing counts";
    case kStageFusedRows:
      return "fused forward: waiting for the rows of a pool block (sent by every source)";
    case kStageFusedL1: return "fused forward: waiting for the L1 tiles of a pool block";
    case kStageFusedResults: return "fused forward: waiting for the peer's expert outputs";
    case kStageFusedBarrier: return "fused forward: waiting for this rank's blocks at a barrier";
    default: return "?";
  }
}

}  // namespace megamoe::ep

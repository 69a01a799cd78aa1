// The expert-parallel row and slot layouts, shared by the dispatch / combine kernels, their
// handlers and a fused kernel. Per device: R ranks, T tokens per rank, H hidden, K top-k, El
// experts per rank.
//   receive row i = s * T + t   token t of source rank s (dense, R*T rows)
//   pool slot (s, t)            where source s puts its token t in a receiver's pools and
//                               metadata (comm/symmetric_memory.h): s * max_tokens + t, so a
//                               pool cannot overflow (a token travels once per destination)
//   slot_pos [R*T, K] int32     row of x_sorted holding (i, slot j), or kSlotNotRouted (slot j of
//                               the token goes to another rank) or kSlotDropped (capacity
//                               overflow, or an expert id repeated within the token)
//   recv_w   [R*T, K] f32       routing weight of (i, j) (0 where not routed here)
//   x_sorted [n_cap, H]         rows grouped by local expert in (expert, source, token) order,
//                               rows past the total are zero
// jax_megamoe/backends/cuda_ep.py documents the same codes.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ffi/common/host_device.h"

namespace megamoe::ep {

inline constexpr int kSlotNotRouted = -1;
inline constexpr int kSlotDropped = -2;

// Pool slot (source rank s, token t) of a workspace holding `max_tokens` tokens per rank.
MEGAMOE_HOST_DEVICE inline size_t PoolSlot(int s, int t, int64_t max_tokens) {
  return static_cast<size_t>(s) * max_tokens + t;
}

// Which rank holds global expert e (-1 for a masked or out-of-range id).
MEGAMOE_HOST_DEVICE inline int RankOfExpert(int e, int experts_per_rank, int num_ranks) {
  return (e >= 0 && e < experts_per_rank * num_ranks) ? e / experts_per_rank : -1;
}

}  // namespace megamoe::ep

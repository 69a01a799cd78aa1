// Host launchers of the expert-parallel dispatch / combine kernels (ffi/impls/ep_dispatch.cu,
// ffi/impls/ep_combine.cu). All take the caller's stream and launch without synchronising.
//
// Each launcher runs one call per local rank (calls[0..count): one on a GPU of a real EP group,
// R on a virtual group, see LocalRanks). The kernels of a call are issued stage by stage, every
// rank's kernel of a stage before any rank's next stage, on the one stream: a stage waits only
// on signals that earlier stages raise (arrivals on the sends, releases on the previous use), so
// the waits of R virtual ranks on one GPU complete without relying on kernels running
// concurrently, and a rank that is left out (LocalRanks::absent) is seen by the others exactly
// as a dead peer: their waits time out and report.
//
// Shapes (per device; R ranks, T tokens per rank, H hidden, K top-k, El experts per rank):
//   recv row i = s * T + t  is token t of source rank s (dense, R*T rows)
//   slot_pos [R*T, K] int32: row of x_sorted holding (i, slot j); -1 not routed here, -2 dropped
//                            (capacity overflow or a repeated expert id within a token)
//   recv_w   [R*T, K] f32:  routing weight of (i, j) (0 where not routed here)
//   x_sorted [n_cap, H]:    rows grouped by local expert in (expert, source, token) order,
//                           rows past the total are zero
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ffi/comm/symmetric_memory.h"

namespace megamoe::ep {

enum class ElemType { kF32, kBF16, kF16 };

struct DispatchArgs {
  ElemType type;
  const void* x;         // [T, H] rows to send (forward: tokens; combine backward: d_out)
  const int32_t* ids;    // [T, K] global expert ids, -1 masks a slot
  const float* weights;  // [T, K] (forward dispatch only; nullptr otherwise)
  int num_tokens, hidden, top_k, experts_per_rank;
};

// Dispatch forward: send rows + metadata, wait, sort by local expert, gather into x_sorted.
// scratch: int32 [DispatchScratchInts(R*T, El)]. stats: int32[4] = {rows needed, n_cap,
// overflow (0/1), repeated expert ids}. After a failed wait (timeout) the outputs are poisoned:
// x_sorted and recv_w NaN, slot_pos -1, group_sizes 0.
int64_t DispatchScratchInts(int64_t num_rows, int64_t experts_per_rank);
struct DispatchForwardCall {
  const PeerView* view;
  DispatchArgs args;
  void* x_sorted;
  int n_cap;
  int32_t* group_sizes;
  int32_t* slot_pos;
  float* recv_w;
  int32_t* stats;
  int32_t* scratch;
};
cudaError_t LaunchDispatchForward(const DispatchForwardCall* calls, int count,
                                  cudaStream_t stream);

// Combine forward: out[t] = sum over ranks r (ascending) of sum over slots j on r (ascending) of
// w[i, j] * y_sorted[slot_pos[i, j]], reduced partially on the expert rank, in x's dtype on the
// wire. Dispatch backward: the same without weights, plus d_recv_w returned to the source slots.
// A rank whose workspace recorded an error (a timed-out wait, now or earlier) writes NaN.
struct CombineArgs {
  ElemType type;
  const void* y_sorted;       // [n_cap, H]
  const int32_t* slot_pos;    // [R*T, K]
  const float* recv_w;        // [R*T, K] weights (combine forward) or nullptr (unweighted)
  const float* slot_values;   // [R*T, K] per-slot scalars sent back (dispatch backward) or nullptr
  const int32_t* ids;         // [T, K] the source's own routing
  int num_tokens, hidden, top_k, experts_per_rank, n_cap;
};
struct CombineCall {
  const PeerView* view;
  CombineArgs args;
  void* out;               // [T, H]
  float* slot_values_out;  // [T, K] or nullptr
};
cudaError_t LaunchCombine(const CombineCall* calls, int count, int op, cudaStream_t stream);

// Combine backward: d_out rows sent to the expert ranks (dispatch-shaped), then
// dy_sorted[p] = w * d_out[t] and d_recv_w[i, j] = <d_out[t], y_sorted[p]> (NaN after a failed
// wait).
struct CombineBackwardCall {
  const PeerView* view;
  DispatchArgs args;  // x = d_out
  const void* y_sorted;
  const int32_t* slot_pos;
  const float* recv_w;
  const int32_t* group_sizes;
  int n_cap;
  void* dy_sorted;
  float* d_recv_w;
};
cudaError_t LaunchCombineBackward(const CombineBackwardCall* calls, int count,
                                  cudaStream_t stream);

}  // namespace megamoe::ep

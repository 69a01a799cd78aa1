// Host launchers of the expert-parallel dispatch / combine kernels (ffi/impls/ep_dispatch.cu,
// ffi/impls/ep_combine.cu). All take the caller's stream and launch without synchronising.
// Shapes and codes of their operands (recv rows, slot_pos, recv_w, x_sorted): layout/ep_layout.h.
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
// overflow (0/1), repeated expert ids}.
int64_t DispatchScratchInts(int64_t num_rows, int64_t experts_per_rank);
cudaError_t LaunchDispatchForward(const PeerView& v, const DispatchArgs& a, void* x_sorted,
                                  int n_cap, int32_t* group_sizes, int32_t* slot_pos,
                                  float* recv_w, int32_t* stats, int32_t* scratch,
                                  cudaStream_t stream);

// Combine forward: out[t] = sum over ranks r (ascending) of sum over slots j on r (ascending) of
// w[i, j] * y_sorted[slot_pos[i, j]], reduced partially on the expert rank, in x's dtype on the
// wire. Dispatch backward: the same without weights, plus d_recv_w returned to the source slots.
struct CombineArgs {
  ElemType type;
  const void* y_sorted;       // [n_cap, H]
  const int32_t* slot_pos;    // [R*T, K]
  const float* recv_w;        // [R*T, K] weights (combine forward) or nullptr (unweighted)
  const float* slot_values;   // [R*T, K] per-slot scalars sent back (dispatch backward) or nullptr
  const int32_t* ids;         // [T, K] the source's own routing
  int num_tokens, hidden, top_k, experts_per_rank, n_cap;
};
cudaError_t LaunchCombine(const PeerView& v, const CombineArgs& a, int op, void* out,
                          float* slot_values_out, cudaStream_t stream);

// Combine backward: d_out rows sent to the expert ranks (dispatch-shaped), then
// dy_sorted[p] = w * d_out[t] and d_recv_w[i, j] = <d_out[t], y_sorted[p]>.
cudaError_t LaunchCombineBackward(const PeerView& v, const DispatchArgs& a, const void* y_sorted,
                                  const int32_t* slot_pos, const float* recv_w,
                                  const int32_t* group_sizes, int n_cap, void* dy_sorted,
                                  float* d_recv_w, cudaStream_t stream);

}  // namespace megamoe::ep

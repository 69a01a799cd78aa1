// The dgrad core of the grouped SwiGLU MLP's backward on sm_90a (tile engine kDgrad,
// ffi/gemm/sm90_moe_tile_engine.cuh): dh = dy @ w_down[e]^T with the SwiGLU backward in its
// epilogue (dgate_up, the math of grouped_swiglu.cu's SwigluBackward bit for bit on the same
// bf16 dh), then dx = dgate_up @ w_gate_up[e]^T; both read the weights as stored (K-major
// operands, no transposed copy). Two persistent launches, no cross-CTA waits. Plain C++
// interface: enqueues on `stream`, returns "" or what failed.
#pragma once

#include <cstdint>
#include <string>

#include <cuda_runtime.h>

namespace megamoe::grouped {

// Experts the core's tile walk holds in shared memory.
inline constexpr int kMoeDgradMaxExperts = 1024;

struct MoeDgradProblem {
  const void* dy;         // [n, H] bf16, rows in group order
  const void* gate_up;    // [n, 2F] bf16, the forward's (gate | up)
  const void* w_gate_up;  // [E, H, 2F] bf16
  const void* w_down;     // [E, F, H] bf16
  const int32_t* offsets; // [E + 1] on the device (scheduler/group_offsets.h)
  int64_t n, hidden, ffn;
  int num_experts;
  void* dgate_up;         // [n, 2F] bf16 out: rows < offsets[E] written
  void* dx;               // [n, H] bf16 out: rows < offsets[E] written
};

// "" when the core takes the shape (H and F positive multiples of 256, at most kMoeDgradMaxExperts
// experts, an sm_90 device), else why not.
std::string MoeDgradUnsupportedReason(int64_t hidden, int64_t ffn, int64_t num_experts);

std::string MoeDgradSm90(const MoeDgradProblem& p, cudaStream_t stream);

}  // namespace megamoe::grouped

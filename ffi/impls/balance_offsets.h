// The router's "balance" offsets (jax_megamoe/router.py, _balancing_offsets) solved by one
// cooperative CUDA kernel, where XLA runs ~250 small kernels per MoE layer (0.6 ms at 16,384
// tokens x 128 experts on an H100 or H200, launch-bound: benchmarks/RESULTS.md, sessions 25-28).
// Plain C++ interface; enqueues on `stream` and returns "" or what failed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda_runtime.h>

#include "ffi/layout/balance_problem.h"

namespace megamoe::router {

// z [rows, experts] f32 (standardised, perturbed logits) -> offsets [experts] f32.
// 1 <= top_k <= experts <= kBalanceMaxExperts, rows >= 1. `scratch` holds
// BalanceScratchBytes(experts, the current GPU's SM count).
std::string BalanceOffsets(const float* z, int64_t rows, int64_t experts,
                           const BalanceSettings& settings, float* offsets, void* scratch,
                           size_t scratch_bytes, cudaStream_t stream);

}  // namespace megamoe::router

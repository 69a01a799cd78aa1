// The router's "balance" solve (router._balancing_offsets) as its kernel and handlers see it:
// its settings, its limit on experts and the layout of its scratch. Host-only: shared by the
// CUDA kernel (impls/balance_offsets.cu) and both handlers.
#pragma once

#include <cstddef>
#include <cstdint>

namespace megamoe::router {

// The most experts the kernel takes (each warp holds a row, kBalanceMaxExperts / 32 per lane).
// router.BALANCE_KERNEL_MAX_EXPERTS is the same number (tests/test_balance_kernel.py checks).
inline constexpr int kBalanceMaxExperts = 512;

// The solve's constants: router.py's BALANCE_*.
struct BalanceSettings {
  int top_k;
  float temperature;  // Sinkhorn on exp(z / temperature)
  int sinkhorn_iterations;
  int load_steps;
  float step_first;  // load step i moves by step_first * step_decay^i
  float step_decay;
};

// The scratch for `experts` columns on a GPU of `sm_count` SMs: two buffers of per-CTA column
// partials (float [2][CTAs][experts], one CTA per SM at most).
inline size_t BalanceScratchBytes(int64_t experts, int sm_count) {
  return size_t(2) * size_t(sm_count) * size_t(experts) * sizeof(float);
}

}  // namespace megamoe::router

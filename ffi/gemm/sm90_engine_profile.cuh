// Cycle accounting of the tile engine's roles (ffi/gemm/sm90_moe_tile_engine.cuh), for
// benchmarks only: built with -DMEGAMOE_ENGINE_PROFILE=1, each CTA's producer and its two
// consumer warpgroups sum, in SM clock cycles, where their time goes (waiting for a job,
// for a stage's data, for a free stage, for a tile's rows; the mainloop; the epilogue) and
// write the sums into g_engine_profile[blockIdx.x] once, when their role ends (the layout:
// engine_profile_layout.h). The harnesses read the array after one launch
// (benchmarks/kernels/engine_profile_report.h); an extension built with
// JAX_MEGAMOE_ENGINE_PROFILE=ON reads the fused kernel's through the FFI target
// megamoe_fused_engine_profile (benchmarks/fused_phases.py --engine-profile).
//
// Off (the default, in the harnesses and the extension alike) every call here compiles to
// nothing: the product's PTX does not change. On, each consumer thread carries a dozen more
// 32-bit registers (more spills); compare the profiled build's kernel time with the plain
// build's before trusting its split (session 31: 0.7-2% slower in the harness).
#pragma once

#include <cstdint>

#include "ffi/gemm/engine_build_options.h"  // MEGAMOE_ENGINE_PROFILE
#include "ffi/gemm/engine_profile_layout.h"

namespace megamoe::fused::sm90::profile {

inline constexpr bool kEnabled = MEGAMOE_ENGINE_PROFILE != 0;

#if MEGAMOE_ENGINE_PROFILE
// One array per translation unit (internal linkage): several of the extension's CUDA files
// include the engine, and each reads back its own kernels' counters (the fused kernel's:
// ReadFusedEngineProfile in sm90_fused_moe.cu).
static __device__ unsigned long long g_engine_profile[kMaxCtas][kSlots];
#endif

__device__ __forceinline__ uint32_t clock32() {
  if constexpr (kEnabled) {
    uint32_t c;
    asm volatile("mov.u32 %0, %%clock;" : "=r"(c)::"memory");
    return c;
  } else {
    return 0;
  }
}

__device__ __forceinline__ uint64_t global_ns() {
  if constexpr (kEnabled) {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
    return t;
  } else {
    return 0;
  }
}

// Sums of one role, in registers; one thread of the role writes them (flush).
template <int kN>
struct RoleSums {
  uint32_t v[kEnabled ? kN : 1];
  __device__ __forceinline__ RoleSums() {
    if constexpr (kEnabled) {
#pragma unroll
      for (int i = 0; i < kN; ++i) v[i] = 0;
    }
  }
  // v[i] += now - since (cycles).
  __device__ __forceinline__ void since(int i, uint32_t since_clk) {
    if constexpr (kEnabled) v[i] += clock32() - since_clk;
  }
  __device__ __forceinline__ void count(int i, uint32_t n) {
    if constexpr (kEnabled) v[i] += n;
  }
  __device__ __forceinline__ void set(int i, uint32_t x) {
    if constexpr (kEnabled) v[i] = x;
  }
  // The role's sums into its CTA's row at `base`, and the role's end time at `end_ns_slot`.
  __device__ __forceinline__ void flush(int base, int end_ns_slot) const {
#if MEGAMOE_ENGINE_PROFILE
    if (blockIdx.x >= kMaxCtas) return;
    unsigned long long* row = g_engine_profile[blockIdx.x];
#pragma unroll
    for (int i = 0; i < kN; ++i) row[base + i] = v[i];
    row[end_ns_slot] = global_ns();
#endif
  }
};

// One thread at the CTA's start: its SM and the start time.
__device__ __forceinline__ void cta_begin() {
#if MEGAMOE_ENGINE_PROFILE
  if (blockIdx.x >= kMaxCtas) return;
  uint32_t sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  g_engine_profile[blockIdx.x][kSmId] = sm;
  g_engine_profile[blockIdx.x][kBeginNs] = global_ns();
#endif
}

}  // namespace megamoe::fused::sm90::profile

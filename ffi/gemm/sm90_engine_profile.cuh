// Cycle accounting of the tile engine's roles (ffi/gemm/sm90_moe_tile_engine.cuh), for the
// standalone harnesses only: built with -DMEGAMOE_ENGINE_PROFILE=1, each CTA's producer and
// its two consumer warpgroups sum, in SM clock cycles, where their time goes (waiting for a job,
// for a stage's data, for a free stage, for a tile's rows; the mainloop; the epilogue) and
// write the sums into g_engine_profile[blockIdx.x] once, when their role ends. The harness
// reads the array after one launch (benchmarks/kernels/engine_profile_report.h).
//
// Off (the default, and always in the extension) every call here compiles to nothing: the
// product's PTX does not change. On, the consumers carry five more 32-bit registers; compare
// the profiled build's kernel time with the plain build's before trusting its split.
#pragma once

#include <cstdint>

#ifndef MEGAMOE_ENGINE_PROFILE
#define MEGAMOE_ENGINE_PROFILE 0
#endif

namespace megamoe::fused::sm90::profile {

inline constexpr bool kEnabled = MEGAMOE_ENGINE_PROFILE != 0;

// A consumer warpgroup's sums (cycles unless named otherwise).
enum WgSlot : int {
  kWgJobWait = 0,   // waiting for the next job (the producer's scheduler, or the ring full)
  kWgFullWait,      // in the mainloop, waiting for a stage's data (bf16 mainloop only)
  kWgMainloop,      // first stage wait .. last wgmma retired, full waits included
  kWgEpilogue,      // last wgmma retired .. the tile's `stored` arrival
  kWgKBlocks,       // stages consumed (count)
  kWgTiles,         // tiles (count)
  // The bf16 epilogue's parts (their sum is kWgEpilogue, less the release at its end):
  kWgEpiBothWg,     // waiting for the other warpgroup to finish reading the tile's stages
  kWgEpiStage,      // math (SwiGLU) and fragments into the staging slots, warpgroup barrier
  kWgEpiDst,        // gate_up's TMA stores issued; waiting for the rows' destinations
  kWgEpiStore,      // the slots read back and the global stores issued
  kWgBeginClk,      // clock at the role's start and end
  kWgEndClk,
  kWgSlots
};
// The producer warp's sums.
enum ProducerSlot : int {
  kPJobEmptyWait = 0,  // waiting for a free job slot (the consumers or signaller behind)
  kPEmptyWait,         // waiting for a free stage (the consumers behind: the good case)
  kPRowsWait,          // in hooks.wait_rows_ready (a tile's rows not yet there)
  kPTiles,
  kPBeginClk,
  kPEndClk,
  kProducerSlots
};
// Per CTA: the SM it ran on, global nanoseconds at the start and at each role's end, then the
// roles' sums.
enum CtaSlot : int {
  kSmId = 0,
  kBeginNs,
  kProducerEndNs,
  kWg0EndNs,
  kWg1EndNs,
  kWg0 = 8,
  kWg1 = kWg0 + kWgSlots,
  kProducer = kWg1 + kWgSlots,
  kSlots = kProducer + kProducerSlots
};

inline constexpr int kMaxCtas = 1024;

#if MEGAMOE_ENGINE_PROFILE
__device__ unsigned long long g_engine_profile[kMaxCtas][kSlots];
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

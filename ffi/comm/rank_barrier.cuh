// A grid barrier over the CTAs of one rank of a fused-kernel launch, with a bounded wait. The
// launch is cooperative (every CTA co-resident), so the barrier cannot deadlock on CTAs that
// never got an SM; its wait still times out and reports like every wait on a peer.
//
// Sense-reversing, over the rank's FusedSignals: each CTA reads the generation, arrives on the
// count; the last CTA resets the count and bumps the generation (release), the others spin on
// it (acquire). Nothing is reset between calls, so consecutive calls and graph replays work.
#pragma once

#include "ffi/comm/peer_signal.cuh"
#include "ffi/comm/symmetric_memory.h"

namespace megamoe::ep {

#ifdef __CUDACC__

__device__ __forceinline__ FusedSignals* FusedSignalsOf(const PeerView& v, int rank) {
  return reinterpret_cast<FusedSignals*>(v.base[rank] + v.layout.fsig);
}

__device__ __forceinline__ unsigned int LoadAcquireGpu(const unsigned int* p) {
  unsigned int v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void StoreReleaseGpu(unsigned int* p, unsigned int v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void StoreReleaseSys(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Block-wide; every CTA of the rank calls it the same number of times. False when the wait
// timed out (recorded as an error of this rank).
__device__ __forceinline__ bool RankBarrier(const PeerView& v, int ctas) {
  __shared__ int ok;
  __syncthreads();
  if (threadIdx.x == 0) {
    FusedSignals* sig = FusedSignalsOf(v, v.rank);
    int good = 1;
    const unsigned int generation = LoadAcquireGpu(&sig->barrier_generation);
    __threadfence();
    if (atomicAdd(&sig->barrier_count, 1u) == static_cast<unsigned int>(ctas - 1)) {
      atomicExch(&sig->barrier_count, 0u);
      StoreReleaseGpu(&sig->barrier_generation, generation + 1);
    } else {
      const unsigned long long start = GlobalTimerNs();
      while (LoadAcquireGpu(&sig->barrier_generation) == generation) {
        const long long waited = static_cast<long long>(GlobalTimerNs() - start);
        if (waited > v.timeout_ns) {
          RecordTimeout(v.error, &v.signals(v.rank)->error_claim, v.rank, kStageFusedBarrier,
                        v.rank, generation, generation + 1, waited);
          good = 0;
          break;
        }
        __nanosleep(64);
      }
    }
    ok = good;
  }
  __syncthreads();
  return ok != 0;
}

#endif  // __CUDACC__

}  // namespace megamoe::ep

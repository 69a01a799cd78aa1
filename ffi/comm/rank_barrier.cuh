// A grid barrier over the CTAs of one rank of a fused-kernel launch, with a bounded wait. The
// launch is cooperative (every CTA co-resident), so the barrier cannot deadlock on CTAs that
// never got an SM; its wait still times out and reports like every wait on a peer.
//
// Sense-reversing, over the rank's FusedSignals: each CTA reads the generation, arrives on the
// count; the last CTA resets the count and bumps the generation (release), the others spin on
// it (acquire). Nothing is reset between calls, so consecutive calls and graph replays work.
// After an error of the rank the count may be left off; the workspace is dead then (every later
// call is refused by its handler).
#pragma once

#include "ffi/comm/peer_signal.cuh"
#include "ffi/comm/symmetric_memory.h"

namespace megamoe::ep {

#ifdef __CUDACC__

// Block-wide; every CTA of the rank calls it the same number of times. False when this rank
// recorded an error (a wait of another CTA timed out: the barrier then stops waiting, the error
// names that wait) or, after twice the workspace's timeout, when a CTA of the rank never came.
__device__ __forceinline__ bool RankBarrier(const PeerView& v, int ctas) {
  __shared__ int ok;
  __syncthreads();
  if (threadIdx.x == 0) {
    FusedSignals* sig = v.fused_signals(v.rank);
    int good = 1;
    const unsigned int generation = LoadAcquireGpu(&sig->barrier_generation);
    // System scope: what the CTAs publish behind this barrier includes stores to peer GPUs.
    __threadfence_system();
    if (atomicAdd(&sig->barrier_count, 1u) == static_cast<unsigned int>(ctas - 1)) {
      __threadfence();  // acquire the other CTAs' writes before releasing them all
      atomicExch(&sig->barrier_count, 0u);
      StoreReleaseGpu(&sig->barrier_generation, generation + 1);
    } else {
      const unsigned long long start = GlobalTimerNs();
      for (unsigned iter = 1; LoadAcquireGpu(&sig->barrier_generation) == generation; ++iter) {
        if ((iter & 255u) == 0u) {
          if (RankFailed(v)) {
            good = 0;
            break;
          }
          const long long waited = static_cast<long long>(GlobalTimerNs() - start);
          if (waited > 2 * v.timeout_ns) {
            RecordTimeout(v.error, &v.signals(v.rank)->error_claim, v.rank, kStageFusedBarrier,
                          v.rank, generation, generation + 1, waited);
            good = 0;
            break;
          }
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

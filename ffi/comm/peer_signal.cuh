// Device-side signalling between the ranks of a symmetric workspace: system-scope release adds,
// acquire loads and bounded waits that record who waited for what (a stage code of
// comm/workspace_ops.h) when they time out.
//
// Protocol for one use of a region (dispatch-shaped or combine-shaped traffic):
//   send kernel    each block first waits until every receiver has released this rank's previous
//                  data (consumed[region][r] >= uses), writes rows into the receivers' pools, then
//                  adds 1 to arrive[region][rank] on every receiver (fence + red.release.sys)
//   receive        waits until arrive[region][s] >= (uses + 1) * comm_blocks for every source s
//   release kernel adds 1 to consumed[region][rank] on every source, then uses[region] += 1
// `uses` lives in device memory and only the device bumps it, so consecutive calls, loops and
// CUDA-graph replays all see the right epoch; counters never reset, so a stale signal from an
// earlier call can never satisfy a later wait.
#pragma once

#include <cstdio>

#include "ffi/comm/symmetric_memory.h"
#include "ffi/comm/workspace_ops.h"

namespace megamoe::ep {

__device__ __forceinline__ unsigned long long LoadAcquireSys(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void AddReleaseSys(unsigned long long* p, unsigned long long v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void StoreReleaseSys(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ unsigned int LoadAcquireGpu(const unsigned int* p) {
  unsigned int v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void StoreReleaseGpu(unsigned int* p, unsigned int v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned long long GlobalTimerNs() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Records a timeout in this rank's ErrorRecord (the host reports it: DescribeError), once per
// rank; true for the caller that recorded it. Scalars only (no PeerView reference): taking a
// kernel parameter's address would copy the whole view to local memory in every kernel.
__device__ __forceinline__ bool RecordTimeout(ErrorRecord* e, unsigned int* claim, int rank,
                                              int stage, int peer, unsigned long long value,
                                              unsigned long long expected, long long waited_ns,
                                              int index = -1) {
  if (atomicCAS(claim, 0u, 1u) != 0u) return false;
  if (e != nullptr) {
    e->rank = rank;
    e->stage = stage;
    e->peer = peer;
    e->index = index;
    e->value = value;
    e->expected = expected;
    e->waited_ns = waited_ns;
    __threadfence_system();
    *reinterpret_cast<volatile int*>(&e->code) = 1;
    __threadfence_system();
  }
  return true;
}

// RecordTimeout, then a line on the device's stdout (kernels without wgmma only: a printf is a
// function call, and a call anywhere in a wgmma kernel serialises its wgmma, ptxas C7510).
static __device__ __noinline__ void ReportTimeout(ErrorRecord* e, unsigned int* claim, int rank,
                                                  int stage, int peer, unsigned long long value,
                                                  unsigned long long expected,
                                                  long long waited_ns) {
  if (!RecordTimeout(e, claim, rank, stage, peer, value, expected, waited_ns)) return;
  printf("jax_megamoe EP timeout: rank %d, %s: waited %.3f s on peer rank %d, counter %llu < "
         "expected %llu\n",
         rank, StageName(stage), waited_ns * 1e-9, peer, value, expected);
}

// Spins until *addr >= expected (acquire, system scope). False on timeout or when this rank has
// already recorded an error (the caller then skips its work; the handler reports the error).
// kPrint = false: the timeout is recorded without a printf (for kernels with wgmma).
// `index` names which counter of the stage (reported; -1 when the stage has one per peer).
template <bool kPrint = true>
__device__ __forceinline__ bool WaitAtLeast(const PeerView& v, const unsigned long long* addr,
                                            unsigned long long expected, int stage, int peer,
                                            int index = -1) {
  unsigned long long cur = LoadAcquireSys(addr);
  if (cur >= expected) return true;
  const unsigned long long start = GlobalTimerNs();
  for (unsigned iter = 1;; ++iter) {
    cur = LoadAcquireSys(addr);
    if (cur >= expected) return true;
    if ((iter & 255u) == 0u) {
      const long long waited = static_cast<long long>(GlobalTimerNs() - start);
      if (waited > v.timeout_ns) {
        if constexpr (kPrint) {
          ReportTimeout(v.error, &v.signals(v.rank)->error_claim, v.rank, stage, peer, cur,
                        expected, waited);
        } else {
          RecordTimeout(v.error, &v.signals(v.rank)->error_claim, v.rank, stage, peer, cur,
                        expected, waited, index);
        }
        return false;
      }
      if (*reinterpret_cast<volatile unsigned int*>(&v.signals(v.rank)->error_claim) != 0u) {
        return false;
      }
    }
    __nanosleep(32);
  }
}

// Block-wide: thread 0 waits until every receiver released this rank's previous data.
__device__ __forceinline__ bool BlockWaitConsumed(const PeerView& v, int region, int op,
                                                  unsigned long long uses) {
  __shared__ int ok;
  if (threadIdx.x == 0) {
    int good = 1;
    const SignalArea* me = v.signals(v.rank);
    for (int r = 0; r < v.num_ranks && good; ++r) {
      good = WaitAtLeast(v, &me->consumed[region][r], uses, Stage(op, kWaitConsumed), r);
    }
    ok = good;
  }
  __syncthreads();
  return ok != 0;
}

// Block-wide: thread 0 waits until every source's send blocks of this use have arrived.
__device__ __forceinline__ bool BlockWaitArrivals(const PeerView& v, int region, int op,
                                                  unsigned long long uses) {
  __shared__ int ok;
  if (threadIdx.x == 0) {
    int good = 1;
    const SignalArea* me = v.signals(v.rank);
    const unsigned long long expected = (uses + 1) * static_cast<unsigned long long>(v.comm_blocks);
    for (int s = 0; s < v.num_ranks && good; ++s) {
      good = WaitAtLeast(v, &me->arrive[region][s], expected, Stage(op, kWaitArrive), s);
    }
    ok = good;
  }
  __syncthreads();
  return ok != 0;
}

// Block-wide, at the end of a send kernel: everything this block wrote to peers becomes visible
// before its arrival is counted on every receiver.
__device__ __forceinline__ void BlockSignalArrival(const PeerView& v, int region) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    for (int r = 0; r < v.num_ranks; ++r) AddReleaseSys(&v.signals(r)->arrive[region][v.rank], 1);
  }
}

// Whether a wait of this rank has failed (now or in an earlier call): its data cannot be trusted.
__device__ __forceinline__ bool RankFailed(const PeerView& v) {
  return *reinterpret_cast<volatile unsigned int*>(&v.signals(v.rank)->error_claim) != 0u;
}

// Block-wide (the same answer for every thread of the block): RankFailed as thread 0 saw it.
__device__ __forceinline__ bool BlockRankFailed(const PeerView& v) {
  __shared__ int failed;
  if (threadIdx.x == 0) failed = RankFailed(v);
  __syncthreads();
  return failed != 0;
}

__device__ __forceinline__ unsigned long long LoadUses(const PeerView& v, int region) {
  return *reinterpret_cast<volatile unsigned long long*>(&v.signals(v.rank)->uses[region]);
}

// The release kernel, one thread: every source may reuse its slots in this rank's `region`; this
// rank's epoch of the region += 1.
static __global__ void ReleaseKernel(PeerView v, int region) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  if (RankFailed(v)) return;
  __threadfence_system();
  for (int s = 0; s < v.num_ranks; ++s) AddReleaseSys(&v.signals(s)->consumed[region][v.rank], 1);
  unsigned long long* uses = &v.signals(v.rank)->uses[region];
  *reinterpret_cast<volatile unsigned long long*>(uses) = *uses + 1;
}

}  // namespace megamoe::ep

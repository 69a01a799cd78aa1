// A static schedule of one GEMM kind's tiles for a persistent launch: CTA b takes tiles b,
// b + grid, b + 2 grid, ... of the expert tile walk (expert_tile_walk.cuh), in walk order. For
// launches whose tiles never wait on each other (one GEMM kind per launch, stream order between
// launches): the dgrad core of backend cuda's MLP backward and the FP8 core harness.
#pragma once

#include "ffi/scheduler/expert_tile_walk.cuh"

namespace megamoe::fused {

template <class Walk>
struct OneKindSchedule {
  Walk walk;
  int t, stride, total, n_blocks, kind, cursor;
  bool n_major;

  // One warp, all lanes (the walk's build); `storage` in shared memory.
  __device__ __forceinline__ void init(typename Walk::SharedStorage* storage,
                                       const int32_t* offsets, int num_experts, int lane,
                                       int kind_, int n_blocks_, bool n_major_) {
    walk.build(storage, offsets, num_experts, lane);
    t = blockIdx.x;
    stride = gridDim.x;
    total = walk.num_m_blocks() * n_blocks_;
    n_blocks = n_blocks_;
    kind = kind_;
    cursor = 0;
    n_major = n_major_;
  }

  // The tile engine's Scheduler: the next tile of this CTA, false when there is none.
  __device__ __forceinline__ bool next(ExpertTile& job) {
    if (t >= total) return false;
    job = walk.decode(t, n_blocks, kind, cursor, n_major);
    t += stride;
    return true;
  }
};

}  // namespace megamoe::fused

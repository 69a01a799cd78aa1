// Device-side walk over the output tiles of a grouped (per-expert) GEMM whose rows are sorted
// by expert: offsets [E + 1] (on the device, never read by the host) -> for a linear tile index
// t, the expert, its M-block and N-block, the first row of the tile and how many of its rows
// belong to the expert. Partial last M-blocks are kept (rows < kBlockM), empty experts own no
// tiles. Tile order is M-block-major, N fastest: consecutive tiles share their A rows and one
// expert's weights, which keeps both in L2 while a wave of CTAs works on them.
//
// Used by the fused MoE kernel's schedulers (ffi/gemm/sm90_moe_tile_engine.cuh consumes the
// ExpertTile it produces); the walk itself holds no policy about which CTA runs which tile.
#pragma once

#include <cstdint>

namespace megamoe::fused {

// One unit of GEMM work: a kBlockM x kBlockN output tile of one expert. `kind` says which GEMM
// (the tile engine's kL1GateUp / kL2Down); kind < 0 is the end-of-work sentinel.
struct ExpertTile {
  int32_t kind;
  int32_t expert;
  int32_t m_block;    // M-block inside the expert
  int32_t n_block;    // N-block of the GEMM's output
  int32_t row_begin;  // first row of the tile in group order (offsets[expert] + m_block * BM)
  int32_t rows;       // rows of the tile that belong to the expert, 1..BM
  int32_t tile;       // linear tile index inside its GEMM (as decoded), for the hooks
  int32_t mb_global;  // M-block index over all experts (prefix + m_block), for counters
};

// The M-block prefix over experts, kept in shared memory by the warp that schedules.
template <int kBlockM, int kMaxExperts>
struct ExpertTileWalk {
  struct SharedStorage {
    int32_t mb_prefix[kMaxExperts + 1];  // M-blocks of experts < e
    int32_t offsets[kMaxExperts + 1];
  };

  SharedStorage* s;
  int num_experts;

  // One warp, all 32 lanes: copy offsets into shared memory and scan the M-block counts.
  // Rows of expert e are offsets[e] .. offsets[e + 1] (clamped to be non-decreasing).
  __device__ __forceinline__ void build(SharedStorage* storage, const int32_t* __restrict__ offsets,
                                        int experts, int lane) {
    s = storage;
    num_experts = experts;
    int carry = 0;
    for (int base = 0; base < experts; base += 32) {
      const int e = base + lane;
      int mb = 0;
      if (e < experts) {
        const int lo = __ldg(offsets + e);
        const int hi = __ldg(offsets + e + 1);
        s->offsets[e] = lo;
        mb = hi > lo ? (hi - lo + kBlockM - 1) / kBlockM : 0;
      }
      // Inclusive scan over the warp.
      int incl = mb;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, d);
        if (lane >= d) incl += v;
      }
      if (e < experts) s->mb_prefix[e] = carry + incl - mb;
      carry += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane == 0) {
      s->mb_prefix[experts] = carry;
      s->offsets[experts] = __ldg(offsets + experts);
    }
    __syncwarp();
  }

  __device__ __forceinline__ int num_m_blocks() const { return s->mb_prefix[num_experts]; }

  // Tile t of a GEMM with n_blocks N-blocks (t < num_m_blocks() * n_blocks). `cursor` is an
  // expert index that only moves forward: callers that decode increasing t (a persistent CTA's
  // static stride) pass the same variable every time and pay O(1) per tile on average; start it
  // at 0. Order inside an expert: n_major = false: M-block-major (N fastest: consecutive tiles
  // share A rows); true: N-block-major (M fastest: consecutive tiles share one weight slice).
  // Either way the expert's tiles are t in [mb_prefix[e] * n_blocks, mb_prefix[e+1] * n_blocks).
  __device__ __forceinline__ ExpertTile decode(int t, int n_blocks, int kind, int& cursor,
                                               bool n_major = false) const {
    ExpertTile job;
    const int q = t / n_blocks;  // selects the expert in either order
    if (cursor > 0 && q < s->mb_prefix[cursor]) cursor = 0;
    while (q >= s->mb_prefix[cursor + 1]) ++cursor;  // skips empty experts
    const int e = cursor;
    const int base = s->mb_prefix[e];
    if (n_major) {
      const int mbs = s->mb_prefix[e + 1] - base;
      const int local = t - base * n_blocks;
      job.n_block = local / mbs;
      job.m_block = local - job.n_block * mbs;
    } else {
      job.n_block = t - q * n_blocks;
      job.m_block = q - base;
    }
    job.kind = kind;
    job.expert = e;
    job.row_begin = s->offsets[e] + job.m_block * kBlockM;
    const int end = s->offsets[e + 1];
    job.rows = min(kBlockM, end - job.row_begin);
    job.tile = t;
    job.mb_global = base + job.m_block;
    return job;
  }
};

}  // namespace megamoe::fused

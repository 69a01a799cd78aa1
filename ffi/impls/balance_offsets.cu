// The router's "balance" offsets in one cooperative kernel: see balance_offsets.h. Each CTA
// owns a slice of the rows (held in shared memory with their Sinkhorn kernel when they fit),
// a warp takes two rows at a time with a row's experts spread over its lanes (expert e on lane
// e % 32; the two rows' shuffles interleaved), and every pass over the rows ends in per-column
// sums over the whole grid: per-CTA partials in global memory, a grid barrier, then every CTA
// adds all CTAs' partials in the same fixed order, so that every CTA holds the same bits of
// the Sinkhorn scalings, the loads and the offsets (and each run the same as the last).
// Passes: router.BALANCE_SINKHORN_ITERATIONS Sinkhorn steps on the kernel exp(z / temperature
// - row max), then router.BALANCE_LOAD_STEPS steps on the hard top-k loads, each a k-th largest
// per row (k rounds of a warp maximum on order-preserving integer keys) and a count per column.
#include <cooperative_groups.h>

#include <algorithm>
#include <cmath>

#include "ffi/common/device_info.h"
#include "ffi/common/warp_reduce.cuh"
#include "ffi/impls/balance_offsets.h"

namespace megamoe::router {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr float kTiny = 1e-30f;  // router._sinkhorn_exp's floor of a row or column sum

struct Problem {
  const float* z;
  int rows, experts, rows_per_cta;
  BalanceSettings s;
  float col_target;  // rows * top_k / experts: a column's Sinkhorn sum, and the mean load
  float* offsets;
  float* partials;  // [2][gridDim.x][experts]: per-CTA column partials, alternate passes
};

// The shared memory every CTA keeps besides its rows of z.
struct Shared {
  float v[kBalanceMaxExperts];       // Sinkhorn's column scalings
  float b[kBalanceMaxExperts];       // the offsets of the current load step
  float best_b[kBalanceMaxExperts];  // the offsets with the smallest peak load so far
  float sums[kBalanceMaxExperts];    // the grid's column sums of the last pass
  float warp_part[kWarps][kBalanceMaxExperts];
  float group_part[kThreads];
  float warp_max[kWarps];
  float best;                        // the smallest peak load so far
};

// An unsigned key ordered as the float (-0 as +0, so that ties compare as floats do); 0 is
// below every key (the k-th largest's "removed").
__device__ __forceinline__ unsigned OrderKey(float x) {
  const unsigned u = __float_as_uint(x + 0.0f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// sh.sums[e] = the sum over the grid's rows of the partials each lane left in
// sh.warp_part[warp][e]: warps in order, then CTAs in order, split over the threads in groups
// of CTAs (every load in flight) whose sums are added in group order.
__device__ void GridColumnSum(const Problem& p, Shared& sh, int& pass, cg::grid_group& grid) {
  const int e_count = p.experts, ctas = int(gridDim.x);
  __syncthreads();
  float* buffer = p.partials + size_t(pass & 1) * ctas * e_count;
  for (int e = threadIdx.x; e < e_count; e += kThreads) {
    float s = 0.0f;
    for (int w = 0; w < kWarps; ++w) s += sh.warp_part[w][e];
    buffer[size_t(blockIdx.x) * e_count + e] = s;
  }
  grid.sync();
  const int groups = kThreads / e_count;  // >= 1: experts <= kThreads
  if (int(threadIdx.x) < groups * e_count) {
    const int e = threadIdx.x % e_count, q = threadIdx.x / e_count;
    const int begin = q * ctas / groups, end = (q + 1) * ctas / groups;
    float s = 0.0f;
#pragma unroll 32  // at 128 experts a group is 33 CTAs: every load in flight at once
    for (int c = begin; c < end; ++c) s += __ldcg(buffer + size_t(c) * e_count + e);
    sh.group_part[threadIdx.x] = s;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < e_count; e += kThreads) {
    float s = 0.0f;
    for (int q = 0; q < groups; ++q) s += sh.group_part[q * e_count + e];
    sh.sums[e] = s;
  }
  __syncthreads();
  ++pass;  // the next pass writes the other buffer: a CTA still reading this one has not
           // reached the next grid barrier, which every writer of the next pass has passed
}

template <int kPerLane, bool kCached>
__global__ void __launch_bounds__(kThreads, 1) BalanceOffsetsKernel(Problem p) {
  // kCached: this CTA's rows of z, then of the Sinkhorn kernel K = exp(z / temperature - row
  // max), each [rows_per_cta][experts].
  extern __shared__ float cached_rows[];
  __shared__ Shared sh;
  cg::grid_group grid = cg::this_grid();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, e_count = p.experts;
  const int first_row = blockIdx.x * p.rows_per_cta;
  const int rows = max(0, min(p.rows - first_row, p.rows_per_cta));
  const float* z = p.z + size_t(first_row) * e_count;
  float* z_rows = cached_rows;
  float* k_rows = cached_rows + size_t(p.rows_per_cta) * e_count;
  auto z_at = [&](int r, int e) {
    return kCached ? z_rows[r * e_count + e] : __ldg(z + size_t(r) * e_count + e);
  };
  // Row r's entries of K on this lane (0 past the experts; the row must exist).
  auto kernel_row = [&](int r, float (&k)[kPerLane]) {
    float m = -INFINITY;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = j * 32 + lane;
      k[j] = e < e_count ? z_at(r, e) / p.s.temperature : -INFINITY;
      m = fmaxf(m, k[j]);
    }
    m = WarpMax(m);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) k[j] = j * 32 + lane < e_count ? expf(k[j] - m) : 0.0f;
  };
  if constexpr (kCached) {
    for (int i = threadIdx.x; i < rows * e_count; i += kThreads) z_rows[i] = z[i];
    __syncthreads();
    for (int r = warp; r < rows; r += kWarps) {
      float k[kPerLane];
      kernel_row(r, k);
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        if (j * 32 + lane < e_count) k_rows[r * e_count + j * 32 + lane] = k[j];
      }
    }
  }
  for (int e = threadIdx.x; e < e_count; e += kThreads) sh.v[e] = 1.0f;
  if (threadIdx.x == 0) sh.best = INFINITY;
  __syncthreads();
  int pass = 0;

  // Sinkhorn (router._sinkhorn_exp): u = k / K v over the rows, v = col / K^T u. Each warp
  // takes two rows at a time (rows r and r + kWarps), their shuffles interleaved.
  for (int it = 0; it < p.s.sinkhorn_iterations; ++it) {
    float col[kPerLane] = {};
    for (int r0 = warp; r0 < rows; r0 += 2 * kWarps) {
      float k[2][kPerLane], dot[2];
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int r = r0 + q * kWarps;
        if (r >= rows) {
#pragma unroll
          for (int j = 0; j < kPerLane; ++j) k[q][j] = 0.0f;
        } else if constexpr (kCached) {
#pragma unroll
          for (int j = 0; j < kPerLane; ++j) {
            const int e = j * 32 + lane;
            k[q][j] = e < e_count ? k_rows[r * e_count + e] : 0.0f;
          }
        } else {
          kernel_row(r, k[q]);
        }
        dot[q] = 0.0f;
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) {
          if (j * 32 + lane < e_count) dot[q] += k[q][j] * sh.v[j * 32 + lane];
        }
      }
      for (int o = 16; o > 0; o >>= 1) {
        dot[0] += __shfl_xor_sync(0xffffffffu, dot[0], o);
        dot[1] += __shfl_xor_sync(0xffffffffu, dot[1], o);
      }
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const float u = float(p.s.top_k) / fmaxf(dot[q], kTiny);  // a missing row's k is 0
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) col[j] += k[q][j] * u;
      }
    }
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      if (j * 32 + lane < e_count) sh.warp_part[warp][j * 32 + lane] = col[j];
    }
    GridColumnSum(p, sh, pass, grid);
    for (int e = threadIdx.x; e < e_count; e += kThreads) {
      sh.v[e] = p.col_target / fmaxf(sh.sums[e], kTiny);
    }
    __syncthreads();
  }
  for (int e = threadIdx.x; e < e_count; e += kThreads) {
    sh.b[e] = sh.best_b[e] = p.s.temperature * logf(sh.v[e]);
  }
  __syncthreads();

  // Load steps (router._balancing_offsets): the rows' top-k loads under b, the best b kept;
  // two rows at a time, as above.
  for (int step = 0; step < p.s.load_steps; ++step) {
    float count[kPerLane] = {};
    for (int r0 = warp; r0 < rows; r0 += 2 * kWarps) {
      unsigned key[2][kPerLane], left[2][kPerLane];
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int r = r0 + q * kWarps;
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) {
          const int e = j * 32 + lane;
          key[q][j] = left[q][j] = r < rows && e < e_count ? OrderKey(z_at(r, e) + sh.b[e]) : 0u;
        }
      }
      // The k-th largest as router._kth_largest: k - 1 times remove the row's maximum (ties
      // together), then the maximum of what is left.
      unsigned kth[2] = {0u, 0u};
      for (int round = 0; round < p.s.top_k; ++round) {
        unsigned m[2] = {0u, 0u};
#pragma unroll
        for (int q = 0; q < 2; ++q) {
#pragma unroll
          for (int j = 0; j < kPerLane; ++j) m[q] = max(m[q], left[q][j]);
        }
        kth[0] = __reduce_max_sync(0xffffffffu, m[0]);
        kth[1] = __reduce_max_sync(0xffffffffu, m[1]);
#pragma unroll
        for (int q = 0; q < 2; ++q) {
#pragma unroll
          for (int j = 0; j < kPerLane; ++j) left[q][j] = left[q][j] >= kth[q] ? 0u : left[q][j];
        }
      }
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        if (r0 + q * kWarps >= rows) continue;
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) {
          count[j] += (j * 32 + lane < e_count && key[q][j] >= kth[q]) ? 1.0f : 0.0f;
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      if (j * 32 + lane < e_count) sh.warp_part[warp][j * 32 + lane] = count[j];
    }
    GridColumnSum(p, sh, pass, grid);  // counts: whole numbers, exact in any order
    float peak = -INFINITY;
    for (int e = threadIdx.x; e < e_count; e += kThreads) {
      peak = fmaxf(peak, sh.sums[e] / p.col_target);
    }
    peak = BlockReduce<kWarps>(peak, sh.warp_max,
                               [](float a, float b) { return fmaxf(a, b); });
    const bool better = peak < sh.best;
    const float size = p.s.step_first * powf(p.s.step_decay, float(step));
    for (int e = threadIdx.x; e < e_count; e += kThreads) {
      const float load = sh.sums[e] / p.col_target;
      if (better) sh.best_b[e] = sh.b[e];
      // An idle expert's log load is clipped (at 1/4 of the mean): one step stays small.
      sh.b[e] -= size * logf(fmaxf(load, 0.25f));
    }
    __syncthreads();  // every thread has read best
    if (threadIdx.x == 0 && better) sh.best = peak;
    __syncthreads();
  }
  if (blockIdx.x == 0) {
    for (int e = threadIdx.x; e < e_count; e += kThreads) p.offsets[e] = sh.best_b[e];
  }
}

template <int kPerLane, bool kCached>
std::string Launch(Problem p, int ctas, size_t smem, cudaStream_t stream) {
  auto kernel = BalanceOffsetsKernel<kPerLane, kCached>;
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           int(smem));
      e != cudaSuccess) {
    return std::string("BalanceOffsets: shared memory attribute: ") + cudaGetErrorString(e);
  }
  int per_sm = 0;
  if (cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads,
                                                                     smem);
      e != cudaSuccess || per_sm < 1) {
    return std::string("BalanceOffsets: no CTA fits an SM (") +
           (e != cudaSuccess ? cudaGetErrorString(e) : "occupancy 0") + ")";
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(ctas);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;  // every CTA co-resident: the grid barriers
  attr[0].val.cooperative = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  if (cudaError_t e = cudaLaunchKernelEx(&config, kernel, p); e != cudaSuccess) {
    return std::string("BalanceOffsets launch: ") + cudaGetErrorString(e);
  }
  return "";
}

template <int kPerLane>
std::string LaunchFor(const Problem& p, int ctas, cudaStream_t stream) {
  // Rows of z and K in shared memory when they fit beside the static part (~42 KB).
  constexpr size_t kDynamicBudget = 176 * 1024;
  const size_t rows_bytes = 2 * size_t(p.rows_per_cta) * p.experts * sizeof(float);
  return rows_bytes <= kDynamicBudget ? Launch<kPerLane, true>(p, ctas, rows_bytes, stream)
                                      : Launch<kPerLane, false>(p, ctas, 0, stream);
}

}  // namespace

std::string BalanceOffsets(const float* z, int64_t rows, int64_t experts,
                           const BalanceSettings& settings, float* offsets, void* scratch,
                           size_t scratch_bytes, cudaStream_t stream) {
  if (experts < 1 || experts > kBalanceMaxExperts || rows < 1 || rows > INT32_MAX / experts) {
    return "BalanceOffsets: bad shape [" + std::to_string(rows) + ", " +
           std::to_string(experts) + "]";
  }
  const int sms = CurrentDeviceSmCount();
  if (scratch_bytes < BalanceScratchBytes(experts, sms)) {
    return "BalanceOffsets: scratch of " + std::to_string(scratch_bytes) + " bytes, needs " +
           std::to_string(BalanceScratchBytes(experts, sms));
  }
  // One CTA per SM at most, and no fewer than kMinRowsPerCta rows each: every CTA pays for
  // all 36 grid barriers, so a small problem runs faster on fewer (H100: 1,000 x 128 in 140 us
  // on 66 CTAs against 155 on 132; a helper's measurement, session 29).
  constexpr int64_t kMinRowsPerCta = 64;
  const int64_t rows_per_cta = std::max((rows + sms - 1) / sms, kMinRowsPerCta);
  const int ctas = int((rows + rows_per_cta - 1) / rows_per_cta);
  Problem p;
  p.z = z;
  p.rows = int(rows);
  p.experts = int(experts);
  p.rows_per_cta = int(rows_per_cta);
  p.s = settings;
  // As the definition's Python float num_tokens * top_k / num_experts, rounded to float32.
  p.col_target = float(double(rows) * settings.top_k / double(experts));
  p.offsets = offsets;
  p.partials = static_cast<float*>(scratch);
  if (experts <= 128) return LaunchFor<4>(p, ctas, stream);
  if (experts <= 256) return LaunchFor<8>(p, ctas, stream);
  return LaunchFor<16>(p, ctas, stream);
}

}  // namespace megamoe::router

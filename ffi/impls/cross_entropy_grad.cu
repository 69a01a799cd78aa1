// The LM head's cross-entropy and its gradient in one read of the logits: see
// cross_entropy_grad.h. A cluster of CTAs per row (heuristics/cross_entropy_split.h); each CTA
// copies its segment of the row into shared memory, reduces it to (max, sum of exp), the
// cluster's CTAs combine their partials through distributed shared memory in rank order (every
// CTA the same way: the same lse bits, run to run too), and each CTA writes its segment's
// d_logits from shared memory.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_pipeline.h>

#include <cmath>
#include <cstdint>

#include "ffi/common/warp_reduce.cuh"
#include "ffi/heuristics/cross_entropy_split.h"
#include "ffi/impls/cross_entropy_grad.h"

namespace megamoe::xent {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 256;  // four CTAs per SM (heuristics/cross_entropy_split.h)
constexpr int kWarps = kThreads / 32;
constexpr float kLog2e = 1.4426950408889634f;

// exp(x - shift) as one FFMA and the SFU's ex2, shift_log2e = shift * log2(e): relative error
// ~2^-22 plus ~(|x| + |shift|) * 2^-24 from rounding the exponent (~2^-17 at 100): nothing
// next to the bf16 rounding of d_logits or to the float32 sum of a row.
__device__ __forceinline__ float ExpShifted(float x, float shift_log2e) {
  return exp2f(fmaf(x, kLog2e, -shift_log2e));
}

// A segment's logits, from shared memory (kCached) or memory; kVec elements per access.
template <bool kCached, int kVec>
struct Segment {
  const float* src;   // the segment in memory
  const float* smem;  // its copy (kCached)

  __device__ void Load(float (&x)[kVec], int i) const {
    const float* p = kCached ? smem + i : src + i;
    if constexpr (kVec == 4) {
      const float4 v = kCached ? *reinterpret_cast<const float4*>(p)
                               : __ldg(reinterpret_cast<const float4*>(p));
      x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
    } else {
      x[0] = kCached ? *p : __ldg(p);
    }
  }
};

template <int kVec>
__device__ void StoreBf16(__nv_bfloat16* dst, const float (&d)[kVec]) {
  if constexpr (kVec == 4) {
    __nv_bfloat162 lo = __floats2bfloat162_rn(d[0], d[1]), hi = __floats2bfloat162_rn(d[2], d[3]);
    uint2 packed;
    packed.x = *reinterpret_cast<uint32_t*>(&lo);
    packed.y = *reinterpret_cast<uint32_t*>(&hi);
    *reinterpret_cast<uint2*>(dst) = packed;
  } else {
    dst[0] = __float2bfloat16_rn(d[0]);
  }
}

struct Partial {
  float max, sum;  // the segment's sum of exp(x - max), maxima counted as 1
};

// The row's lse from the cluster's partials, by warp 0 (lane r reads rank r's): the maximum,
// then the rescaled sums added in rank order by lane 0. Every CTA of the row computes the same
// bits. Maxima equal to the row's count unscaled (losses._logsumexp's rule for +-inf).
__device__ float ClusterLse(cg::cluster_group& cluster, Partial* partial, int ranks) {
  const int lane = threadIdx.x % 32;
  Partial p = {-INFINITY, 0.0f};
  if (lane < ranks) p = *cluster.map_shared_rank(partial, lane);
  const float row_max = WarpMax(p.max);
  const float term = p.max == row_max ? p.sum : p.sum * ExpShifted(p.max, row_max * kLog2e);
  float row_sum = 0.0f;
  for (int r = 0; r < ranks; ++r) row_sum += __shfl_sync(0xffffffffu, term, r);
  return row_max + logf(row_sum);
}

template <bool kCached, int kVec>
__global__ void __launch_bounds__(kThreads, 4)
    CrossEntropyGradKernel(const float* __restrict__ logits, const int32_t* __restrict__ targets,
                           int64_t vocab, int segment, float inv_count,
                           __nv_bfloat16* __restrict__ d_logits, float* __restrict__ row_loss) {
  extern __shared__ float4 cache4[];
  __shared__ float scratch[kWarps];
  __shared__ Partial partial;
  __shared__ float row_lse;

  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank()), ranks = int(cluster.num_blocks());
  const int64_t row = blockIdx.x / ranks;
  const int64_t begin = int64_t(rank) * segment;
  // This CTA's length (int: a segment is at most a few hundred thousand logits).
  const int n = begin < vocab ? int(vocab - begin < segment ? vocab - begin : segment) : 0;
  const float* src = logits + row * vocab + begin;
  float* cache = reinterpret_cast<float*>(cache4);
  constexpr int kStep = kThreads * kVec;

  if constexpr (kCached) {  // every load in flight at once, then one wait
    for (int i = threadIdx.x * kVec; i < n; i += kStep) {
      __pipeline_memcpy_async(cache + i, src + i, sizeof(float) * kVec);
    }
    __pipeline_commit();
    __pipeline_wait_prior(0);
    __syncthreads();
  }
  const Segment<kCached, kVec> seg{src, cache};

  float m = -INFINITY;
  for (int i = threadIdx.x * kVec; i < n; i += kStep) {
    float x[kVec];
    seg.Load(x, i);
#pragma unroll
    for (int k = 0; k < kVec; ++k) m = fmaxf(m, x[k]);
  }
  m = BlockReduce<kWarps>(m, scratch, [](float a, float b) { return fmaxf(a, b); });
  float s = 0.0f;
  const float m_log2e = m * kLog2e;
  const bool infinite = isinf(m);  // -inf: all -inf (each counts 1); +inf: the +inf ones do
  for (int i = threadIdx.x * kVec; i < n; i += kStep) {
    float x[kVec];
    seg.Load(x, i);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      s += infinite ? (x[k] == m ? 1.0f : (isnan(x[k]) ? x[k] : 0.0f))
                    : ExpShifted(x[k], m_log2e);
    }
  }
  s = BlockReduce<kWarps>(s, scratch, [](float a, float b) { return a + b; });
  if (threadIdx.x == 0) partial = {m, s};
  cluster.sync();  // every CTA's partial written

  if (threadIdx.x < 32) {
    const float lse = ClusterLse(cluster, &partial, ranks);
    if (threadIdx.x == 0) row_lse = lse;
  }
  __syncthreads();  // row_lse written
  // Done reading the others' partials; they stay until every CTA has said so (before exit).
  cluster.barrier_arrive();
  const float lse = row_lse, lse_log2e = lse * kLog2e;

  const int32_t target = targets[row];
  // The target's index in this segment, or -1 (one CTA of the row holds it, when in range).
  const int own = target >= begin && target - begin < n ? int(target - begin) : -1;
  __nv_bfloat16* dst = d_logits + row * vocab + begin;
  for (int i = threadIdx.x * kVec; i < n; i += kStep) {
    float x[kVec], d[kVec];
    seg.Load(x, i);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      d[k] = (ExpShifted(x[k], lse_log2e) - (i + k == own ? 1.0f : 0.0f)) * inv_count;
    }
    StoreBf16<kVec>(dst + i, d);
  }
  if (threadIdx.x == 0) {
    if (own >= 0) {
      row_loss[row] = lse - (kCached ? cache[own] : src[own]);
    } else if (rank == 0 && (target < 0 || target >= vocab)) {
      row_loss[row] = NAN;
    }
  }
  cluster.barrier_wait();
}

template <bool kCached, int kVec>
std::string Launch(const float* logits, const int32_t* targets, int64_t rows, int64_t vocab,
                   float inv_count, const heuristics::CrossEntropySplit& split, void* d_logits,
                   float* row_loss, cudaStream_t stream) {
  auto kernel = CrossEntropyGradKernel<kCached, kVec>;
  // The most any launch of this kernel takes (the same value from every thread: no race with
  // another's launch), and the SM's largest shared-memory carveout, so that two CTAs fit.
  const int most = kCached ? int(heuristics::kSoloSegmentBytes) : 0;
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           most);
      e != cudaSuccess) {
    return std::string("CrossEntropyGrad: shared memory attribute: ") + cudaGetErrorString(e);
  }
  if (cudaError_t e = cudaFuncSetAttribute(kernel,
                                           cudaFuncAttributePreferredSharedMemoryCarveout,
                                           int(cudaSharedmemCarveoutMaxShared));
      e != cudaSuccess) {
    return std::string("CrossEntropyGrad: carveout attribute: ") + cudaGetErrorString(e);
  }
  if (split.cluster > 8) {  // a non-portable cluster size (up to 16 on sm_90)
    if (cudaError_t e = cudaFuncSetAttribute(
            kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
        e != cudaSuccess) {
      return std::string("CrossEntropyGrad: cluster size attribute: ") + cudaGetErrorString(e);
    }
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(unsigned(rows * split.cluster));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = kCached ? size_t(split.segment) * sizeof(float) : 0;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = unsigned(split.cluster);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  if (cudaError_t e = cudaLaunchKernelEx(&config, kernel, logits, targets, vocab,
                                         int(split.segment), inv_count,
                                         static_cast<__nv_bfloat16*>(d_logits), row_loss);
      e != cudaSuccess) {
    return std::string("CrossEntropyGrad launch: ") + cudaGetErrorString(e);
  }
  return "";
}

}  // namespace

std::string CrossEntropyGrad(const float* logits, const int32_t* targets, int64_t rows,
                             int64_t vocab, int64_t count, void* d_logits, float* row_loss,
                             cudaStream_t stream) {
  if (rows == 0) return "";
  const heuristics::CrossEntropySplit split = heuristics::SplitCrossEntropyRow(vocab);
  if (rows > int64_t(INT32_MAX) / split.cluster) {
    return "CrossEntropyGrad: " + std::to_string(rows) + " rows exceed the grid";
  }
  // The JAX definition divides by `count`; a reciprocal differs by at most an ulp before the
  // bf16 rounding (none for a power of two, such as the example's 16,384 tokens).
  const float c = 1.0f / float(count);
  // 16-byte loads (8-byte stores) need every row and segment to start so aligned.
  const bool vec = vocab % 4 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(d_logits) % 8 == 0;
  if (split.cached) {
    return vec ? Launch<true, 4>(logits, targets, rows, vocab, c, split, d_logits, row_loss,
                                 stream)
               : Launch<true, 1>(logits, targets, rows, vocab, c, split, d_logits, row_loss,
                                 stream);
  }
  return vec ? Launch<false, 4>(logits, targets, rows, vocab, c, split, d_logits, row_loss, stream)
             : Launch<false, 1>(logits, targets, rows, vocab, c, split, d_logits, row_loss, stream);
}

}  // namespace megamoe::xent

// Element-wise and bookkeeping kernels of the grouped SwiGLU MLP: see grouped_swiglu.h.
#include "ffi/impls/grouped_swiglu.h"
#include "ffi/common/swiglu_math.cuh"

#include <cuda_bf16.h>

#include <cub/block/block_scan.cuh>

namespace megamoe::grouped {
namespace {

constexpr int kVec = 8;  // bf16 per 16-byte access

std::string LastError(const char* what) {
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? std::string() : std::string(what) + ": " + cudaGetErrorString(err);
}

int GridFor(int64_t work, int threads) {
  int64_t blocks = (work + threads - 1) / threads;
  return int(blocks < 1 ? 1 : (blocks > 132 * 16 ? 132 * 16 : blocks));
}

// out[0] = 0, out[g + 1] = min(value(0) + ... + value(g), limit) for g < num_groups, by one block
// of kThreads threads (every thread calls it).
template <int kThreads, class Value>
__device__ void BlockInclusiveScan(int num_groups, Value value, int64_t limit,
                                   int32_t* __restrict__ out) {
  using Scan = cub::BlockScan<int64_t, kThreads>;
  __shared__ typename Scan::TempStorage temp;
  __shared__ int64_t carry;
  if (threadIdx.x == 0) {
    carry = 0;
    out[0] = 0;
  }
  __syncthreads();
  for (int base = 0; base < num_groups; base += kThreads) {
    const int g = base + threadIdx.x;
    int64_t v = g < num_groups ? value(g) : 0;
    int64_t inclusive, total;
    Scan(temp).InclusiveSum(v, inclusive, total);
    const int64_t c = carry;
    if (g < num_groups) out[g + 1] = int32_t(min(c + inclusive, limit));
    __syncthreads();
    if (threadIdx.x == 0) carry = c + total;
    __syncthreads();
  }
}

template <int kThreads>
__global__ void __launch_bounds__(kThreads) GroupOffsetsKernel(const int32_t* __restrict__ sizes,
                                                               int num_groups, int64_t rows,
                                                               int32_t* __restrict__ offsets) {
  BlockInclusiveScan<kThreads>(
      num_groups, [=](int g) { return int64_t(max(sizes[g], 0)); }, rows, offsets);
}

// Then each group's (clamped) row count rounded up to 128, scanned: the padded offsets.
template <int kThreads>
__global__ void __launch_bounds__(kThreads) PaddedOffsetsKernel(
    const int32_t* __restrict__ offsets, int num_groups, int32_t* __restrict__ padded) {
  BlockInclusiveScan<kThreads>(
      num_groups, [=](int g) { return int64_t(offsets[g + 1] - offsets[g] + 127) / 128 * 128; },
      INT32_MAX, padded);
}

__global__ void SwigluForwardKernel(const uint4* __restrict__ gate_up, uint4* __restrict__ h,
                                    int64_t f_vecs, const int32_t* __restrict__ offsets,
                                    int num_groups) {
  const int64_t total = int64_t(offsets[num_groups]) * f_vecs;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / f_vecs, c = i - r * f_vecs;
    const uint4 gv = gate_up[r * 2 * f_vecs + c];
    const uint4 uv = gate_up[r * 2 * f_vecs + f_vecs + c];
    const __nv_bfloat162* g2 = reinterpret_cast<const __nv_bfloat162*>(&gv);
    const __nv_bfloat162* u2 = reinterpret_cast<const __nv_bfloat162*>(&uv);
    uint4 hv;
    __nv_bfloat162* h2 = reinterpret_cast<__nv_bfloat162*>(&hv);
#pragma unroll
    for (int k = 0; k < kVec / 2; ++k) {
      const float2 g = __bfloat1622float2(g2[k]);
      const float2 u = __bfloat1622float2(u2[k]);
      h2[k] = __floats2bfloat162_rn(Swiglu(g.x, u.x), Swiglu(g.y, u.y));
    }
    h[i] = hv;
  }
}

__global__ void SwigluBackwardKernel(const uint4* __restrict__ dh, const uint4* __restrict__ gate_up,
                                     uint4* __restrict__ dgate_up, int64_t f_vecs,
                                     const int32_t* __restrict__ offsets, int num_groups) {
  const int64_t total = int64_t(offsets[num_groups]) * f_vecs;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / f_vecs, c = i - r * f_vecs;
    const uint4 dv = dh[i];
    const uint4 gv = gate_up[r * 2 * f_vecs + c];
    const uint4 uv = gate_up[r * 2 * f_vecs + f_vecs + c];
    const __nv_bfloat162* d2 = reinterpret_cast<const __nv_bfloat162*>(&dv);
    const __nv_bfloat162* g2 = reinterpret_cast<const __nv_bfloat162*>(&gv);
    const __nv_bfloat162* u2 = reinterpret_cast<const __nv_bfloat162*>(&uv);
    uint4 dgv, duv;
    __nv_bfloat162* dg2 = reinterpret_cast<__nv_bfloat162*>(&dgv);
    __nv_bfloat162* du2 = reinterpret_cast<__nv_bfloat162*>(&duv);
#pragma unroll
    for (int k = 0; k < kVec / 2; ++k) {
      const float2 d = __bfloat1622float2(d2[k]);
      const float2 g = __bfloat1622float2(g2[k]);
      const float2 u = __bfloat1622float2(u2[k]);
      float dgx, dux, dgy, duy;
      SwigluGrad(d.x, g.x, u.x, &dgx, &dux);
      SwigluGrad(d.y, g.y, u.y, &dgy, &duy);
      dg2[k] = __floats2bfloat162_rn(dgx, dgy);
      du2[k] = __floats2bfloat162_rn(dux, duy);
    }
    dgate_up[r * 2 * f_vecs + c] = dgv;
    dgate_up[r * 2 * f_vecs + f_vecs + c] = duv;
  }
}

__global__ void ZeroPaddingRowsKernel(uint4* __restrict__ out, int64_t rows, int64_t col_vecs,
                                      const int32_t* __restrict__ offsets, int num_groups) {
  const int64_t begin = int64_t(offsets[num_groups]) * col_vecs, end = rows * col_vecs;
  for (int64_t i = begin + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < end;
       i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = make_uint4(0, 0, 0, 0);
  }
}

__global__ void ZeroEmptyGroupsKernel(uint4* __restrict__ out, int64_t vecs_per_group,
                                      const int32_t* __restrict__ offsets) {
  const int g = blockIdx.y;
  if (offsets[g + 1] != offsets[g]) return;
  uint4* slab = out + int64_t(g) * vecs_per_group;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < vecs_per_group;
       i += int64_t(gridDim.x) * blockDim.x) {
    slab[i] = make_uint4(0, 0, 0, 0);
  }
}

}  // namespace

std::string GroupOffsets(const int32_t* group_sizes, int num_groups, int64_t rows,
                         int32_t* offsets, cudaStream_t stream) {
  GroupOffsetsKernel<256><<<1, 256, 0, stream>>>(group_sizes, num_groups, rows, offsets);
  return LastError("GroupOffsets launch");
}

std::string PaddedGroupOffsets(const int32_t* group_sizes, int num_groups, int64_t rows,
                               int32_t* offsets, int32_t* padded, cudaStream_t stream) {
  std::string err = GroupOffsets(group_sizes, num_groups, rows, offsets, stream);
  if (!err.empty()) return err;
  PaddedOffsetsKernel<256><<<1, 256, 0, stream>>>(offsets, num_groups, padded);
  return LastError("PaddedGroupOffsets launch");
}

std::string SwigluForward(const void* gate_up, void* h, int64_t rows, int64_t f,
                          const int32_t* offsets, int num_groups, cudaStream_t stream) {
  const int64_t f_vecs = f / kVec;
  SwigluForwardKernel<<<GridFor(rows * f_vecs, 256), 256, 0, stream>>>(
      static_cast<const uint4*>(gate_up), static_cast<uint4*>(h), f_vecs, offsets, num_groups);
  return LastError("SwigluForward launch");
}

std::string SwigluBackward(const void* dh, const void* gate_up, void* dgate_up, int64_t rows,
                           int64_t f, const int32_t* offsets, int num_groups,
                           cudaStream_t stream) {
  const int64_t f_vecs = f / kVec;
  SwigluBackwardKernel<<<GridFor(rows * f_vecs, 256), 256, 0, stream>>>(
      static_cast<const uint4*>(dh), static_cast<const uint4*>(gate_up),
      static_cast<uint4*>(dgate_up), f_vecs, offsets, num_groups);
  return LastError("SwigluBackward launch");
}

std::string ZeroPaddingRows(void* out, int64_t rows, int64_t cols, const int32_t* offsets,
                            int num_groups, cudaStream_t stream) {
  const int64_t col_vecs = cols / kVec;
  ZeroPaddingRowsKernel<<<GridFor(rows * col_vecs, 256), 256, 0, stream>>>(
      static_cast<uint4*>(out), rows, col_vecs, offsets, num_groups);
  return LastError("ZeroPaddingRows launch");
}

std::string ZeroEmptyGroups(void* out, int64_t elems_per_group, const int32_t* offsets,
                            int num_groups, cudaStream_t stream) {
  if (num_groups == 0) return "";
  const int64_t vecs = elems_per_group / kVec;
  dim3 grid(8, num_groups);
  ZeroEmptyGroupsKernel<<<grid, 256, 0, stream>>>(static_cast<uint4*>(out), vecs, offsets);
  return LastError("ZeroEmptyGroups launch");
}

}  // namespace megamoe::grouped

// Moving token rows between GPUs' memories: the warp row copy that the dispatch-shaped sends
// and gathers share, 16-byte vectors of bf16 / fp16 / fp32 elements with their fp32 unpacking
// (for the reductions on the way), and the load of data that peers wrote.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace megamoe::ep {

template <typename T>
struct Vec16 {
  static constexpr int kElems = 16 / sizeof(T);
};

__device__ __forceinline__ void Unpack(const uint4& v, float (&f)[4], const float*) {
  f[0] = __uint_as_float(v.x);
  f[1] = __uint_as_float(v.y);
  f[2] = __uint_as_float(v.z);
  f[3] = __uint_as_float(v.w);
}
__device__ __forceinline__ uint4 Pack(const float (&f)[4], const float*) {
  return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                    __float_as_uint(f[3]));
}

__device__ __forceinline__ void Unpack(const uint4& v, float (&f)[8], const __nv_bfloat16*) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = __bfloat1622float2(h[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}
__device__ __forceinline__ uint4 Pack(const float (&f)[8], const __nv_bfloat16*) {
  uint4 v;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return v;
}

__device__ __forceinline__ void Unpack(const uint4& v, float (&f)[8], const __half*) {
  const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = __half22float2(h[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}
__device__ __forceinline__ uint4 Pack(const float (&f)[8], const __half*) {
  uint4 v;
  __half2* h = reinterpret_cast<__half2*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
  return v;
}

// 16 bytes of quiet NaNs of element type T (what a timed-out EP call leaves in its outputs).
__device__ __forceinline__ uint4 NanVec16(const float*) {
  return make_uint4(0x7fc00000u, 0x7fc00000u, 0x7fc00000u, 0x7fc00000u);
}
__device__ __forceinline__ uint4 NanVec16(const __nv_bfloat16*) {
  return make_uint4(0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u);
}
__device__ __forceinline__ uint4 NanVec16(const __half*) {
  return make_uint4(0x7e007e00u, 0x7e007e00u, 0x7e007e00u, 0x7e007e00u);
}

// Grid-strided: every 16-byte vector of rows [0, rows) of `row_vecs` vectors each set to NaN.
template <typename T>
__device__ __forceinline__ void PoisonRows(T* out, long long rows, int row_vecs) {
  uint4* dst = reinterpret_cast<uint4*>(out);
  const uint4 nan = NanVec16(static_cast<const T*>(nullptr));
  const long long total = rows * row_vecs;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    dst[i] = nan;
  }
}

// Load that bypasses L1 (data written by peers: never served from a stale L1 line).
__device__ __forceinline__ uint4 LoadPeerWritten(const uint4* p) { return __ldcg(p); }

// The calling warp copies one row of `nvec` 16-byte vectors, read as load(c), to every
// destination: for_each_destination(store) calls store(dst) once per destination row `dst`
// (uint4*). kUnroll vectors per lane are in flight; each is read once whatever the number of
// destinations.
template <int kUnroll, class Load, class ForEachDestination>
__device__ __forceinline__ void WarpCopyRow(int nvec, Load load,
                                            ForEachDestination for_each_destination) {
  const int lane = threadIdx.x & 31;
  for (int c0 = 0; c0 < nvec; c0 += 32 * kUnroll) {
    uint4 buf[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = c0 + u * 32 + lane;
      if (c < nvec) buf[u] = load(c);
    }
    for_each_destination([&](uint4* dst) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int c = c0 + u * 32 + lane;
        if (c < nvec) dst[c] = buf[u];
      }
    });
  }
}

// Bit i set for the lanes i below the calling lane (a row's rank among its warp's lanes).
__device__ __forceinline__ unsigned LaneMaskLt() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

}  // namespace megamoe::ep

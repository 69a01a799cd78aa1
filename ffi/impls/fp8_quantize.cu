// Blockwise FP8 quantisation kernels (fp8_quantize.h).
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cfloat>

#include "ffi/common/fp8_quotient.cuh"
#include "ffi/common/launch_error.h"
#include "ffi/common/swiglu_math.cuh"
#include "ffi/common/warp_reduce.cuh"
#include "ffi/impls/fp8_quantize.h"
#include "ffi/layout/fp8_blocks.h"
#include "ffi/scheduler/group_offsets.h"

namespace megamoe::grouped {
namespace {

__device__ __forceinline__ uint8_t ToE4m3(float v) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

// Four values (lo.x, lo.y, hi.x, hi.y) divided by the block scale s (r = 1 / s) with `div`
// (WithQuotient: the same bytes as x / s), as e4m3 bytes in order.
template <class Div>
__device__ __forceinline__ uint32_t FourE4m3(float2 lo, float2 hi, float s, float r, Div div) {
  return uint32_t(ToE4m3(div(lo.x, s, r))) | (uint32_t(ToE4m3(div(lo.y, s, r))) << 8) |
         (uint32_t(ToE4m3(div(hi.x, s, r))) << 16) | (uint32_t(ToE4m3(div(hi.y, s, r))) << 24);
}

// 1x128 blocks are quantised by 8 threads, 16 consecutive values each: the block's amax is
// reduced over those 8 lanes (whole 8-lane groups are active or exit together, as blockDim is a
// multiple of 8), each thread stores 16 e4m3 bytes, the first the scale.
__device__ __forceinline__ void QuantizeSixteen(const float2 (&v)[8], bool pow2, int part,
                                                uint8_t* q, float* scale) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fmaxf(fabsf(v[i].x), fabsf(v[i].y)));
  const unsigned group_mask = 0xffu << (threadIdx.x % 32 / 8 * 8);
#pragma unroll
  for (int o = 4; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(group_mask, amax, o));
  const float s = Fp8BlockScale(amax, pow2), r = 1.0f / s;
  WithQuotient(pow2, DivByScaleHolds(s), [&](auto div) {
    uint32_t words[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) words[w] = FourE4m3(v[2 * w], v[2 * w + 1], s, r, div);
    *reinterpret_cast<uint4*>(q) = make_uint4(words[0], words[1], words[2], words[3]);
  });
  if (part == 0) *scale = s;
}

// This thread's row r, 128-column block b and part (0..7: columns b*128 + part*16 .. +16) when
// 8 threads take each block of a [rows, blocks_per_row * 128] matrix; false past the end.
__device__ __forceinline__ bool LocateSixteen(int64_t rows, int64_t blocks_per_row, int64_t* r,
                                              int64_t* b, int* part) {
  const int64_t thread = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t block = thread / 8;
  if (block >= rows * blocks_per_row) return false;
  *part = int(thread % 8);
  *r = block / blocks_per_row;
  *b = block - *r * blocks_per_row;
  return true;
}

// The max of `amax` over the 256 threads of the block (all of them must call it).
__device__ __forceinline__ float BlockAmax256(float amax) {
  __shared__ float warp_max[8];
  amax = WarpMax(amax);
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = warp_max[0];
#pragma unroll
  for (int i = 1; i < 8; ++i) amax = fmaxf(amax, warp_max[i]);
  return amax;
}

// x [rows, k] bf16: one 8-thread group per (row, 128-column block).
__global__ void QuantizeActivationsKernel(const __nv_bfloat16* __restrict__ x, int64_t rows,
                                          int64_t k, bool pow2, uint8_t* __restrict__ q,
                                          float* __restrict__ scale) {
  const int64_t kb_count = k / 128;
  int64_t r, kb;
  int part;
  if (!LocateSixteen(rows, kb_count, &r, &kb, &part)) return;
  const int64_t base = r * k + kb * 128 + part * 16;
  const uint4 raw[2] = {*reinterpret_cast<const uint4*>(x + base),
                        *reinterpret_cast<const uint4*>(x + base + 8)};
  const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(raw);
  float2 v[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = __bfloat1622float2(p[i]);
  QuantizeSixteen(v, pow2, part, q + base, scale + r * kb_count + kb);
}

// h = bf16(silu(gate) * up) from gate_up [rows, 2F] for rows < offsets[E], then h quantised in
// 1x128 blocks (the bf16 values, as quantize_rows(h) would); rows past offsets[E]: h zeroed,
// q and scale not written (no GEMM reads them).
__global__ void SwigluQuantizeKernel(const __nv_bfloat16* __restrict__ gate_up,
                                     __nv_bfloat16* __restrict__ h, int64_t rows, int64_t f,
                                     const int32_t* __restrict__ offsets, int num_groups,
                                     bool pow2, uint8_t* __restrict__ q,
                                     float* __restrict__ scale) {
  const int64_t fb_count = f / 128;
  int64_t r, fb;
  int part;
  if (!LocateSixteen(rows, fb_count, &r, &fb, &part)) return;
  const int64_t col = fb * 128 + part * 16;
  uint4* h_out = reinterpret_cast<uint4*>(h + r * f + col);
  if (r >= offsets[num_groups]) {  // padding row (the whole 8-lane group shares r)
    h_out[0] = h_out[1] = make_uint4(0u, 0u, 0u, 0u);
    return;
  }
  const uint4* g_in = reinterpret_cast<const uint4*>(gate_up + r * 2 * f + col);
  const uint4* u_in = reinterpret_cast<const uint4*>(gate_up + r * 2 * f + f + col);
  const uint4 h_raw[2] = {SwigluOctet(g_in[0], u_in[0]), SwigluOctet(g_in[1], u_in[1])};
  const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(h_raw);
  float2 v[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = __bfloat1622float2(h2[i]);
  h_out[0] = h_raw[0];
  h_out[1] = h_raw[1];
  QuantizeSixteen(v, pow2, part, q + r * f + col, scale + r * fb_count + fb);
}

// One block of 256 threads per 128 x 128 weight block, written in w's own layout (dgrad): thread
// t holds 64 values (8 x 8 columns of rows t / 16 + 16 i), reduces the block's amax, stores.
__global__ void __launch_bounds__(256) QuantizeWeightsDgradKernel(
    const __nv_bfloat16* __restrict__ w, int64_t k, int64_t n, bool pow2,
    uint8_t* __restrict__ q, float* __restrict__ scale) {
  const int64_t nb = blockIdx.x, kb = blockIdx.y, g = blockIdx.z;
  const int64_t nbs = n / 128, kbs = k / 128;
  const int t = threadIdx.x, oct = t % 16;
  const int64_t base = g * k * n + (kb * 128) * n + nb * 128 + oct * 8;
  uint4 raw[8];
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    raw[i] = *reinterpret_cast<const uint4*>(w + base + int64_t(t / 16 + 16 * i) * n);
    const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&raw[i]);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 v = __bfloat1622float2(p[j]);
      amax = fmaxf(amax, fmaxf(fabsf(v.x), fabsf(v.y)));
    }
  }
  const float s = Fp8BlockScale(BlockAmax256(amax), pow2), r = 1.0f / s;
  if (t == 0) scale[(g * nbs + nb) * kbs + kb] = s;  // [E, N/128, K/128]
  WithQuotient(pow2, DivByScaleHolds(s), [&](auto div) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&raw[i]);
      uint32_t words[2];
#pragma unroll
      for (int wi = 0; wi < 2; ++wi) {
        const float2 v0 = __bfloat1622float2(p[2 * wi]), v1 = __bfloat1622float2(p[2 * wi + 1]);
        words[wi] = FourE4m3(v0, v1, s, r, div);
      }
      *reinterpret_cast<uint2*>(q + base + int64_t(t / 16 + 16 * i) * n) =
          make_uint2(words[0], words[1]);
    }
  });
}

// The bf16 values a tile kernel quantises, 8 at a time (16 bytes): Load(r, col) = values
// [r, col .. col + 8) of a [rows, C] matrix.
struct MatrixValues {  // a matrix in memory
  const __nv_bfloat16* x;
  int64_t c;
  __device__ uint4 Load(int64_t r, int64_t col) const {
    return *reinterpret_cast<const uint4*>(x + r * c + col);
  }
};

struct GatheredRowsValues {  // row r = x[source[r]] of x [T, C]; zeros where source[r] < 0
  const __nv_bfloat16* x;
  const int32_t* source;
  int64_t c;
  __device__ uint4 Load(int64_t r, int64_t col) const {
    const int32_t s = source[r];
    return s < 0 ? make_uint4(0u, 0u, 0u, 0u)
                 : *reinterpret_cast<const uint4*>(x + int64_t(s) * c + col);
  }
};

struct SwigluValues {  // h [rows, F] = bf16(silu(gate) * up) of gate_up [rows, 2F]
  const __nv_bfloat16* gate_up;
  int64_t f;
  __device__ uint4 Load(int64_t r, int64_t col) const {
    const __nv_bfloat16* row = gate_up + r * 2 * f;
    return SwigluOctet(*reinterpret_cast<const uint4*>(row + col),
                       *reinterpret_cast<const uint4*>(row + f + col));
  }
};

struct DequantizedRowsValues {  // row r = bf16(q[r] * scale[r, block]) of e4m3 rows, 1x128 scales
  const uint8_t* q;
  int64_t stride;  // bytes per row of q (>= c, a multiple of 16)
  const float* scale;
  int64_t c;
  __device__ uint4 Load(int64_t r, int64_t col) const {
    const uint2 raw = *reinterpret_cast<const uint2*>(q + r * stride + col);
    const __nv_fp8_e4m3* v = reinterpret_cast<const __nv_fp8_e4m3*>(&raw);
    const float s = scale[r * (c / 128) + col / 128];
    uint4 out;
    __nv_bfloat162* o2 = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // fp32 products rounded once to bf16, as XLA's dequantize
      o2[i] = __floats2bfloat162_rn(__fmul_rn(float(v[2 * i]), s),
                                    __fmul_rn(float(v[2 * i + 1]), s));
    }
    return out;
  }
};

struct SwigluGradValues {  // dgate_up [rows, 2F] = the SwiGLU backward of dh [rows, F]
  const __nv_bfloat16* dh;
  const __nv_bfloat16* gate_up;
  int64_t f;
  __device__ uint4 Load(int64_t r, int64_t col) const {
    const bool up_half = col >= f;
    const int64_t j = up_half ? col - f : col;
    const __nv_bfloat16* row = gate_up + r * 2 * f;
    uint4 d_gate, d_up;
    SwigluGradOctet(*reinterpret_cast<const uint4*>(dh + r * f + j),
                    *reinterpret_cast<const uint4*>(row + j),
                    *reinterpret_cast<const uint4*>(row + f + j), &d_gate, &d_up);
    return up_half ? d_up : d_gate;
  }
};

// One block of 256 threads per (128-column block of the padded operand, 128 columns): finds its
// group, stages the group's (up to 128) rows in shared memory as (r, r + 1) pairs like the
// weight kernel below, reduces each column's amax over the rows (two threads per column) and
// stores the tile transposed, 128 contiguous bytes per column: the weight-gradient operand.
// kRows: also each row's 1x128 block (two threads per row), from the same staged values.
template <class Values, bool kRows>
__global__ void __launch_bounds__(256) QuantizeTileKernel(
    Values values, int64_t c, const int32_t* __restrict__ offsets,
    const int32_t* __restrict__ padded, int num_groups, int64_t length, bool pow2,
    uint8_t* __restrict__ q, float* __restrict__ scale, uint8_t* __restrict__ q_rows,
    float* __restrict__ scale_rows) {
  __shared__ __align__(16) __nv_bfloat162 pairs[64][128 + 4];  // [row / 2][column]
  __shared__ float half_max[2][128];
  __shared__ float col_scale[128];
  const int64_t col0 = blockIdx.y * 128;
  const int32_t pcol = int32_t(blockIdx.x) * 128;  // first padded column of this block
  if (pcol >= padded[num_groups]) return;
  const int g = GroupOfPaddedColumn(padded, num_groups, pcol);
  const int64_t row0 = offsets[g] + (pcol - padded[g]);
  const int valid = int(min(int64_t(128), int64_t(offsets[g + 1]) - row0));
  const int t = threadIdx.x;
  {
    const int oct = t % 16;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int pr = t / 16 + 16 * i;
      const uint4 lo_v = 2 * pr < valid ? values.Load(row0 + 2 * pr, col0 + oct * 8) : zero;
      const uint4 hi_v = 2 * pr + 1 < valid ? values.Load(row0 + 2 * pr + 1, col0 + oct * 8) : zero;
      const __nv_bfloat16* a = reinterpret_cast<const __nv_bfloat16*>(&lo_v);
      const __nv_bfloat16* b = reinterpret_cast<const __nv_bfloat16*>(&hi_v);
      __nv_bfloat162 interleaved[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) interleaved[j] = __halves2bfloat162(a[j], b[j]);
      uint4* dst = reinterpret_cast<uint4*>(&pairs[pr][oct * 8]);
      dst[0] = *reinterpret_cast<const uint4*>(&interleaved[0]);
      dst[1] = *reinterpret_cast<const uint4*>(&interleaved[4]);
    }
  }
  __syncthreads();
  if constexpr (kRows) {
    // Rows 2 pr and 2 pr + 1 (one pair entry), 32 columns q * 32 .. + 32 per thread: four
    // threads per pair, each writing 32 contiguous bytes (a whole sector) of both rows.
    const int pr = t / 4, q4 = t % 4;
    const __nv_bfloat162* src = &pairs[pr][q4 * 32];
    float amax_lo = 0.0f, amax_hi = 0.0f;
#pragma unroll 8
    for (int j = 0; j < 32; ++j) {
      const float2 v = __bfloat1622float2(src[j]);
      amax_lo = fmaxf(amax_lo, fabsf(v.x));
      amax_hi = fmaxf(amax_hi, fabsf(v.y));
    }
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) {
      amax_lo = fmaxf(amax_lo, __shfl_xor_sync(0xffffffffu, amax_lo, o));
      amax_hi = fmaxf(amax_hi, __shfl_xor_sync(0xffffffffu, amax_hi, o));
    }
    const float s_lo = Fp8BlockScale(amax_lo, pow2), s_hi = Fp8BlockScale(amax_hi, pow2);
    const float r_lo = 1.0f / s_lo, r_hi = 1.0f / s_hi;
    uint32_t lo[8], hi[8];
    WithQuotient(pow2, DivByScaleHolds(s_lo) && DivByScaleHolds(s_hi), [&](auto div) {
#pragma unroll
      for (int w = 0; w < 8; ++w) {
        uint32_t a = 0, b = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 v = __bfloat1622float2(src[4 * w + i]);
          a |= uint32_t(ToE4m3(div(v.x, s_lo, r_lo))) << (8 * i);
          b |= uint32_t(ToE4m3(div(v.y, s_hi, r_hi))) << (8 * i);
        }
        lo[w] = a;
        hi[w] = b;
      }
    });
    const int64_t kbs = c / 128;
    for (int parity = 0; parity < 2; ++parity) {
      const int row = 2 * pr + parity;
      if (row >= valid) break;
      const uint32_t* words = parity ? hi : lo;
      uint4* dst = reinterpret_cast<uint4*>(q_rows + (row0 + row) * c + col0 + q4 * 32);
      dst[0] = make_uint4(words[0], words[1], words[2], words[3]);
      dst[1] = make_uint4(words[4], words[5], words[6], words[7]);
      if (q4 == 0) scale_rows[(row0 + row) * kbs + col0 / 128] = parity ? s_hi : s_lo;
    }
  }
  {
    const int col = t % 128, half = t / 128;
    float amax = 0.0f;
#pragma unroll 8
    for (int pr = half * 32; pr < half * 32 + 32; ++pr) {
      const float2 v = __bfloat1622float2(pairs[pr][col]);
      amax = fmaxf(amax, fmaxf(fabsf(v.x), fabsf(v.y)));
    }
    half_max[half][col] = amax;
  }
  __syncthreads();
  if (t < 128) {
    const float s = Fp8BlockScale(fmaxf(half_max[0][t], half_max[1][t]), pow2);
    col_scale[t] = s;
    scale[int64_t(blockIdx.x) * c + col0 + t] = s;
  }
  __syncthreads();
  // Store transposed: lanes take 32 consecutive columns, each thread 32 rows (a whole 32-byte
  // sector of its column's output row), 2 rounds over the 4 x 128 (rows / 32, column) units.
#pragma unroll
  for (int round = 0; round < 2; ++round) {
    const int unit = round * 256 + t;
    const int col = unit % 128, quarter = unit / 128;
    const float s = col_scale[col], r = 1.0f / s;
    uint32_t words[8];
    WithQuotient(pow2, DivByScaleHolds(s), [&](auto div) {
#pragma unroll
      for (int wi = 0; wi < 8; ++wi) {
        const float2 v0 = __bfloat1622float2(pairs[quarter * 16 + wi * 2][col]);
        const float2 v1 = __bfloat1622float2(pairs[quarter * 16 + wi * 2 + 1][col]);
        words[wi] = FourE4m3(v0, v1, s, r, div);
      }
    });
    uint4* dst = reinterpret_cast<uint4*>(q + (col0 + col) * length + pcol + quarter * 32);
    dst[0] = make_uint4(words[0], words[1], words[2], words[3]);
    dst[1] = make_uint4(words[4], words[5], words[6], words[7]);
  }
}

// One block of 256 threads per 128 x 128 weight block; writes the block transposed. The tile is
// staged in shared memory as (k, k+1) pairs per column n, so that the transposed read is one
// conflict-free 4-byte load per two values (a warp reads 32 consecutive columns).
__global__ void __launch_bounds__(256) QuantizeWeightsKernel(const __nv_bfloat16* __restrict__ w,
                                                             int64_t k, int64_t n, bool pow2,
                                                             uint8_t* __restrict__ q,
                                                             float* __restrict__ scale) {
  __shared__ __align__(16) __nv_bfloat162 pairs[64][128 + 4];  // [k / 2][n]: (w[k][n], w[k + 1][n])
  const int64_t nb = blockIdx.x, kb = blockIdx.y, g = blockIdx.z;
  const int64_t nbs = n / 128, kbs = k / 128;
  const int t = threadIdx.x;
  const __nv_bfloat16* src = w + g * k * n + (kb * 128) * n + nb * 128;
  float amax = 0.0f;
  // Load: 64 row pairs x 16 column octets; thread t takes octet t % 16 of row pairs
  // t / 16 + 16 i (i < 4): two 16-byte loads (rows 2p and 2p + 1), interleaved into pairs.
  {
    const int oct = t % 16;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int pr = t / 16 + 16 * i;
      const uint4 lo = *reinterpret_cast<const uint4*>(src + int64_t(2 * pr) * n + oct * 8);
      const uint4 hi = *reinterpret_cast<const uint4*>(src + int64_t(2 * pr + 1) * n + oct * 8);
      const __nv_bfloat16* a = reinterpret_cast<const __nv_bfloat16*>(&lo);
      const __nv_bfloat16* b = reinterpret_cast<const __nv_bfloat16*>(&hi);
      __nv_bfloat162 interleaved[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        interleaved[j] = __halves2bfloat162(a[j], b[j]);
        amax = fmaxf(amax, fmaxf(fabsf(__bfloat162float(a[j])), fabsf(__bfloat162float(b[j]))));
      }
      uint4* dst = reinterpret_cast<uint4*>(&pairs[pr][oct * 8]);
      dst[0] = *reinterpret_cast<const uint4*>(&interleaved[0]);
      dst[1] = *reinterpret_cast<const uint4*>(&interleaved[4]);
    }
  }
  const float s = Fp8BlockScale(BlockAmax256(amax), pow2), r = 1.0f / s;
  if (t == 0) scale[(g * kbs + kb) * nbs + nb] = s;
  // Store transposed: output row (column n of w) has 128 k bytes = 8 chunks of 16; warp lanes
  // take 32 consecutive n, the 8 warps the 8 chunks, 4 rounds over the 128 columns.
  const int lane = t % 32, chunk = t / 32;
#pragma unroll
  for (int round = 0; round < 4; ++round) {
    const int col = round * 32 + lane;
    uint32_t words[4];
    WithQuotient(pow2, DivByScaleHolds(s), [&](auto div) {
#pragma unroll
      for (int wi = 0; wi < 4; ++wi) {
        const float2 v0 = __bfloat1622float2(pairs[chunk * 8 + wi * 2][col]);
        const float2 v1 = __bfloat1622float2(pairs[chunk * 8 + wi * 2 + 1][col]);
        words[wi] = FourE4m3(v0, v1, s, r, div);
      }
    });
    uint8_t* dst = q + g * n * k + (nb * 128 + col) * k + kb * 128 + chunk * 16;
    *reinterpret_cast<uint4*>(dst) = make_uint4(words[0], words[1], words[2], words[3]);
  }
}

}  // namespace

std::string QuantizeActivations1x128(const void* x, int64_t rows, int64_t k, bool pow2, void* q,
                                     float* scale, cudaStream_t stream) {
  const int64_t groups = rows * (k / 128);  // 8 threads each
  if (groups == 0) return "";
  const int threads = 256;
  const int64_t blocks = (groups * 8 + threads - 1) / threads;
  QuantizeActivationsKernel<<<dim3(unsigned(blocks)), threads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(x), rows, k, pow2, static_cast<uint8_t*>(q), scale);
  return LastLaunchError("QuantizeActivations1x128 launch");
}

std::string SwigluQuantize1x128(const void* gate_up, void* h, int64_t rows, int64_t f,
                                const int32_t* offsets, int num_groups, bool pow2, void* q,
                                float* scale, cudaStream_t stream) {
  const int64_t groups = rows * (f / 128);  // 8 threads each
  if (groups == 0) return "";
  const int threads = 256;
  const int64_t blocks = (groups * 8 + threads - 1) / threads;
  SwigluQuantizeKernel<<<dim3(unsigned(blocks)), threads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(gate_up), static_cast<__nv_bfloat16*>(h), rows, f,
      offsets, num_groups, pow2, static_cast<uint8_t*>(q), scale);
  return LastLaunchError("SwigluQuantize1x128 launch");
}

std::string QuantizeWeights128x128(const void* w, int64_t e, int64_t k, int64_t n, bool pow2,
                                   bool dgrad, void* q, float* scale, cudaStream_t stream) {
  if (e == 0 || k == 0 || n == 0) return "";
  dim3 grid(unsigned(n / 128), unsigned(k / 128), unsigned(e));
  auto kernel = dgrad ? QuantizeWeightsDgradKernel : QuantizeWeightsKernel;
  kernel<<<grid, 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(w), k, n, pow2,
                                   static_cast<uint8_t*>(q), scale);
  return LastLaunchError("QuantizeWeights128x128 launch");
}

template <class Values>
std::string LaunchQuantizeTiles(Values values, int64_t c, const int32_t* offsets,
                                const int32_t* padded, int num_groups, int64_t length, bool pow2,
                                void* q, float* scale, void* q_rows, float* scale_rows,
                                cudaStream_t stream) {
  if (length == 0 || c == 0) return "";
  dim3 grid(unsigned(length / 128), unsigned(c / 128));
  auto kernel = q_rows != nullptr ? QuantizeTileKernel<Values, true>
                                  : QuantizeTileKernel<Values, false>;
  kernel<<<grid, 256, 0, stream>>>(values, c, offsets, padded, num_groups, length, pow2,
                                   static_cast<uint8_t*>(q), scale,
                                   static_cast<uint8_t*>(q_rows), scale_rows);
  return LastLaunchError("QuantizeTileKernel launch");
}

std::string QuantizeWgradOperand128x1(const WgradRowsSource& from, int64_t c,
                                      const int32_t* offsets, const int32_t* padded,
                                      int num_groups, int64_t length, bool pow2, void* q,
                                      float* scale, void* q_rows, float* scale_rows,
                                      cudaStream_t stream) {
  auto launch = [&](auto values) {
    return LaunchQuantizeTiles(values, c, offsets, padded, num_groups, length, pow2, q, scale,
                               q_rows, scale_rows, stream);
  };
  const auto* bf16 = static_cast<const __nv_bfloat16*>(from.x);
  switch (from.kind) {
    case WgradRows::kMatrix:
      return launch(MatrixValues{bf16, c});
    case WgradRows::kGathered:
      return launch(GatheredRowsValues{bf16, from.source, c});
    case WgradRows::kSwiglu:
      return launch(SwigluValues{bf16, c});
    case WgradRows::kDequantized:
      return launch(DequantizedRowsValues{static_cast<const uint8_t*>(from.x), from.stride,
                                          from.x_scale, c});
  }
  return "QuantizeWgradOperand128x1: unknown WgradRows";
}

std::string SwigluBackwardQuantize(const void* dh, const void* gate_up, int64_t f,
                                   const int32_t* offsets, const int32_t* padded, int num_groups,
                                   int64_t length, bool pow2, void* q_rows, float* scale_rows,
                                   void* q, float* scale, cudaStream_t stream) {
  SwigluGradValues values{static_cast<const __nv_bfloat16*>(dh),
                          static_cast<const __nv_bfloat16*>(gate_up), f};
  return LaunchQuantizeTiles(values, 2 * f, offsets, padded, num_groups, length, pow2, q, scale,
                             q_rows, scale_rows, stream);
}

}  // namespace megamoe::grouped

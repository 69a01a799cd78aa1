// XLA FFI handlers (CPU) of the blockwise-FP8 ops: the contracts of the CUDA handlers
// (fp8_args.h) in plain loops, so that CI runs the FP8 path of jax_megamoe.backends.cuda_fp8
// end to end and checks its quantisation bit for bit against jax_megamoe.fp8. Same rules as the
// kernels: scale = max(amax * fp32(1/448), FLT_MIN) (pow2: rounded up to a power of two),
// q = e4m3(v / s) rounded to nearest even, saturating; the GEMM accumulates each 128-deep K
// block in fp32 and adds it scaled by a_scale * b_scale; SwiGLU in fp32, h rounded to bf16.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <vector>

#include "ffi/common/checks.h"
#include "ffi/common/fp8_scale.h"
#include "ffi/handlers/fp8_args.h"
#include "ffi/handlers/host_numerics.h"
#include "ffi/registry.h"

namespace megamoe::grouped {
namespace {

using host::Bf16ToFloat;
using host::E4m3ToFloat;
using host::FloatToBf16;
using host::FloatToE4m3;

// Quantises one block of `count` values, read as values(i), with one scale: store(i, e4m3
// byte) places each result (rows store in order, weights transposed). Returns the scale.
template <class Values, class Store>
float QuantizeBlock(Values values, int count, bool pow2, Store store) {
  float amax = 0.0f;
  for (int i = 0; i < count; ++i) amax = std::fmax(amax, std::fabs(values(i)));
  const float s = Fp8BlockScale(amax, pow2);
  for (int i = 0; i < count; ++i) store(i, FloatToE4m3(values(i) / s));
  return s;
}

void QuantizeRowsLoop(const uint16_t* x, int64_t n, int64_t k, bool pow2, uint8_t* q,
                      float* scale) {
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t kb = 0; kb < k / 128; ++kb) {
      const uint16_t* src = x + r * k + kb * 128;
      uint8_t* dst = q + r * k + kb * 128;
      scale[r * (k / 128) + kb] = QuantizeBlock([&](int i) { return Bf16ToFloat(src[i]); }, 128,
                                                pow2, [&](int i, uint8_t b) { dst[i] = b; });
    }
  }
}

ffi::Error QuantizeRowsImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q,
                            ffi::Result<ffi::AnyBuffer> scale, int64_t pow2) {
  int64_t n, k;
  MEGAMOE_RETURN_IF_ERROR(CheckQuantizeRows(x, q, scale, &n, &k));
  QuantizeRowsLoop(static_cast<const uint16_t*>(x.untyped_data()), n, k, pow2 != 0,
                   static_cast<uint8_t*>(q->untyped_data()),
                   static_cast<float*>(scale->untyped_data()));
  return ffi::Error::Success();
}

ffi::Error QuantizeWeightsImpl(ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> q,
                               ffi::Result<ffi::AnyBuffer> scale, int64_t pow2) {
  int64_t e, k, p;
  MEGAMOE_RETURN_IF_ERROR(CheckQuantizeWeights(w, q, scale, &e, &k, &p));
  const uint16_t* wv = static_cast<const uint16_t*>(w.untyped_data());
  uint8_t* qv = static_cast<uint8_t*>(q->untyped_data());
  float* sv = static_cast<float*>(scale->untyped_data());
  for (int64_t g = 0; g < e; ++g) {
    for (int64_t kb = 0; kb < k / 128; ++kb) {
      for (int64_t pb = 0; pb < p / 128; ++pb) {
        // Block element i = (kk, pp) = (i / 128, i % 128), written transposed: q[g, pp, kk].
        const uint16_t* src = wv + g * k * p + kb * 128 * p + pb * 128;
        uint8_t* dst = qv + g * p * k + pb * 128 * k + kb * 128;
        sv[(g * (k / 128) + kb) * (p / 128) + pb] = QuantizeBlock(
            [&](int i) { return Bf16ToFloat(src[int64_t(i / 128) * p + i % 128]); }, 128 * 128,
            pow2 != 0, [&](int i, uint8_t b) { dst[int64_t(i % 128) * k + i / 128] = b; });
      }
    }
  }
  return ffi::Error::Success();
}

ffi::Error SwigluQuantizeImpl(ffi::AnyBuffer gate_up, ffi::AnyBuffer group_sizes,
                              ffi::Result<ffi::AnyBuffer> h, ffi::Result<ffi::AnyBuffer> q,
                              ffi::Result<ffi::AnyBuffer> scale,
                              ffi::Result<ffi::AnyBuffer> workspace, int64_t pow2) {
  int64_t n, f, e;
  MEGAMOE_RETURN_IF_ERROR(CheckSwigluQuantize(gate_up, group_sizes, h, q, scale, &n, &f, &e));
  (void)workspace;
  const int64_t total = HostGroupOffsets(group_sizes, e, n)[e];
  const uint16_t* gu = static_cast<const uint16_t*>(gate_up.untyped_data());
  uint16_t* hv = static_cast<uint16_t*>(h->untyped_data());
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t j = 0; j < f; ++j) {
      const float g = Bf16ToFloat(gu[r * 2 * f + j]), u = Bf16ToFloat(gu[r * 2 * f + f + j]);
      hv[r * f + j] = r < total ? FloatToBf16(g * (1.0f / (1.0f + std::exp(-g))) * u) : 0;
    }
  }
  QuantizeRowsLoop(hv, total, f, pow2 != 0, static_cast<uint8_t*>(q->untyped_data()),
                   static_cast<float*>(scale->untyped_data()));
  return ffi::Error::Success();
}

ffi::Error GroupedGemmFp8Impl(ffi::AnyBuffer a_q, ffi::AnyBuffer a_scale,
                              ffi::AnyBuffer group_sizes, ffi::AnyBuffer b_q,
                              ffi::AnyBuffer b_scale, ffi::Result<ffi::AnyBuffer> d,
                              ffi::Result<ffi::AnyBuffer> workspace) {
  Fp8GemmDims g;
  MEGAMOE_RETURN_IF_ERROR(CheckGroupedGemmFp8(a_q, a_scale, group_sizes, b_q, b_scale, d, &g));
  (void)workspace;
  const uint8_t* av = static_cast<const uint8_t*>(a_q.untyped_data());
  const uint8_t* bv = static_cast<const uint8_t*>(b_q.untyped_data());
  const float* as = static_cast<const float*>(a_scale.untyped_data());
  const float* bs = static_cast<const float*>(b_scale.untyped_data());
  uint16_t* dv = static_cast<uint16_t*>(d->untyped_data());
  const std::vector<int64_t> off = HostGroupOffsets(group_sizes, g.e, g.n);
  const int64_t kbs = g.k / 128, pbs = g.p / 128;
  std::vector<float> a_row(g.k);
  for (int64_t grp = 0; grp < g.e; ++grp) {
    for (int64_t r = off[grp]; r < off[grp + 1]; ++r) {
      for (int64_t kk = 0; kk < g.k; ++kk) a_row[kk] = E4m3ToFloat(av[r * g.lda + kk]);
      for (int64_t c = 0; c < g.p; ++c) {
        const uint8_t* b_col = bv + (grp * g.p + c) * g.k;
        float acc = 0.0f;
        for (int64_t kb = 0; kb < kbs; ++kb) {
          float block = 0.0f;
          for (int64_t kk = kb * 128; kk < kb * 128 + 128; ++kk) block += a_row[kk] * E4m3ToFloat(b_col[kk]);
          acc += block * (as[r * kbs + kb] * bs[(grp * kbs + kb) * pbs + c / 128]);
        }
        dv[r * g.p + c] = FloatToBf16(acc);
      }
    }
  }
  for (int64_t r = off[g.e]; r < g.n; ++r) {
    for (int64_t c = 0; c < g.p; ++c) dv[r * g.p + c] = 0;
  }
  return ffi::Error::Success();
}

}  // namespace

// x -> (q, scale), attribute pow2.
#define MEGAMOE_QUANT_BINDING_CPU \
  ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attr<int64_t>("pow2")

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8QuantizeRowsCpu, QuantizeRowsImpl, MEGAMOE_QUANT_BINDING_CPU);
XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8QuantizeWeightsCpu, QuantizeWeightsImpl,
                              MEGAMOE_QUANT_BINDING_CPU);
#undef MEGAMOE_QUANT_BINDING_CPU
XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8SwigluQuantizeCpu, SwigluQuantizeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // gate_up
                                  .Arg<ffi::AnyBuffer>()  // group_sizes
                                  .Ret<ffi::AnyBuffer>()  // h
                                  .Ret<ffi::AnyBuffer>()  // h_q
                                  .Ret<ffi::AnyBuffer>()  // h_scale
                                  .Ret<ffi::AnyBuffer>()  // workspace (unused on CPU)
                                  .Attr<int64_t>("pow2"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedGemmFp8Cpu, GroupedGemmFp8Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // a_q
                                  .Arg<ffi::AnyBuffer>()  // a_scale
                                  .Arg<ffi::AnyBuffer>()  // group_sizes
                                  .Arg<ffi::AnyBuffer>()  // b_q
                                  .Arg<ffi::AnyBuffer>()  // b_scale
                                  .Ret<ffi::AnyBuffer>()  // d
                                  .Ret<ffi::AnyBuffer>()); // workspace (unused on CPU)

MEGAMOE_REGISTER_FFI("megamoe_fp8_quantize_rows", "cpu", Fp8QuantizeRowsCpu);
MEGAMOE_REGISTER_FFI("megamoe_fp8_quantize_weights", "cpu", Fp8QuantizeWeightsCpu);
MEGAMOE_REGISTER_FFI("megamoe_fp8_swiglu_quantize", "cpu", Fp8SwigluQuantizeCpu);
MEGAMOE_REGISTER_FFI("megamoe_grouped_gemm_fp8", "cpu", GroupedGemmFp8Cpu);

}  // namespace megamoe::grouped

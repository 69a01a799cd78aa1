// XLA FFI handlers (CPU) of the blockwise-FP8 ops: the contracts of the CUDA handlers
// (fp8_ops.h) in plain loops, so that CI runs the FP8 path of jax_megamoe.backends.cuda_fp8
// end to end and checks its quantisation bit for bit against jax_megamoe.fp8. Same rules as the
// kernels: scale = max(amax * fp32(1/448), FLT_MIN) (pow2: rounded up to a power of two),
// q = e4m3(v / s) rounded to nearest even, saturating; the GEMMs accumulate each 128-deep K
// block in fp32 and add it scaled by a_scale * b_scale; SwiGLU (and its backward) in fp32,
// rounded to bf16.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <vector>

#include "ffi/common/checks.h"
#include "ffi/common/host_numerics.h"
#include "ffi/handlers/fp8_ops.h"
#include "ffi/layout/fp8_blocks.h"
#include "ffi/registry.h"

namespace megamoe::grouped {
namespace {

using host::Bf16ToFloat;
using host::E4m3ToFloat;
using host::FloatToBf16;
using host::FloatToE4m3;

// As grouped_mlp_cpu.cc's (libm exp; the kernels use __expf, within the tests' tolerances).
float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// Quantises one block of `count` values, read as values(i), with one scale: store(i, e4m3
// byte) places each result (rows in order, weights transposed or not, wgrad operands down a
// column). Returns the scale.
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

// dgrad=0: q [E, P, K] (w transposed, the K-major operand of x @ w), scale [E, K/128, P/128];
// dgrad=1: q [E, K, P] as w is (the operand of dy @ w^T), scale [E, P/128, K/128]. Same block
// values either way: only where a byte or a scale is stored differs.
ffi::Error QuantizeWeightsImpl(ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> q,
                               ffi::Result<ffi::AnyBuffer> scale, int64_t pow2, int64_t dgrad) {
  int64_t e, k, p;
  MEGAMOE_RETURN_IF_ERROR(CheckQuantizeWeights(w, q, scale, dgrad != 0, &e, &k, &p));
  const uint16_t* wv = static_cast<const uint16_t*>(w.untyped_data());
  uint8_t* qv = static_cast<uint8_t*>(q->untyped_data());
  float* sv = static_cast<float*>(scale->untyped_data());
  const int64_t kbs = k / 128, pbs = p / 128;
  // Strides in q of w's k and p axes, and in scale of its k and p blocks.
  const int64_t qk = dgrad ? p : 1, qp = dgrad ? 1 : k;
  const int64_t sk = dgrad ? 1 : pbs, sp = dgrad ? kbs : 1;
  for (int64_t g = 0; g < e; ++g) {
    for (int64_t kb = 0; kb < kbs; ++kb) {
      for (int64_t pb = 0; pb < pbs; ++pb) {
        // Block element i = (kk, pp) = (i / 128, i % 128).
        const uint16_t* src = wv + g * k * p + kb * 128 * p + pb * 128;
        uint8_t* dst = qv + g * k * p + kb * 128 * qk + pb * 128 * qp;
        sv[g * kbs * pbs + kb * sk + pb * sp] = QuantizeBlock(
            [&](int i) { return Bf16ToFloat(src[int64_t(i / 128) * p + i % 128]); }, 128 * 128,
            pow2 != 0, [&](int i, uint8_t b) { dst[int64_t(i / 128) * qk + (i % 128) * qp] = b; });
      }
    }
  }
  return ffi::Error::Success();
}

// Rows x [n, c] bf16 of each group in 128 x 1 blocks per column, stored transposed and
// group-padded (the WgradOperand of cuda_fp8.py): group g's block b of column c ->
// q[c, p_g + 128 b + i] and scale[p_g / 128 + b, c]; the group's padding bytes are 0 so that the
// wgrad GEMM may read whole 128-column blocks.
void QuantizeWgradOperandLoop(const uint16_t* xv, int64_t c, const std::vector<int64_t>& off,
                              int64_t length, bool pow2, uint8_t* qv, float* sv) {
  const std::vector<int64_t> padded = HostPaddedOffsets(off);
  for (size_t g = 0; g + 1 < off.size(); ++g) {
    for (int64_t r0 = off[g], col0 = padded[g]; r0 < off[g + 1]; r0 += 128, col0 += 128) {
      const int valid = int(std::min<int64_t>(128, off[g + 1] - r0));
      for (int64_t col = 0; col < c; ++col) {
        uint8_t* dst = qv + col * length + col0;
        sv[col0 / 128 * c + col] = QuantizeBlock(
            [&](int i) { return Bf16ToFloat(xv[(r0 + i) * c + col]); }, valid, pow2,
            [&](int i, uint8_t b) { dst[i] = b; });
        std::fill(dst + valid, dst + 128, uint8_t{0});
      }
    }
  }
}

// h = bf16(silu(gate) * up) of gate_up row r's column j (F columns per half).
uint16_t SwigluBf16(const uint16_t* gate_up, int64_t r, int64_t j, int64_t f) {
  const float g = Bf16ToFloat(gate_up[r * 2 * f + j]), u = Bf16ToFloat(gate_up[r * 2 * f + f + j]);
  return FloatToBf16(g * Sigmoid(g) * u);
}

// The operand's n rows of c bf16 values, read through from (layout/wgrad_rows.h) as the CUDA
// quantiser reads them, into *rows: x itself for kMatrix, else *storage filled here. x_rows
// bounds kGathered's source entries, which the host checks here.
ffi::Error WgradRowsOnHost(const WgradRowsSource& from, int64_t n, int64_t c, int64_t x_rows,
                           std::vector<uint16_t>* storage, const uint16_t** rows) {
  const uint16_t* xv = static_cast<const uint16_t*>(from.x);
  if (from.kind == WgradRows::kMatrix) {
    *rows = xv;
    return ffi::Error::Success();
  }
  storage->assign(n * c, 0);
  uint16_t* out = storage->data();
  *rows = out;
  switch (from.kind) {
    case WgradRows::kMatrix:  // read in place, above
      break;
    case WgradRows::kGathered:
      for (int64_t r = 0; r < n; ++r) {
        const int32_t src = from.source[r];
        if (src >= x_rows) {
          return InvalidArgument("source[", r, "] = ", src, " is past x's ", x_rows, " rows");
        }
        if (src >= 0) std::copy(xv + src * c, xv + (src + 1) * c, out + r * c);
      }
      break;
    case WgradRows::kSwiglu:
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t j = 0; j < c; ++j) out[r * c + j] = SwigluBf16(xv, r, j, c);
      }
      break;
    case WgradRows::kDequantized: {
      const uint8_t* qv = static_cast<const uint8_t*>(from.x);
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t j = 0; j < c; ++j) {
          const float block_scale = from.x_scale[r * (c / 128) + j / 128];
          out[r * c + j] = FloatToBf16(E4m3ToFloat(qv[r * from.stride + j]) * block_scale);
        }
      }
      break;
    }
  }
  return ffi::Error::Success();
}

// The wgrad operand and, with rows, the 1x128 rows of the rows in use (as quantize_rows), of
// x's rows, x's rows gathered by source, the SwiGLU of x = gate_up, or x's e4m3 rows
// dequantised (WgradRows).
ffi::Error QuantizeWgradOperandImpl(ffi::AnyBuffer x, ffi::AnyBuffer x_scale,
                                    ffi::AnyBuffer source, ffi::AnyBuffer group_sizes,
                                    ffi::Result<ffi::AnyBuffer> q,
                                    ffi::Result<ffi::AnyBuffer> scale,
                                    ffi::Result<ffi::AnyBuffer> q_rows,
                                    ffi::Result<ffi::AnyBuffer> scale_rows,
                                    ffi::Result<ffi::AnyBuffer> workspace, int64_t pow2,
                                    int64_t rows, int64_t swiglu) {
  WgradRowsSource operand;
  int64_t n, c, e, length;
  MEGAMOE_RETURN_IF_ERROR(CheckQuantizeWgradOperand(x, x_scale, source, group_sizes, swiglu != 0,
                                                    rows != 0, q, scale, q_rows, scale_rows,
                                                    &operand, &n, &c, &e, &length));
  (void)workspace;
  std::vector<uint16_t> storage;  // the operand's rows where they are not x's
  const uint16_t* rows_in = nullptr;
  MEGAMOE_RETURN_IF_ERROR(
      WgradRowsOnHost(operand, n, c, x.dimensions()[0], &storage, &rows_in));
  const std::vector<int64_t> off = HostGroupOffsets(group_sizes, e, n);
  QuantizeWgradOperandLoop(rows_in, c, off, length, pow2 != 0,
                           static_cast<uint8_t*>(q->untyped_data()),
                           static_cast<float*>(scale->untyped_data()));
  if (rows != 0) {
    QuantizeRowsLoop(rows_in, off[e], c, pow2 != 0, static_cast<uint8_t*>(q_rows->untyped_data()),
                     static_cast<float*>(scale_rows->untyped_data()));
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
    for (int64_t j = 0; j < f; ++j) hv[r * f + j] = r < total ? SwigluBf16(gu, r, j, f) : 0;
  }
  QuantizeRowsLoop(hv, total, f, pow2 != 0, static_cast<uint8_t*>(q->untyped_data()),
                   static_cast<float*>(scale->untyped_data()));
  return ffi::Error::Success();
}

// dgate_up = the SwiGLU backward (as GroupedMlpBwdImpl, grouped_mlp_cpu.cc) rounded to bf16,
// over the rows in use, then quantised from those bf16 values as 1x128 rows and as a wgrad
// operand.
ffi::Error SwigluBackwardQuantizeImpl(ffi::AnyBuffer dh, ffi::AnyBuffer gate_up,
                                      ffi::AnyBuffer group_sizes,
                                      ffi::Result<ffi::AnyBuffer> q_rows,
                                      ffi::Result<ffi::AnyBuffer> scale_rows,
                                      ffi::Result<ffi::AnyBuffer> q,
                                      ffi::Result<ffi::AnyBuffer> scale,
                                      ffi::Result<ffi::AnyBuffer> workspace, int64_t pow2) {
  int64_t n, f, e, length;
  MEGAMOE_RETURN_IF_ERROR(CheckSwigluBackwardQuantize(dh, gate_up, group_sizes, q_rows,
                                                      scale_rows, q, scale, &n, &f, &e, &length));
  (void)workspace;
  const std::vector<int64_t> off = HostGroupOffsets(group_sizes, e, n);
  const int64_t total = off[e];
  const uint16_t* dhv = static_cast<const uint16_t*>(dh.untyped_data());
  const uint16_t* gu = static_cast<const uint16_t*>(gate_up.untyped_data());
  std::vector<uint16_t> dgu(total * 2 * f);
  for (int64_t r = 0; r < total; ++r) {
    for (int64_t j = 0; j < f; ++j) {
      const float g = Bf16ToFloat(gu[r * 2 * f + j]), u = Bf16ToFloat(gu[r * 2 * f + f + j]);
      const float d = Bf16ToFloat(dhv[r * f + j]), s = Sigmoid(g);
      dgu[r * 2 * f + j] = FloatToBf16(d * u * s * (1.0f + g * (1.0f - s)));
      dgu[r * 2 * f + f + j] = FloatToBf16(d * g * s);
    }
  }
  QuantizeRowsLoop(dgu.data(), total, 2 * f, pow2 != 0,
                   static_cast<uint8_t*>(q_rows->untyped_data()),
                   static_cast<float*>(scale_rows->untyped_data()));
  QuantizeWgradOperandLoop(dgu.data(), 2 * f, off, length, pow2 != 0,
                           static_cast<uint8_t*>(q->untyped_data()),
                           static_cast<float*>(scale->untyped_data()));
  return ffi::Error::Success();
}

// The data of a grouped FP8 GEMM's operands and result, as the loops read and write them.
struct Fp8GemmData {
  const uint8_t* a;
  const uint8_t* b;
  const float* a_scale;
  const float* b_scale;
  uint16_t* d;  // bf16 bits
  Fp8GemmData(const ffi::AnyBuffer& a_q, const ffi::AnyBuffer& a_s, const ffi::AnyBuffer& b_q,
              const ffi::AnyBuffer& b_s, ffi::Result<ffi::AnyBuffer>& out)
      : a(static_cast<const uint8_t*>(a_q.untyped_data())),
        b(static_cast<const uint8_t*>(b_q.untyped_data())),
        a_scale(static_cast<const float*>(a_s.untyped_data())),
        b_scale(static_cast<const float*>(b_s.untyped_data())),
        d(static_cast<uint16_t*>(out->untyped_data())) {}
};

ffi::Error GroupedGemmFp8Impl(ffi::AnyBuffer a_q, ffi::AnyBuffer a_scale,
                              ffi::AnyBuffer group_sizes, ffi::AnyBuffer b_q,
                              ffi::AnyBuffer b_scale, ffi::Result<ffi::AnyBuffer> d,
                              ffi::Result<ffi::AnyBuffer> workspace) {
  Fp8GemmDims g;
  MEGAMOE_RETURN_IF_ERROR(CheckGroupedGemmFp8(a_q, a_scale, group_sizes, b_q, b_scale, d, &g));
  (void)workspace;
  const Fp8GemmData o(a_q, a_scale, b_q, b_scale, d);
  const uint8_t *av = o.a, *bv = o.b;
  const float *as = o.a_scale, *bs = o.b_scale;
  uint16_t* dv = o.d;
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

// The 128 e4m3 bytes of each of `rows` rows (row stride `ld`) as floats, transposed:
// out[j * rows + r] = value j of row r.
void E4m3BlockTransposed(const uint8_t* q, int64_t rows, int64_t ld, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < 128; ++j) out[j * rows + r] = E4m3ToFloat(q[r * ld + j]);
  }
}

// d[g] = a_g^T b_g over group g's padded columns of two WgradOperands: each 128-column block
// summed in fp32 in column order (as GroupedGemmFp8Impl), then added scaled by
// a_scale * b_scale. The inner loop runs over b's channels, keeping that order per element
// while it vectorises.
ffi::Error GroupedWgradFp8Impl(ffi::AnyBuffer a_q, ffi::AnyBuffer a_scale,
                               ffi::AnyBuffer group_sizes, ffi::AnyBuffer b_q,
                               ffi::AnyBuffer b_scale, ffi::Result<ffi::AnyBuffer> d,
                               ffi::Result<ffi::AnyBuffer> workspace) {
  Fp8WgradDims g;
  MEGAMOE_RETURN_IF_ERROR(CheckGroupedWgradFp8(a_q, a_scale, group_sizes, b_q, b_scale, d, &g));
  (void)workspace;
  const Fp8GemmData o(a_q, a_scale, b_q, b_scale, d);
  const uint8_t *av = o.a, *bv = o.b;
  const float *as = o.a_scale, *bs = o.b_scale;
  uint16_t* dv = o.d;
  // The operands hold round_up(N, 128) rows' worth of columns before the groups' padding.
  const std::vector<int64_t> padded =
      HostPaddedOffsets(HostGroupOffsets(group_sizes, g.e, g.length - 128 * g.e));
  const int64_t ca = g.ca, cb = g.cb;
  std::vector<float> a_blk(128 * ca), b_blk(128 * cb), block(cb), acc(ca * cb);
  for (int64_t grp = 0; grp < g.e; ++grp) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t kb = padded[grp] / 128; kb < padded[grp + 1] / 128; ++kb) {
      E4m3BlockTransposed(av + kb * 128, ca, g.length, a_blk.data());
      E4m3BlockTransposed(bv + kb * 128, cb, g.length, b_blk.data());
      for (int64_t m = 0; m < ca; ++m) {
        std::fill(block.begin(), block.end(), 0.0f);
        for (int64_t j = 0; j < 128; ++j) {
          const float a = a_blk[j * ca + m];
          const float* b = b_blk.data() + j * cb;
          for (int64_t nn = 0; nn < cb; ++nn) block[nn] += a * b[nn];
        }
        const float sa = as[kb * ca + m];
        float* acc_row = acc.data() + m * cb;
        for (int64_t nn = 0; nn < cb; ++nn) acc_row[nn] += block[nn] * (sa * bs[kb * cb + nn]);
      }
    }
    for (int64_t i = 0; i < ca * cb; ++i) dv[grp * ca * cb + i] = FloatToBf16(acc[i]);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8QuantizeRowsCpu, QuantizeRowsImpl,
                              BindQuantizeRows(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8QuantizeWeightsCpu, QuantizeWeightsImpl,
                              BindQuantizeWeights(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8SwigluQuantizeCpu, SwigluQuantizeImpl,
                              BindSwigluQuantize(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8QuantizeWgradOperandCpu, QuantizeWgradOperandImpl,
                              BindQuantizeWgradOperand(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8SwigluBackwardQuantizeCpu, SwigluBackwardQuantizeImpl,
                              BindSwigluBackwardQuantize(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedGemmFp8Cpu, GroupedGemmFp8Impl,
                              BindGroupedGemmFp8(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedWgradFp8Cpu, GroupedWgradFp8Impl,
                              BindGroupedGemmFp8(ffi::Ffi::Bind()));

MEGAMOE_REGISTER_FFI("megamoe_fp8_quantize_rows", "cpu", Fp8QuantizeRowsCpu);
MEGAMOE_REGISTER_FFI("megamoe_fp8_quantize_weights", "cpu", Fp8QuantizeWeightsCpu);
MEGAMOE_REGISTER_FFI_WITH_SCRATCH("megamoe_fp8_swiglu_quantize", "cpu", Fp8SwigluQuantizeCpu,
                                  NoScratchBytes);
MEGAMOE_REGISTER_FFI_WITH_SCRATCH("megamoe_fp8_quantize_wgrad_operand", "cpu",
                                  Fp8QuantizeWgradOperandCpu, NoScratchBytes);
MEGAMOE_REGISTER_FFI_WITH_SCRATCH("megamoe_fp8_swiglu_backward_quantize", "cpu",
                                  Fp8SwigluBackwardQuantizeCpu, NoScratchBytes);
MEGAMOE_REGISTER_FFI_WITH_SCRATCH("megamoe_grouped_gemm_fp8", "cpu", GroupedGemmFp8Cpu,
                                  NoScratchBytes);
MEGAMOE_REGISTER_FFI_WITH_SCRATCH("megamoe_grouped_wgrad_fp8", "cpu", GroupedWgradFp8Cpu,
                                  NoScratchBytes);

}  // namespace megamoe::grouped

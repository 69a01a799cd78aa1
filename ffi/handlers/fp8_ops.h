// The blockwise-FP8 ops: contracts, XLA bindings and shape and dtype validation, shared by their
// CUDA handlers (fp8_quantize.cu, grouped_gemm_fp8.cu) and CPU handlers (fp8_cpu.cc). Contracts
// (the ops with group_sizes also return a scratch `workspace` u8[W], W as
// jax_megamoe._megamoe.scratch_bytes reports it):
//   quantize_rows     x [N, K] bf16 -> q [N, K] e4m3, scale [N, K/128] f32
//   quantize_weights  w [E, K, P] bf16 -> q [E, P, K] e4m3, scale [E, K/128, P/128] f32;
//                     dgrad=1: q [E, K, P] (w's layout), scale [E, P/128, K/128]
//   swiglu_quantize   gate_up [N, 2F] bf16, group_sizes [E] int32 -> h [N, F] bf16,
//                     q [N, F] e4m3, scale [N, F/128] f32
//   quantize_wgrad_operand  x [N, C] bf16, x_scale [0] f32, source [0] int32, group_sizes
//                     [E] int32 -> q [C, L] e4m3, scale [L/128, C] f32, L = WgradPaddedLength(N,
//                     E); with rows=1 also q_rows [N, C] e4m3, scale_rows [N, C/128] f32
//                     (1x128), else [0, C], [0, C/128]. The operand's N rows may instead be read
//                     from elsewhere (WgradRows), one way at a time: source [N] int32 (x [T, C];
//                     row r = x[source[r]], zeros where source[r] < 0; every entry < T, the
//                     caller's contract); swiglu=1 (x = gate_up [N, 2C]; row r = bf16(silu(gate)
//                     * up), as swiglu_quantize's h); or x e4m3 [N, S >= C] (S % 16 == 0: rows
//                     may carry more bytes) with x_scale [N, C/128] f32 (row r = bf16(x[r] *
//                     x_scale[r, block]), as cuda_fp8.dequantize_rows)
//   swiglu_backward_quantize  dh [N, F] bf16, gate_up [N, 2F] bf16, group_sizes [E] int32 ->
//                     dgate_up as q_rows [N, 2F] e4m3, scale_rows [N, 2F/128] f32 and as a wgrad
//                     operand q [2F, L] e4m3, scale [L/128, 2F] f32
//   grouped_gemm_fp8  a_q [N, L >= K] e4m3, a_scale [N, K/128] f32, group_sizes [E] int32,
//                     b_q [E, P, K] e4m3, b_scale [E, K/128, P/128] f32 -> d [N, P] bf16
//   grouped_wgrad_fp8 a_q [Ca, L] e4m3, a_scale [L/128, Ca] f32, group_sizes [E] int32,
//                     b_q [Cb, L] e4m3, b_scale [L/128, Cb] f32 -> d [E, Ca, Cb] bf16
// K, P, F, C, Ca and Cb multiples of 128; L a multiple of 16 (a row stride in bytes).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <utility>

#include "ffi/common/checks.h"
#include "ffi/handlers/grouped_mlp_op.h"
#include "ffi/layout/fp8_blocks.h"
#include "ffi/layout/wgrad_rows.h"

namespace megamoe::grouped {

inline ffi::Error CheckQuantOutputs(ffi::Result<ffi::AnyBuffer>& q,
                                    ffi::Result<ffi::AnyBuffer>& scale,
                                    std::initializer_list<int64_t> q_dims,
                                    std::initializer_list<int64_t> scale_dims) {
  MEGAMOE_RETURN_IF_ERROR(ExpectDtype("q", q->element_type(), ffi::DataType::F8E4M3FN));
  MEGAMOE_RETURN_IF_ERROR(ExpectDtype("scale", scale->element_type(), ffi::DataType::F32));
  MEGAMOE_RETURN_IF_ERROR(ExpectShape("q", q->dimensions(), q_dims));
  return ExpectShape("scale", scale->dimensions(), scale_dims);
}

inline ffi::Error CheckGroupSizes(const ffi::AnyBuffer& group_sizes, int64_t* e) {
  MEGAMOE_RETURN_IF_ERROR(
      ExpectDtype("group_sizes", group_sizes.element_type(), ffi::DataType::S32));
  auto sd = group_sizes.dimensions();
  if (sd.size() != 1 || sd[0] < 1) {
    return InvalidArgument("group_sizes must be [E] with E >= 1, got ", ShapeString(sd));
  }
  *e = sd[0];
  return ffi::Error::Success();
}

inline ffi::Error CheckQuantizeRows(const ffi::AnyBuffer& x, ffi::Result<ffi::AnyBuffer>& q,
                                    ffi::Result<ffi::AnyBuffer>& scale, int64_t* n, int64_t* k) {
  MEGAMOE_RETURN_IF_ERROR(ExpectDtype("x", x.element_type(), ffi::DataType::BF16));
  auto xd = x.dimensions();
  if (xd.size() != 2) return InvalidArgument("x must be [N, K], got ", ShapeString(xd));
  *n = xd[0];
  *k = xd[1];
  if (*k % 128 != 0) return InvalidArgument("FP8 rows need K % 128 == 0, got K=", *k);
  return CheckQuantOutputs(q, scale, {*n, *k}, {*n, *k / 128});
}

// *k, *p: w's own axes [E, K, P] (whichever layout q has).
inline ffi::Error CheckQuantizeWeights(const ffi::AnyBuffer& w, ffi::Result<ffi::AnyBuffer>& q,
                                       ffi::Result<ffi::AnyBuffer>& scale, bool dgrad, int64_t* e,
                                       int64_t* k, int64_t* p) {
  MEGAMOE_RETURN_IF_ERROR(ExpectDtype("w", w.element_type(), ffi::DataType::BF16));
  auto wd = w.dimensions();
  if (wd.size() != 3) return InvalidArgument("w must be [E, K, P], got ", ShapeString(wd));
  *e = wd[0];
  *k = wd[1];
  *p = wd[2];
  if (*k % 128 != 0 || *p % 128 != 0) {
    return InvalidArgument("FP8 weights need K and P multiples of 128, got w ", ShapeString(wd));
  }
  if (dgrad) return CheckQuantOutputs(q, scale, {*e, *k, *p}, {*e, *p / 128, *k / 128});
  return CheckQuantOutputs(q, scale, {*e, *p, *k}, {*e, *k / 128, *p / 128});
}

inline ffi::Error CheckSwigluQuantize(const ffi::AnyBuffer& gate_up,
                                      const ffi::AnyBuffer& group_sizes,
                                      ffi::Result<ffi::AnyBuffer>& h,
                                      ffi::Result<ffi::AnyBuffer>& q,
                                      ffi::Result<ffi::AnyBuffer>& scale, int64_t* n, int64_t* f,
                                      int64_t* e) {
  MEGAMOE_RETURN_IF_ERROR(ExpectDtype("gate_up", gate_up.element_type(), ffi::DataType::BF16));
  MEGAMOE_RETURN_IF_ERROR(CheckGroupSizes(group_sizes, e));
  auto gd = gate_up.dimensions();
  if (gd.size() != 2 || gd[1] % 256 != 0) {
    return InvalidArgument("gate_up must be [N, 2F] with F a multiple of 128, got ",
                           ShapeString(gd));
  }
  *n = gd[0];
  *f = gd[1] / 2;
  if (*n > INT32_MAX) return InvalidArgument("gate_up has ", *n, " rows, more than 2^31-1");
  MEGAMOE_RETURN_IF_ERROR(ExpectDtype("h", h->element_type(), ffi::DataType::BF16));
  MEGAMOE_RETURN_IF_ERROR(ExpectShape("h", h->dimensions(), {*n, *f}));
  return CheckQuantOutputs(q, scale, {*n, *f}, {*n, *f / 128});
}

// The weight-gradient operand of [N, C] rows (q, scale) and, where with_rows, their 1x128
// row quantisation (q_rows, scale_rows; else those are [0, C] and [0, C/128]).
inline ffi::Error CheckWgradOperandOutputs(int64_t n, int64_t c, int64_t e, bool with_rows,
                                           ffi::Result<ffi::AnyBuffer>& q,
                                           ffi::Result<ffi::AnyBuffer>& scale,
                                           ffi::Result<ffi::AnyBuffer>& q_rows,
                                           ffi::Result<ffi::AnyBuffer>& scale_rows,
                                           int64_t* length) {
  *length = WgradPaddedLength(n, e);
  if (*length > INT32_MAX) return InvalidArgument(n, " rows are too many for int32 offsets");
  MEGAMOE_RETURN_IF_ERROR(CheckQuantOutputs(q, scale, {c, *length}, {*length / 128, c}));
  const int64_t rows = with_rows ? n : 0;
  return CheckQuantOutputs(q_rows, scale_rows, {rows, c}, {rows, c / 128});
}

// quantize_wgrad_operand's operands and results; *rows: where its rows come from, and how to
// read them (layout/wgrad_rows.h).
inline ffi::Error CheckQuantizeWgradOperand(const ffi::AnyBuffer& x, const ffi::AnyBuffer& x_scale,
                                            const ffi::AnyBuffer& source,
                                            const ffi::AnyBuffer& group_sizes, bool swiglu,
                                            bool with_rows, ffi::Result<ffi::AnyBuffer>& q,
                                            ffi::Result<ffi::AnyBuffer>& scale,
                                            ffi::Result<ffi::AnyBuffer>& q_rows,
                                            ffi::Result<ffi::AnyBuffer>& scale_rows,
                                            WgradRowsSource* rows, int64_t* n, int64_t* c,
                                            int64_t* e, int64_t* length) {
  MEGAMOE_RETURN_IF_ERROR(ExpectDtype("x_scale", x_scale.element_type(), ffi::DataType::F32));
  MEGAMOE_RETURN_IF_ERROR(ExpectDtype("source", source.element_type(), ffi::DataType::S32));
  MEGAMOE_RETURN_IF_ERROR(CheckGroupSizes(group_sizes, e));
  auto xd = x.dimensions();
  auto sd = source.dimensions();
  auto scd = x_scale.dimensions();
  if (sd.size() != 1) return InvalidArgument("source must be [N] or [0], got ", ShapeString(sd));
  const bool gathered = sd[0] != 0;
  const bool dequantized = x.element_type() == ffi::DataType::F8E4M3FN;
  if (int(gathered) + int(swiglu) + int(dequantized) > 1) {
    return InvalidArgument("one of source (", sd[0], " rows), swiglu=", int(swiglu),
                           " and e4m3 x at a time");
  }
  if (dequantized) {
    if (xd.size() != 2 || xd[1] % 16 != 0) {
      return InvalidArgument("e4m3 x must be [N, S] with S a multiple of 16, got ",
                             ShapeString(xd));
    }
    if (scd.size() != 2 || scd[0] != xd[0] || scd[1] < 1 || scd[1] * 128 > xd[1]) {
      return InvalidArgument("x_scale must be [N=", xd[0], ", C/128] with C <= ", xd[1],
                             " for e4m3 x, got ", ShapeString(scd));
    }
    *rows = {WgradRows::kDequantized, x.untyped_data(), nullptr,
             static_cast<const float*>(x_scale.untyped_data()), xd[1]};
    *n = xd[0];
    *c = scd[1] * 128;
  } else {
    MEGAMOE_RETURN_IF_ERROR(ExpectDtype("x", x.element_type(), ffi::DataType::BF16));
    MEGAMOE_RETURN_IF_ERROR(ExpectShape("x_scale", scd, {0}));
    const int64_t per_value = swiglu ? 2 : 1;  // gate_up holds two values per operand column
    if (xd.size() != 2 || xd[1] % (128 * per_value) != 0) {
      return InvalidArgument(swiglu ? "gate_up (x with swiglu=1) must be [N, 2C]"
                                    : "x must be [N, C]",
                             " with C a multiple of 128, got ", ShapeString(xd));
    }
    *rows = {gathered ? WgradRows::kGathered : swiglu ? WgradRows::kSwiglu : WgradRows::kMatrix,
             x.untyped_data(),
             gathered ? static_cast<const int32_t*>(source.untyped_data()) : nullptr};
    *n = gathered ? sd[0] : xd[0];
    *c = xd[1] / per_value;
  }
  return CheckWgradOperandOutputs(*n, *c, *e, with_rows, q, scale, q_rows, scale_rows, length);
}

inline ffi::Error CheckSwigluBackwardQuantize(const ffi::AnyBuffer& dh,
                                              const ffi::AnyBuffer& gate_up,
                                              const ffi::AnyBuffer& group_sizes,
                                              ffi::Result<ffi::AnyBuffer>& q_rows,
                                              ffi::Result<ffi::AnyBuffer>& scale_rows,
                                              ffi::Result<ffi::AnyBuffer>& q,
                                              ffi::Result<ffi::AnyBuffer>& scale, int64_t* n,
                                              int64_t* f, int64_t* e, int64_t* length) {
  MEGAMOE_RETURN_IF_ERROR(ExpectDtype("dh", dh.element_type(), ffi::DataType::BF16));
  MEGAMOE_RETURN_IF_ERROR(ExpectDtype("gate_up", gate_up.element_type(), ffi::DataType::BF16));
  MEGAMOE_RETURN_IF_ERROR(CheckGroupSizes(group_sizes, e));
  auto hd = dh.dimensions();
  if (hd.size() != 2 || hd[1] % 128 != 0) {
    return InvalidArgument("dh must be [N, F] with F a multiple of 128, got ", ShapeString(hd));
  }
  *n = hd[0];
  *f = hd[1];
  MEGAMOE_RETURN_IF_ERROR(ExpectShape("gate_up", gate_up.dimensions(), {*n, 2 * *f}));
  return CheckWgradOperandOutputs(*n, 2 * *f, *e, true, q, scale, q_rows, scale_rows, length);
}

struct Fp8WgradDims {
  int64_t e = 0, ca = 0, cb = 0, length = 0;
};

inline ffi::Error CheckGroupedWgradFp8(const ffi::AnyBuffer& a_q, const ffi::AnyBuffer& a_scale,
                                       const ffi::AnyBuffer& group_sizes,
                                       const ffi::AnyBuffer& b_q, const ffi::AnyBuffer& b_scale,
                                       ffi::Result<ffi::AnyBuffer>& d, Fp8WgradDims* g) {
  MEGAMOE_RETURN_IF_ERROR(CheckGroupSizes(group_sizes, &g->e));
  auto ad = a_q.dimensions(), bd = b_q.dimensions();
  if (ad.size() != 2 || bd.size() != 2 || ad[1] != bd[1]) {
    return InvalidArgument("FP8 grouped wgrad got a_q ", ShapeString(ad), ", b_q ",
                           ShapeString(bd), ": expected a_q [Ca, L], b_q [Cb, L]");
  }
  g->ca = ad[0];
  g->cb = bd[0];
  g->length = ad[1];
  if (g->ca % 128 != 0 || g->cb % 128 != 0) {
    return InvalidArgument("FP8 wgrad needs Ca and Cb multiples of 128, got a_q ",
                           ShapeString(ad), ", b_q ", ShapeString(bd));
  }
  if (g->length % 128 != 0 || g->length < 128 * g->e || g->length > INT32_MAX) {
    return InvalidArgument("FP8 wgrad operands need L = round_up(N, 128) + 128 E columns (E=",
                           g->e, "), got L=", g->length);
  }
  MEGAMOE_RETURN_IF_ERROR(ExpectDtype("a_q", a_q.element_type(), ffi::DataType::F8E4M3FN));
  MEGAMOE_RETURN_IF_ERROR(ExpectDtype("b_q", b_q.element_type(), ffi::DataType::F8E4M3FN));
  MEGAMOE_RETURN_IF_ERROR(ExpectDtype("a_scale", a_scale.element_type(), ffi::DataType::F32));
  MEGAMOE_RETURN_IF_ERROR(ExpectDtype("b_scale", b_scale.element_type(), ffi::DataType::F32));
  MEGAMOE_RETURN_IF_ERROR(ExpectDtype("d", d->element_type(), ffi::DataType::BF16));
  MEGAMOE_RETURN_IF_ERROR(ExpectShape("a_scale", a_scale.dimensions(), {g->length / 128, g->ca}));
  MEGAMOE_RETURN_IF_ERROR(ExpectShape("b_scale", b_scale.dimensions(), {g->length / 128, g->cb}));
  return ExpectShape("d", d->dimensions(), {g->e, g->ca, g->cb});
}

struct Fp8GemmDims {
  int64_t e = 0, n = 0, lda = 0, p = 0, k = 0;
};

inline ffi::Error CheckGroupedGemmFp8(const ffi::AnyBuffer& a_q, const ffi::AnyBuffer& a_scale,
                                      const ffi::AnyBuffer& group_sizes,
                                      const ffi::AnyBuffer& b_q, const ffi::AnyBuffer& b_scale,
                                      ffi::Result<ffi::AnyBuffer>& d, Fp8GemmDims* g) {
  MEGAMOE_RETURN_IF_ERROR(CheckGroupSizes(group_sizes, &g->e));
  auto ad = a_q.dimensions(), bd = b_q.dimensions();
  if (ad.size() != 2 || bd.size() != 3) {
    return InvalidArgument("FP8 grouped GEMM got a_q ", ShapeString(ad), ", b_q ", ShapeString(bd),
                           ": expected a_q [N, L >= K], b_q [E, P, K]");
  }
  g->n = ad[0];
  g->lda = ad[1];
  g->p = bd[1];
  g->k = bd[2];
  if (g->k % 128 != 0) return InvalidArgument("FP8 needs K % 128 == 0, got K=", g->k);
  if (g->p % 128 != 0) return InvalidArgument("FP8 needs P % 128 == 0, got P=", g->p);
  if (g->lda < g->k || g->lda % 16 != 0) {
    return InvalidArgument("a_q rows must hold K=", g->k, " values in a multiple of 16 bytes, got a_q ",
                           ShapeString(ad));
  }
  if (g->n > INT32_MAX) return InvalidArgument("a_q has ", g->n, " rows, more than 2^31-1");
  MEGAMOE_RETURN_IF_ERROR(ExpectDtype("a_q", a_q.element_type(), ffi::DataType::F8E4M3FN));
  MEGAMOE_RETURN_IF_ERROR(ExpectDtype("b_q", b_q.element_type(), ffi::DataType::F8E4M3FN));
  MEGAMOE_RETURN_IF_ERROR(ExpectDtype("a_scale", a_scale.element_type(), ffi::DataType::F32));
  MEGAMOE_RETURN_IF_ERROR(ExpectDtype("b_scale", b_scale.element_type(), ffi::DataType::F32));
  MEGAMOE_RETURN_IF_ERROR(ExpectDtype("d", d->element_type(), ffi::DataType::BF16));
  MEGAMOE_RETURN_IF_ERROR(ExpectShape("b_q", bd, {g->e, g->p, g->k}));
  MEGAMOE_RETURN_IF_ERROR(ExpectShape("a_scale", a_scale.dimensions(), {g->n, g->k / 128}));
  MEGAMOE_RETURN_IF_ERROR(
      ExpectShape("b_scale", b_scale.dimensions(), {g->e, g->k / 128, g->p / 128}));
  return ExpectShape("d", d->dimensions(), {g->n, g->p});
}

// The bindings after the platform's context (none on CPU, the stream on CUDA): Bind...(b) with
// b = ffi::Ffi::Bind() or ffi::Ffi::Bind().Ctx<...>().
template <class Binding>
auto BindQuantizeRows(Binding&& b) {  // x -> (q, scale)
  return std::move(b).template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Attr<int64_t>("pow2");
}

template <class Binding>
auto BindQuantizeWeights(Binding&& b) {  // w -> (q, scale)
  return BindQuantizeRows(std::move(b)).template Attr<int64_t>("dgrad");
}

template <class Binding>
auto BindSwigluQuantize(Binding&& b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()    // gate_up
      .template Arg<ffi::AnyBuffer>()                   // group_sizes
      .template Ret<ffi::AnyBuffer>()                   // h
      .template Ret<ffi::AnyBuffer>()                   // h_q
      .template Ret<ffi::AnyBuffer>()                   // h_scale
      .template Ret<ffi::AnyBuffer>()                   // workspace
      .template Attr<int64_t>("pow2");
}

template <class Binding>
auto BindQuantizeWgradOperand(Binding&& b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()    // x
      .template Arg<ffi::AnyBuffer>()                   // x_scale
      .template Arg<ffi::AnyBuffer>()                   // source
      .template Arg<ffi::AnyBuffer>()                   // group_sizes
      .template Ret<ffi::AnyBuffer>()                   // q
      .template Ret<ffi::AnyBuffer>()                   // scale
      .template Ret<ffi::AnyBuffer>()                   // q_rows
      .template Ret<ffi::AnyBuffer>()                   // scale_rows
      .template Ret<ffi::AnyBuffer>()                   // workspace
      .template Attr<int64_t>("pow2")
      .template Attr<int64_t>("rows")
      .template Attr<int64_t>("swiglu");
}

template <class Binding>
auto BindSwigluBackwardQuantize(Binding&& b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()    // dh
      .template Arg<ffi::AnyBuffer>()                   // gate_up
      .template Arg<ffi::AnyBuffer>()                   // group_sizes
      .template Ret<ffi::AnyBuffer>()                   // q_rows
      .template Ret<ffi::AnyBuffer>()                   // scale_rows
      .template Ret<ffi::AnyBuffer>()                   // q
      .template Ret<ffi::AnyBuffer>()                   // scale
      .template Ret<ffi::AnyBuffer>()                   // workspace
      .template Attr<int64_t>("pow2");
}

// Both GEMMs (grouped_gemm_fp8, grouped_wgrad_fp8).
template <class Binding>
auto BindGroupedGemmFp8(Binding&& b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()    // a_q
      .template Arg<ffi::AnyBuffer>()                   // a_scale
      .template Arg<ffi::AnyBuffer>()                   // group_sizes
      .template Arg<ffi::AnyBuffer>()                   // b_q
      .template Arg<ffi::AnyBuffer>()                   // b_scale
      .template Ret<ffi::AnyBuffer>()                   // d
      .template Ret<ffi::AnyBuffer>();                  // workspace
}

}  // namespace megamoe::grouped

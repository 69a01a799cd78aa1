// The grouped SwiGLU MLP op (megamoe_grouped_mlp_fwd / _bwd): its contract, XLA binding and
// validation, shared by the CPU and CUDA handlers.
//
// Contract (all row-major):
//   x [N, H], group_sizes [E] int32 (sum <= N; rows past the sum are padding),
//   w_gate_up [E, H, 2F] (gate = [..., :F], up = [..., F:]), w_down [E, F, H];
//   forward results  y [N, H], gate_up [N, 2F], h [N, F], workspace u8[W]
//   backward args    dy [N, H], x, group_sizes, w_gate_up, w_down, gate_up, h
//   backward results dx [N, H], dw_gate_up [E, H, 2F], dw_down [E, F, H], dgate_up [N, 2F],
//                    dh [N, F], workspace u8[W]
// x, the weights, gate_up, h, dy and every floating result share one dtype. W: what
// jax_megamoe._megamoe.scratch_bytes reports for the target (handlers/scratch.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "ffi/common/checks.h"
#include "ffi/scheduler/group_offsets.h"

namespace megamoe::grouped {

struct MlpDims {
  int64_t n = 0, h = 0, f = 0, e = 0;
  ffi::DataType dtype = ffi::DataType::INVALID;
};

// Reads N, H, F, E from x, group_sizes, w_gate_up, w_down and checks their consistency.
inline ffi::Error ReadMlpDims(const ffi::AnyBuffer& x, const ffi::AnyBuffer& group_sizes,
                              const ffi::AnyBuffer& w_gate_up, const ffi::AnyBuffer& w_down,
                              MlpDims* d) {
  auto xd = x.dimensions();
  if (xd.size() != 2) return InvalidArgument("x_sorted must be [N, H], got ", ShapeString(xd));
  auto gd = group_sizes.dimensions();
  if (gd.size() != 1 || gd[0] < 1) {
    return InvalidArgument("group_sizes must be [E] with E >= 1, got ", ShapeString(gd));
  }
  MEGAMOE_RETURN_IF_ERROR(ExpectDtype("group_sizes", group_sizes.element_type(), ffi::DataType::S32));
  auto wd = w_gate_up.dimensions();
  if (wd.size() != 3 || wd[2] % 2 != 0) {
    return InvalidArgument("w_gate_up must be [E, H, 2F], got ", ShapeString(wd));
  }
  d->n = xd[0];
  d->h = xd[1];
  d->e = gd[0];
  d->f = wd[2] / 2;
  d->dtype = x.element_type();
  MEGAMOE_RETURN_IF_ERROR(ExpectShape("w_gate_up", wd, {d->e, d->h, 2 * d->f}));
  MEGAMOE_RETURN_IF_ERROR(ExpectShape("w_down", w_down.dimensions(), {d->e, d->f, d->h}));
  MEGAMOE_RETURN_IF_ERROR(ExpectDtype("w_gate_up", w_gate_up.element_type(), d->dtype));
  MEGAMOE_RETURN_IF_ERROR(ExpectDtype("w_down", w_down.element_type(), d->dtype));
  if (d->n > INT32_MAX) return InvalidArgument("x_sorted has ", d->n, " rows, more than 2^31-1");
  return ffi::Error::Success();
}

// The row range of each group on the host (CPU handlers), as the GPU's GroupOffsets computes it.
inline std::vector<int64_t> HostGroupOffsets(const ffi::AnyBuffer& group_sizes, int64_t e,
                                             int64_t n) {
  return HostGroupOffsets(static_cast<const int32_t*>(group_sizes.untyped_data()), e, n);
}

// The forward results y [N, H], gate_up [N, 2F], h [N, F], all in x's dtype.
inline ffi::Error CheckMlpFwdResults(const MlpDims& d, ffi::Result<ffi::AnyBuffer>& y,
                                     ffi::Result<ffi::AnyBuffer>& gate_up,
                                     ffi::Result<ffi::AnyBuffer>& h) {
  MEGAMOE_RETURN_IF_ERROR(ExpectShape("y", y->dimensions(), {d.n, d.h}));
  MEGAMOE_RETURN_IF_ERROR(ExpectShape("gate_up", gate_up->dimensions(), {d.n, 2 * d.f}));
  MEGAMOE_RETURN_IF_ERROR(ExpectShape("h", h->dimensions(), {d.n, d.f}));
  MEGAMOE_RETURN_IF_ERROR(ExpectDtype("y", y->element_type(), d.dtype));
  MEGAMOE_RETURN_IF_ERROR(ExpectDtype("gate_up", gate_up->element_type(), d.dtype));
  return ExpectDtype("h", h->element_type(), d.dtype);
}

// The backward's extra operands (dy, gate_up, h) and its results (dx, dw_gate_up, dw_down,
// dgate_up, dh): shapes as in the contract above, all in x's dtype.
inline ffi::Error CheckMlpBwdOperands(const MlpDims& d, const ffi::AnyBuffer& dy,
                                      const ffi::AnyBuffer& gate_up, const ffi::AnyBuffer& h,
                                      ffi::Result<ffi::AnyBuffer>& dx,
                                      ffi::Result<ffi::AnyBuffer>& dw_gate_up,
                                      ffi::Result<ffi::AnyBuffer>& dw_down,
                                      ffi::Result<ffi::AnyBuffer>& dgate_up,
                                      ffi::Result<ffi::AnyBuffer>& dh) {
  MEGAMOE_RETURN_IF_ERROR(ExpectShape("dy", dy.dimensions(), {d.n, d.h}));
  MEGAMOE_RETURN_IF_ERROR(ExpectShape("gate_up", gate_up.dimensions(), {d.n, 2 * d.f}));
  MEGAMOE_RETURN_IF_ERROR(ExpectShape("h", h.dimensions(), {d.n, d.f}));
  MEGAMOE_RETURN_IF_ERROR(ExpectShape("dx", dx->dimensions(), {d.n, d.h}));
  MEGAMOE_RETURN_IF_ERROR(ExpectShape("dw_gate_up", dw_gate_up->dimensions(), {d.e, d.h, 2 * d.f}));
  MEGAMOE_RETURN_IF_ERROR(ExpectShape("dw_down", dw_down->dimensions(), {d.e, d.f, d.h}));
  MEGAMOE_RETURN_IF_ERROR(ExpectShape("dgate_up", dgate_up->dimensions(), {d.n, 2 * d.f}));
  MEGAMOE_RETURN_IF_ERROR(ExpectShape("dh", dh->dimensions(), {d.n, d.f}));
  for (auto [name, t] : {std::pair{"dy", dy.element_type()}, {"gate_up", gate_up.element_type()},
                         {"h", h.element_type()}, {"dx", dx->element_type()},
                         {"dw_gate_up", dw_gate_up->element_type()},
                         {"dw_down", dw_down->element_type()},
                         {"dgate_up", dgate_up->element_type()}, {"dh", dh->element_type()}}) {
    MEGAMOE_RETURN_IF_ERROR(ExpectDtype(name, t, d.dtype));
  }
  return ffi::Error::Success();
}

// The bindings after the platform's context (none on CPU, the stream on CUDA): Bind...(b) with
// b = ffi::Ffi::Bind() or ffi::Ffi::Bind().Ctx<...>().
template <class Binding>
auto BindGroupedMlpFwd(Binding&& b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()  // x
      .template Arg<ffi::AnyBuffer>()                  // group_sizes
      .template Arg<ffi::AnyBuffer>()                  // w_gate_up
      .template Arg<ffi::AnyBuffer>()                  // w_down
      .template Ret<ffi::AnyBuffer>()                  // y
      .template Ret<ffi::AnyBuffer>()                  // gate_up
      .template Ret<ffi::AnyBuffer>()                  // h
      .template Ret<ffi::AnyBuffer>();                 // workspace
}

template <class Binding>
auto BindGroupedMlpBwd(Binding&& b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()  // dy
      .template Arg<ffi::AnyBuffer>()                  // x
      .template Arg<ffi::AnyBuffer>()                  // group_sizes
      .template Arg<ffi::AnyBuffer>()                  // w_gate_up
      .template Arg<ffi::AnyBuffer>()                  // w_down
      .template Arg<ffi::AnyBuffer>()                  // gate_up
      .template Arg<ffi::AnyBuffer>()                  // h
      .template Ret<ffi::AnyBuffer>()                  // dx
      .template Ret<ffi::AnyBuffer>()                  // dw_gate_up
      .template Ret<ffi::AnyBuffer>()                  // dw_down
      .template Ret<ffi::AnyBuffer>()                  // dgate_up (scratch)
      .template Ret<ffi::AnyBuffer>()                  // dh (scratch)
      .template Ret<ffi::AnyBuffer>();                 // workspace
}

}  // namespace megamoe::grouped

// The router's "balance" offsets op: contract, XLA binding and validation, shared by its CUDA
// handler (balance_offsets.cu) and CPU handler (balance_offsets_cpu.cc).
//   megamoe_balance_offsets  z [T, E] f32 -> offsets [E] f32, workspace u8[W]
// Attributes: top_k, temperature, sinkhorn_iterations, load_steps, step_first, step_decay
// (router.py's BALANCE_*; the definition: router._balancing_offsets). 1 <= top_k <= E <=
// kBalanceMaxExperts, T >= 1. W: jax_megamoe._ffi.scratch_bytes (0 on the CPU).
#pragma once

#include <cmath>
#include <cstdint>
#include <utility>

#include "ffi/common/checks.h"
#include "ffi/layout/balance_problem.h"

namespace megamoe::router {

inline ffi::Error CheckBalanceOffsets(const ffi::AnyBuffer& z,
                                      ffi::Result<ffi::AnyBuffer>& offsets, int64_t top_k,
                                      float temperature, int64_t sinkhorn_iterations,
                                      int64_t load_steps, float step_first, float step_decay,
                                      int64_t* rows, int64_t* experts,
                                      BalanceSettings* settings) {
  MEGAMOE_RETURN_IF_ERROR(ExpectDtype("z", z.element_type(), ffi::DataType::F32));
  auto zd = z.dimensions();
  if (zd.size() != 2 || zd[0] < 1 || zd[1] < 1 || zd[1] > kBalanceMaxExperts) {
    return InvalidArgument("z must be [T, E] with T >= 1 and 1 <= E <= ", kBalanceMaxExperts,
                           ", got ", ShapeString(zd));
  }
  *rows = zd[0];
  *experts = zd[1];
  if (*rows > INT32_MAX / *experts) {
    return InvalidArgument("z has ", *rows, " rows, more than 2^31 / E");
  }
  if (top_k < 1 || top_k > *experts) {
    return InvalidArgument("top_k must be in [1, E=", *experts, "], got ", top_k);
  }
  if (!(temperature > 0.0f) || !std::isfinite(temperature)) {
    return InvalidArgument("temperature must be positive and finite, got ", temperature);
  }
  if (sinkhorn_iterations < 0 || sinkhorn_iterations > 1000000 || load_steps < 0 ||
      load_steps > 1000000) {
    return InvalidArgument("sinkhorn_iterations and load_steps must be in [0, 1e6], got ",
                           sinkhorn_iterations, " and ", load_steps);
  }
  if (!std::isfinite(step_first) || !(step_decay > 0.0f) || !std::isfinite(step_decay)) {
    return InvalidArgument("step_first must be finite and step_decay positive, got ",
                           step_first, " and ", step_decay);
  }
  MEGAMOE_RETURN_IF_ERROR(
      ExpectDtype("offsets", offsets->element_type(), ffi::DataType::F32));
  MEGAMOE_RETURN_IF_ERROR(ExpectShape("offsets", offsets->dimensions(), {*experts}));
  *settings = {int(top_k), temperature, int(sinkhorn_iterations), int(load_steps), step_first,
               step_decay};
  return ffi::Error::Success();
}

template <class Binding>
auto BindBalanceOffsets(Binding&& b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()  // z
      .template Ret<ffi::AnyBuffer>()                 // offsets
      .template Ret<ffi::AnyBuffer>()                 // workspace
      .template Attr<int64_t>("top_k")
      .template Attr<float>("temperature")
      .template Attr<int64_t>("sinkhorn_iterations")
      .template Attr<int64_t>("load_steps")
      .template Attr<float>("step_first")
      .template Attr<float>("step_decay");
}

}  // namespace megamoe::router

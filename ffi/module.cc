// The nanobind module jax_megamoe._megamoe: hands the FFI handlers and build facts to Python.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "ffi/registry.h"

namespace nb = nanobind;

namespace megamoe {

std::vector<FfiTarget>& FfiTargets() {
  static std::vector<FfiTarget> targets;
  return targets;
}

}  // namespace megamoe

#ifndef MEGAMOE_CUDA_VERSION
#define MEGAMOE_CUDA_VERSION ""
#endif

NB_MODULE(_megamoe, m) {
  m.doc() = "jax_megamoe native extension: XLA FFI handlers for the MoE kernels";

  // [(name, platform, capsule)] for jax.ffi.register_ffi_target.
  m.def("ffi_targets", []() {
    nb::list out;
    for (const auto& t : megamoe::FfiTargets()) {
      out.append(nb::make_tuple(t.name, t.platform, nb::capsule(t.handler)));
    }
    return out;
  });

  m.def("build_info", []() {
    nb::dict info;
    nb::list archs;
    std::string csv = MEGAMOE_CUDA_ARCHS;
    size_t start = 0;
    while (start < csv.size()) {
      size_t end = csv.find(',', start);
      if (end == std::string::npos) end = csv.size();
      if (end > start) archs.append(csv.substr(start, end - start));
      start = end + 1;
    }
    info["cuda_archs"] = archs;
    info["cuda_version"] = std::string(MEGAMOE_CUDA_VERSION);
    info["jaxlib_version"] = std::string(MEGAMOE_JAXLIB_VERSION);
#ifdef MEGAMOE_WITH_CUTLASS
    info["cutlass"] = true;
#else
    info["cutlass"] = false;
#endif
    return info;
  });
}

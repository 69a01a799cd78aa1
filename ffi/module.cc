// The nanobind module jax_megamoe._megamoe: hands the FFI handlers and build facts to Python.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <algorithm>
#include <iterator>
#include <utility>

#include "ffi/common/launch_counts.h"
#include "ffi/gemm/engine_build_options.h"
#include "ffi/gemm/engine_profile_layout.h"
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

  // The scratch (`workspace` result) bytes FFI target `target` needs for `num_groups` groups:
  // the most any of its platforms' handlers needs (the CUDA one for the visible GPUs).
  m.def(
      "scratch_bytes",
      [](const std::string& target, int64_t num_groups) -> int64_t {
        if (num_groups < 1) {
          throw nb::value_error(("scratch_bytes: num_groups must be >= 1, got " +
                                 std::to_string(num_groups)).c_str());
        }
        bool found = false, has_scratch = false;
        size_t bytes = 0;
        for (const auto& t : megamoe::FfiTargets()) {
          if (t.name != target) continue;
          found = true;
          if (t.scratch_bytes == nullptr) continue;
          has_scratch = true;
          bytes = std::max(bytes, t.scratch_bytes(num_groups));
        }
        if (!found) {
          throw nb::value_error(("scratch_bytes: no FFI target " + target).c_str());
        }
        if (!has_scratch) {
          throw nb::value_error(("scratch_bytes: FFI target " + target +
                                 " has no scratch result").c_str());
        }
        return static_cast<int64_t>(bytes);
      },
      nb::arg("target"), nb::arg("num_groups"));

  // {name: launches so far} of the kernels a heuristic picks (ffi/common/launch_counts.h).
  m.def("launch_counts", []() {
    nb::dict counts;
    for (int i = 0; i < static_cast<int>(megamoe::CountedLaunch::kNumCounted); ++i) {
      counts[megamoe::kCountedLaunchNames[i]] =
          megamoe::LaunchCount(static_cast<megamoe::CountedLaunch>(i));
    }
    return counts;
  });

  // The layout of the fused kernel's cycle accounting (megamoe_fused_engine_profile's result):
  // {"rows", "slots", "cta": {name: slot}, "wg0" / "wg1": {name: slot}, "producer": {...}}.
  m.def("engine_profile_slots", []() {
    namespace prof = megamoe::fused::sm90::profile;
    nb::dict out, cta, producer;
    out["rows"] = static_cast<int>(prof::kMaxCtas);
    out["slots"] = static_cast<int>(prof::kSlots);
    cta["sm"] = static_cast<int>(prof::kSmId);
    cta["begin_ns"] = static_cast<int>(prof::kBeginNs);
    cta["producer_end_ns"] = static_cast<int>(prof::kProducerEndNs);
    cta["wg0_end_ns"] = static_cast<int>(prof::kWg0EndNs);
    cta["wg1_end_ns"] = static_cast<int>(prof::kWg1EndNs);
    out["cta"] = cta;
    // Each name beside its enumerator, so that reordering the enum cannot mislabel a slot.
    const std::pair<const char*, int> wg_slots[] = {
        {"job_wait", prof::kWgJobWait},       {"full_wait", prof::kWgFullWait},
        {"mainloop", prof::kWgMainloop},      {"epilogue", prof::kWgEpilogue},
        {"kblocks", prof::kWgKBlocks},        {"tiles", prof::kWgTiles},
        {"epi_other_wg", prof::kWgEpiBothWg}, {"epi_stage", prof::kWgEpiStage},
        {"epi_dst", prof::kWgEpiDst},         {"epi_store", prof::kWgEpiStore},
        {"epi_deferred", prof::kWgEpiDeferred}, {"deferred_tiles", prof::kWgDeferredTiles},
        {"deferred_parts", prof::kWgDeferredParts},
        {"deferred_parts_in_mainloop", prof::kWgDeferredPartsInMainloop},
        {"begin_clk", prof::kWgBeginClk},     {"end_clk", prof::kWgEndClk}};
    static_assert(std::size(wg_slots) == prof::kWgSlots, "a name for every warpgroup slot");
    for (int wg = 0; wg < 2; ++wg) {
      nb::dict d;
      for (const auto& [name, slot] : wg_slots) d[name] = (wg ? prof::kWg1 : prof::kWg0) + slot;
      out[wg ? "wg1" : "wg0"] = d;
    }
    const std::pair<const char*, int> producer_slots[] = {
        {"job_empty_wait", prof::kPJobEmptyWait}, {"empty_wait", prof::kPEmptyWait},
        {"rows_wait", prof::kPRowsWait},          {"tiles", prof::kPTiles},
        {"begin_clk", prof::kPBeginClk},          {"end_clk", prof::kPEndClk}};
    static_assert(std::size(producer_slots) == prof::kProducerSlots,
                  "a name for every producer slot");
    for (const auto& [name, slot] : producer_slots) producer[name] = prof::kProducer + slot;
    out["producer"] = producer;
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
    // The tile engine's options (engine_build_options.h); none without the CUDA kernels.
#ifdef MEGAMOE_WITH_CUDA
    constexpr bool kKernels = true;
#else
    constexpr bool kKernels = false;
#endif
    info["engine_profile"] = kKernels && MEGAMOE_ENGINE_PROFILE != 0;
    info["defer_l2_epilogue"] = kKernels && MEGAMOE_DEFER_L2_EPILOGUE != 0;
    info["defer_l1_epilogue"] = kKernels && MEGAMOE_DEFER_L1_EPILOGUE != 0;
    return info;
  });
}

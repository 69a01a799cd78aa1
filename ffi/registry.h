// One registry of FFI handlers: each op family's file adds its handlers here at static-init time,
// and the nanobind module hands them to Python, which registers them with XLA once.
#pragma once

#include <string>
#include <vector>

namespace megamoe {

struct FfiTarget {
  std::string name;      // XLA custom-call target name, e.g. "megamoe_grouped_swiglu_fwd"
  std::string platform;  // "cpu" or "CUDA"
  void* handler;         // XLA_FFI_Handler*
};

std::vector<FfiTarget>& FfiTargets();

// Registers at static-init time: `static RegisterFfiTarget r("name", "CUDA", Handler);`
struct RegisterFfiTarget {
  RegisterFfiTarget(const char* name, const char* platform, void* handler) {
    FfiTargets().push_back({name, platform, handler});
  }
};

}  // namespace megamoe

#define MEGAMOE_CONCAT_INNER(a, b) a##b
#define MEGAMOE_CONCAT(a, b) MEGAMOE_CONCAT_INNER(a, b)
// MEGAMOE_REGISTER_FFI(name, platform, handler): call once per handler in its .cc/.cu file.
#define MEGAMOE_REGISTER_FFI(name, platform, handler)                                        \
  static ::megamoe::RegisterFfiTarget MEGAMOE_CONCAT(megamoe_ffi_registration_, __LINE__)( \
      name, platform, reinterpret_cast<void*>(handler))

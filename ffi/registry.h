// One registry of FFI handlers: each op family's file adds its handlers here at static-init time,
// and the nanobind module hands them to Python, which registers them with XLA once. A handler
// with a scratch result (`workspace`) also registers what that scratch needs, so that Python asks
// C++ for the size (jax_megamoe._megamoe.scratch_bytes) instead of guessing it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace megamoe {

// Bytes of scratch a handler needs for `num_groups` expert groups.
using ScratchBytesFn = size_t (*)(int64_t num_groups);

struct FfiTarget {
  std::string name;      // XLA custom-call target name, e.g. "megamoe_grouped_mlp_fwd"
  std::string platform;  // "cpu" or "CUDA"
  void* handler;         // XLA_FFI_Handler*
  ScratchBytesFn scratch_bytes;  // nullptr: the handler has no scratch result
};

std::vector<FfiTarget>& FfiTargets();

// Registers at static-init time: `static RegisterFfiTarget r("name", "CUDA", Handler);`
struct RegisterFfiTarget {
  RegisterFfiTarget(const char* name, const char* platform, void* handler,
                    ScratchBytesFn scratch_bytes = nullptr) {
    FfiTargets().push_back({name, platform, handler, scratch_bytes});
  }
};

// The scratch of a CPU handler: it computes on the host and leaves the buffer unused.
inline size_t NoScratchBytes(int64_t) { return 0; }

}  // namespace megamoe

#define MEGAMOE_CONCAT_INNER(a, b) a##b
#define MEGAMOE_CONCAT(a, b) MEGAMOE_CONCAT_INNER(a, b)
// MEGAMOE_REGISTER_FFI(name, platform, handler): call once per handler in its .cc/.cu file.
#define MEGAMOE_REGISTER_FFI(name, platform, handler)                                        \
  static ::megamoe::RegisterFfiTarget MEGAMOE_CONCAT(megamoe_ffi_registration_, __LINE__)( \
      name, platform, reinterpret_cast<void*>(handler))
// The same for a handler with a scratch result: scratch_bytes (a ScratchBytesFn) is its size.
#define MEGAMOE_REGISTER_FFI_WITH_SCRATCH(name, platform, handler, scratch_bytes)            \
  static ::megamoe::RegisterFfiTarget MEGAMOE_CONCAT(megamoe_ffi_registration_, __LINE__)( \
      name, platform, reinterpret_cast<void*>(handler), scratch_bytes)

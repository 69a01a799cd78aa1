// XLA FFI handler megamoe_fused_engine_profile: reads back the tile engine's cycle accounting of
// the last fused kernel on this device (ffi/gemm/sm90_engine_profile.cuh). No operands; one
// result, uint32 [kMaxCtas, kSlots, 2]: each 64-bit slot of engine_profile_layout.h as its low
// and high words (so that Python needs no 64-bit mode). Only an extension built with
// JAX_MEGAMOE_ENGINE_PROFILE=ON keeps the counters; otherwise the call fails and says so.
// Used by benchmarks/fused_phases.py --engine-profile.
#include <cuda_runtime.h>

#include <string>

#include "ffi/common/checks.h"
#include "ffi/gemm/engine_profile_layout.h"
#include "ffi/impls/fused_moe.h"
#include "ffi/registry.h"

namespace megamoe::fused {
namespace {

namespace prof = sm90::profile;

ffi::Error FusedEngineProfile(cudaStream_t stream, ffi::Result<ffi::Buffer<ffi::U32>> out) {
  const auto dims = out->dimensions();
  if (dims.size() != 3 || dims[0] != prof::kMaxCtas || dims[1] != prof::kSlots || dims[2] != 2) {
    return ffi::Error::InvalidArgument(Message(
        "jax_megamoe fused engine profile: the result must be uint32 [", prof::kMaxCtas, ", ",
        prof::kSlots, ", 2]"));
  }
  const std::string err = ReadFusedEngineProfile(out->untyped_data(), out->size_bytes(), stream);
  if (!err.empty()) return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "jax_megamoe " + err);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace megamoe::fused

XLA_FFI_DEFINE_HANDLER_SYMBOL(MegamoeFusedEngineProfile, megamoe::fused::FusedEngineProfile,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::U32>>());

MEGAMOE_REGISTER_FFI("megamoe_fused_engine_profile", "CUDA", MegamoeFusedEngineProfile);

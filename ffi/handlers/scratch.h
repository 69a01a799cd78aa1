// The scratch buffer of a handler (its last result, `workspace`, u8[W]): int32 group offsets,
// then, 256-byte aligned, the scratch of the one GEMM that runs at a time (its per-group
// arguments and CUTLASS's workspace). One layout for every handler. Each CUDA handler states its
// need in one function, ScratchNeed(num_groups, sm_count), which both checks the buffer it gets
// (SplitScratch) and sizes it for Python (CudaScratchBytes, registered with the handler: see
// jax_megamoe._megamoe.scratch_bytes).
#pragma once

#include <cstddef>
#include <cstdint>

#include "ffi/common/align.h"
#include "ffi/common/checks.h"

#ifdef __CUDACC__
#include "ffi/common/device_info.h"
#endif

namespace megamoe {

struct ScratchNeed {
  int64_t offset_ints = 0;  // int32 group offsets
  size_t gemm_bytes = 0;    // GEMM scratch after them (0: no GEMM)
};

inline size_t ScratchBytes(const ScratchNeed& need) {
  const int64_t offsets = need.offset_ints * 4;
  return need.gemm_bytes == 0 ? size_t(offsets)
                              : size_t(AlignUp(offsets, 256)) + need.gemm_bytes;
}

struct Scratch {
  int32_t* offsets;
  void* gemm;         // the GEMM's part (nullptr without a GEMM)
  size_t gemm_bytes;  // every byte after the offsets' part
};

// Splits the scratch result after checking that it holds ScratchBytes(need).
inline ffi::Error SplitScratch(ffi::Result<ffi::AnyBuffer>& scratch, const ScratchNeed& need,
                               Scratch* out) {
  if (scratch->element_type() != ffi::DataType::U8 || scratch->dimensions().size() != 1) {
    return InvalidArgument("workspace must be a 1-D uint8 buffer, got ",
                           DataTypeName(scratch->element_type()),
                           ShapeString(scratch->dimensions()));
  }
  const size_t have = scratch->size_bytes();
  if (have < ScratchBytes(need)) {
    return InvalidArgument("workspace has ", have, " bytes, needs ", ScratchBytes(need), " (",
                           need.offset_ints, " int32 group offsets, then ", need.gemm_bytes,
                           " bytes of GEMM scratch on this GPU): size it with "
                           "jax_megamoe._ffi.scratch_bytes");
  }
  uint8_t* base = static_cast<uint8_t*>(scratch->untyped_data());
  const size_t gemm_at = need.gemm_bytes == 0 ? have : size_t(AlignUp(need.offset_ints * 4, 256));
  out->offsets = reinterpret_cast<int32_t*>(base);
  out->gemm = need.gemm_bytes == 0 ? nullptr : base + gemm_at;
  out->gemm_bytes = have - gemm_at;
  return ffi::Error::Success();
}

#ifdef __CUDACC__
// The registered scratch size (a ScratchBytesFn) of a CUDA handler whose need is Need: for the
// largest SM count among the visible GPUs (a GEMM's scratch grows with it: CUTLASS keeps its
// tensor maps per SM), so that it serves whichever GPU XLA runs the call on; 0 when no GPU is
// visible, where the handler cannot run.
template <ScratchNeed (*Need)(int64_t num_groups, int sm_count)>
size_t CudaScratchBytes(int64_t num_groups) {
  const int sm_count = MaxVisibleSmCount();
  return sm_count == 0 ? 0 : ScratchBytes(Need(num_groups, sm_count));
}
#endif

}  // namespace megamoe

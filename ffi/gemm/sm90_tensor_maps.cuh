// Host-side construction of the TMA descriptors (CUtensorMap) that the sm_90a MoE tile engine
// (ffi/gemm/sm90_moe_tile_engine.cuh) reads: bf16 (or e4m3) row-major matrices, 128B swizzle,
// boxes of 128 bytes (the widest a 128B-swizzled box may be) by box_rows rows; and FP8 scale
// matrices (fp32, no swizzle, boxes of 128 rows of one K-block). The driver's encoder comes
// through DriverEntryPoint, so nothing links against libcuda.
#pragma once

#include <cstdint>
#include <string>

#include <cuda.h>
#include <cuda_runtime.h>

#include "ffi/common/driver_entry_point.h"

namespace megamoe::fused {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                   const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                   const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                   CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

inline EncodeTiledFn GetEncodeTiled() {
  static const EncodeTiledFn fn = DriverEntryPoint<EncodeTiledFn>("cuTensorMapEncodeTiled");
  return fn;
}

// A [rows, cols] row-major matrix with row stride ld elements (bf16 when elem_bytes == 2, e4m3
// when 1), box {box_cols, box_rows}, 128B swizzle. "" or what failed.
inline std::string MakeRowMajorTensorMap(CUtensorMap* map, const void* base, int64_t rows,
                                         int64_t cols, int64_t ld, int box_cols, int box_rows,
                                         int elem_bytes = 2) {
  EncodeTiledFn encode = GetEncodeTiled();
  if (encode == nullptr) return "cuTensorMapEncodeTiled not available";
  const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(ld * elem_bytes)};
  const cuuint32_t box[2] = {cuuint32_t(box_cols), cuuint32_t(box_rows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = encode(
      map, elem_bytes == 2 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_UINT8, 2,
      const_cast<void*>(base), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return "cuTensorMapEncodeTiled failed (" + std::to_string(int(r)) + ") for [" +
           std::to_string(rows) + ", " + std::to_string(cols) + "] box {" +
           std::to_string(box_cols) + ", " + std::to_string(box_rows) + "}";
  }
  return "";
}

// FP8 scales, K-block-major: fp32 [blocks, pitch] (row b holds K-block b's scale of every row),
// `rows` of each in use, box {132 rows, 1 block}, no swizzle (the engine starts each box at a
// 16-byte aligned row: Sm90MoeTileEngine::kAScaleBox). "" or what failed.
inline std::string MakeScaleTensorMap(CUtensorMap* map, const void* base, int64_t blocks,
                                      int64_t pitch, int64_t rows) {
  EncodeTiledFn encode = GetEncodeTiled();
  if (encode == nullptr) return "cuTensorMapEncodeTiled not available";
  const cuuint64_t dims[2] = {cuuint64_t(rows), cuuint64_t(blocks)};
  const cuuint64_t strides[1] = {cuuint64_t(pitch * 4)};
  const cuuint32_t box[2] = {132, 1};  // Sm90MoeTileEngine<.., E4m3Operands>::kAScaleBox
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, const_cast<void*>(base),
                            dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return "cuTensorMapEncodeTiled failed (" + std::to_string(int(r)) + ") for scales [" +
           std::to_string(blocks) + ", " + std::to_string(rows) + "] (pitch " +
           std::to_string(pitch) + ")";
  }
  return "";
}

}  // namespace megamoe::fused

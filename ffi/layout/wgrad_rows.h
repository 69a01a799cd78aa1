// Where the rows of a weight-gradient operand come from (op quantize_wgrad_operand, contract in
// handlers/fp8_ops.h): CheckQuantizeWgradOperand decides the source once; the CUDA quantiser
// (impls/fp8_quantize.h) and the CPU twin read the rows through it. The operand's N rows of C
// values are, one way at a time:
//   kMatrix       x [N, C] bf16, row r = x[r]
//   kGathered     x [T, C] bf16, row r = x[source[r]], zeros where source[r] < 0
//   kSwiglu       x = gate_up [N, 2C] bf16, row r = bf16(silu(gate) * up)
//   kDequantized  x e4m3 [N, stride], row r = bf16(x[r, j] * x_scale[r, j / 128]) for j < C
#pragma once

#include <cstdint>

namespace megamoe::grouped {

enum class WgradRows { kMatrix, kGathered, kSwiglu, kDequantized };

struct WgradRowsSource {
  WgradRows kind = WgradRows::kMatrix;
  const void* x = nullptr;
  const int32_t* source = nullptr;  // kGathered
  const float* x_scale = nullptr;   // kDequantized
  int64_t stride = 0;               // kDequantized: x's row stride in bytes, >= C, % 16 == 0
};

}  // namespace megamoe::grouped

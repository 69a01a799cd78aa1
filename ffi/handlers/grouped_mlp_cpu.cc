// XLA FFI handlers (CPU) of the grouped SwiGLU MLP: the same contract as the CUDA handlers
// (grouped_mlp_op.h), in plain loops with fp32 accumulation, so CI exercises the binding.
// bf16 or float32; gate_up and h are rounded to the compute dtype as the CUDA path does.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ffi/common/checks.h"
#include "ffi/common/host_numerics.h"
#include "ffi/handlers/grouped_mlp_op.h"
#include "ffi/registry.h"

namespace megamoe::grouped {
namespace {

using host::Bf16ToFloat;
using host::FloatToBf16;

// A float view of a bf16 or f32 buffer (copied), and a writer back.
std::vector<float> Load(const ffi::AnyBuffer& b) {
  const size_t n = b.element_count();
  std::vector<float> out(n);
  if (b.element_type() == ffi::DataType::F32) {
    std::memcpy(out.data(), b.untyped_data(), n * 4);
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(b.untyped_data());
    for (size_t i = 0; i < n; ++i) out[i] = Bf16ToFloat(p[i]);
  }
  return out;
}

void Store(const std::vector<float>& v, ffi::Result<ffi::AnyBuffer>& b) {
  if (b->element_type() == ffi::DataType::F32) {
    std::memcpy(b->untyped_data(), v.data(), v.size() * 4);
  } else {
    uint16_t* p = static_cast<uint16_t*>(b->untyped_data());
    for (size_t i = 0; i < v.size(); ++i) p[i] = FloatToBf16(v[i]);
  }
}

// Rounds to the compute dtype (the CUDA path stores these intermediates in it).
float Round(float v, ffi::DataType t) {
  return t == ffi::DataType::F32 ? v : Bf16ToFloat(FloatToBf16(v));
}

float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

ffi::Error CheckCpuDtype(const MlpDims& d) {
  if (d.dtype != ffi::DataType::BF16 && d.dtype != ffi::DataType::F32) {
    return InvalidArgument("x_sorted has dtype ", DataTypeName(d.dtype),
                           ", expected bfloat16 or float32");
  }
  return ffi::Error::Success();
}

ffi::Error GroupedMlpFwdImpl(ffi::AnyBuffer x, ffi::AnyBuffer group_sizes,
                             ffi::AnyBuffer w_gate_up, ffi::AnyBuffer w_down,
                             ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> gate_up,
                             ffi::Result<ffi::AnyBuffer> h, ffi::Result<ffi::AnyBuffer> workspace) {
  MlpDims d;
  MEGAMOE_RETURN_IF_ERROR(ReadMlpDims(x, group_sizes, w_gate_up, w_down, &d));
  MEGAMOE_RETURN_IF_ERROR(CheckCpuDtype(d));
  MEGAMOE_RETURN_IF_ERROR(CheckMlpFwdResults(d, y, gate_up, h));
  (void)workspace;
  const int64_t N = d.n, H = d.h, F = d.f, E = d.e;
  const auto off = HostGroupOffsets(group_sizes, E, N);
  const auto xv = Load(x), wgu = Load(w_gate_up), wd = Load(w_down);
  std::vector<float> yv(N * H, 0.0f), guv(N * 2 * F, 0.0f), hv(N * F, 0.0f), acc;
  for (int64_t g = 0; g < E; ++g) {
    const float* wg = wgu.data() + g * H * 2 * F;
    const float* w2 = wd.data() + g * F * H;
    for (int64_t r = off[g]; r < off[g + 1]; ++r) {
      acc.assign(2 * F, 0.0f);
      for (int64_t k = 0; k < H; ++k) {
        const float a = xv[r * H + k];
        for (int64_t j = 0; j < 2 * F; ++j) acc[j] += a * wg[k * 2 * F + j];
      }
      for (int64_t j = 0; j < 2 * F; ++j) guv[r * 2 * F + j] = Round(acc[j], d.dtype);
      for (int64_t j = 0; j < F; ++j) {
        const float gt = guv[r * 2 * F + j], up = guv[r * 2 * F + F + j];
        hv[r * F + j] = Round(gt * Sigmoid(gt) * up, d.dtype);
      }
      acc.assign(H, 0.0f);
      for (int64_t k = 0; k < F; ++k) {
        const float a = hv[r * F + k];
        for (int64_t j = 0; j < H; ++j) acc[j] += a * w2[k * H + j];
      }
      std::copy(acc.begin(), acc.end(), yv.begin() + r * H);
    }
  }
  Store(yv, y);
  Store(guv, gate_up);
  Store(hv, h);
  return ffi::Error::Success();
}

ffi::Error GroupedMlpBwdImpl(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer group_sizes,
                             ffi::AnyBuffer w_gate_up, ffi::AnyBuffer w_down,
                             ffi::AnyBuffer gate_up, ffi::AnyBuffer h,
                             ffi::Result<ffi::AnyBuffer> dx,
                             ffi::Result<ffi::AnyBuffer> dw_gate_up,
                             ffi::Result<ffi::AnyBuffer> dw_down,
                             ffi::Result<ffi::AnyBuffer> dgate_up, ffi::Result<ffi::AnyBuffer> dh,
                             ffi::Result<ffi::AnyBuffer> workspace) {
  MlpDims d;
  MEGAMOE_RETURN_IF_ERROR(ReadMlpDims(x, group_sizes, w_gate_up, w_down, &d));
  MEGAMOE_RETURN_IF_ERROR(CheckCpuDtype(d));
  MEGAMOE_RETURN_IF_ERROR(
      CheckMlpBwdOperands(d, dy, gate_up, h, dx, dw_gate_up, dw_down, dgate_up, dh));
  (void)workspace;
  const int64_t N = d.n, H = d.h, F = d.f, E = d.e;
  const auto off = HostGroupOffsets(group_sizes, E, N);
  const auto dyv = Load(dy), xv = Load(x), wgu = Load(w_gate_up), wd = Load(w_down),
             guv = Load(gate_up), hv = Load(h);
  std::vector<float> dxv(N * H, 0.0f), dwgu(E * H * 2 * F, 0.0f), dwd(E * F * H, 0.0f),
      dguv(N * 2 * F, 0.0f), dhv(N * F, 0.0f);
  for (int64_t g = 0; g < E; ++g) {
    const float* wg = wgu.data() + g * H * 2 * F;
    const float* w2 = wd.data() + g * F * H;
    for (int64_t r = off[g]; r < off[g + 1]; ++r) {
      for (int64_t j = 0; j < F; ++j) {  // dh = dy @ w_down^T
        float s = 0.0f;
        for (int64_t k = 0; k < H; ++k) s += dyv[r * H + k] * w2[j * H + k];
        dhv[r * F + j] = Round(s, d.dtype);
      }
      for (int64_t j = 0; j < F; ++j) {  // SwiGLU backward
        const float gt = guv[r * 2 * F + j], up = guv[r * 2 * F + F + j], s = Sigmoid(gt);
        const float dd = dhv[r * F + j];
        dguv[r * 2 * F + j] = Round(dd * up * s * (1.0f + gt * (1.0f - s)), d.dtype);
        dguv[r * 2 * F + F + j] = Round(dd * gt * s, d.dtype);
      }
      for (int64_t k = 0; k < H; ++k) {  // dx = dgate_up @ w_gate_up^T
        float s = 0.0f;
        for (int64_t j = 0; j < 2 * F; ++j) s += dguv[r * 2 * F + j] * wg[k * 2 * F + j];
        dxv[r * H + k] = s;
      }
    }
    // Weight gradients, K-grouped over the group's rows, fp32 accumulation.
    float* dwg = dwgu.data() + g * H * 2 * F;
    float* dw2 = dwd.data() + g * F * H;
    for (int64_t r = off[g]; r < off[g + 1]; ++r) {
      for (int64_t k = 0; k < H; ++k) {
        const float a = xv[r * H + k];
        for (int64_t j = 0; j < 2 * F; ++j) dwg[k * 2 * F + j] += a * dguv[r * 2 * F + j];
      }
      for (int64_t k = 0; k < F; ++k) {
        const float a = hv[r * F + k];
        for (int64_t j = 0; j < H; ++j) dw2[k * H + j] += a * dyv[r * H + j];
      }
    }
  }
  Store(dxv, dx);
  Store(dwgu, dw_gate_up);
  Store(dwd, dw_down);
  Store(dguv, dgate_up);
  Store(dhv, dh);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedMlpFwdCpu, GroupedMlpFwdImpl,
                              BindGroupedMlpFwd(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedMlpBwdCpu, GroupedMlpBwdImpl,
                              BindGroupedMlpBwd(ffi::Ffi::Bind()));

MEGAMOE_REGISTER_FFI_WITH_SCRATCH("megamoe_grouped_mlp_fwd", "cpu", GroupedMlpFwdCpu,
                                  NoScratchBytes);
MEGAMOE_REGISTER_FFI_WITH_SCRATCH("megamoe_grouped_mlp_bwd", "cpu", GroupedMlpBwdCpu,
                                  NoScratchBytes);

}  // namespace megamoe::grouped

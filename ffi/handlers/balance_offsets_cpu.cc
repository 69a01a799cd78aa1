// XLA FFI handler (CPU) of the router's "balance" offsets: the contract of
// balance_offsets_ops.h in plain loops, the steps of router._balancing_offsets (Sinkhorn on
// exp(z / temperature - row max), then the load steps), so that CI runs router.py's kernel path
// end to end. libm exp and log; sums in row order (the kernel's orders differ: the offsets agree
// to float32 rounding, the choices they make nearly everywhere).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "ffi/common/checks.h"
#include "ffi/handlers/balance_offsets_ops.h"
#include "ffi/registry.h"

namespace megamoe::router {
namespace {

constexpr float kTiny = 1e-30f;  // router._sinkhorn_exp's floor

// The k-th largest of a row as router._kth_largest: k - 1 times remove the maximum (ties
// together), then the maximum of what is left.
float KthLargest(std::vector<float> row, int k) {
  const float none = -std::numeric_limits<float>::infinity();
  float m = none;
  for (int round = 0; round < k; ++round) {
    m = *std::max_element(row.begin(), row.end());
    for (float& x : row) x = x >= m ? none : x;
  }
  return m;
}

ffi::Error BalanceOffsetsImpl(ffi::AnyBuffer z_buf, ffi::Result<ffi::AnyBuffer> offsets,
                              ffi::Result<ffi::AnyBuffer> /*workspace*/, int64_t top_k,
                              float temperature, int64_t sinkhorn_iterations, int64_t load_steps,
                              float step_first, float step_decay) {
  int64_t rows, experts;
  BalanceSettings s;
  MEGAMOE_RETURN_IF_ERROR(CheckBalanceOffsets(z_buf, offsets, top_k, temperature,
                                              sinkhorn_iterations, load_steps, step_first,
                                              step_decay, &rows, &experts, &s));
  const float* z = static_cast<const float*>(z_buf.untyped_data());
  const int64_t e_count = experts;
  const float col_target = float(double(rows) * s.top_k / double(experts));

  std::vector<float> kernel(rows * e_count);  // exp(z / temperature - row max)
  for (int64_t r = 0; r < rows; ++r) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t e = 0; e < e_count; ++e) m = std::fmax(m, z[r * e_count + e] / s.temperature);
    for (int64_t e = 0; e < e_count; ++e) {
      kernel[r * e_count + e] = std::exp(z[r * e_count + e] / s.temperature - m);
    }
  }
  std::vector<float> v(e_count, 1.0f), col(e_count);
  for (int it = 0; it < s.sinkhorn_iterations; ++it) {
    std::fill(col.begin(), col.end(), 0.0f);
    for (int64_t r = 0; r < rows; ++r) {
      float dot = 0.0f;
      for (int64_t e = 0; e < e_count; ++e) dot += kernel[r * e_count + e] * v[e];
      const float u = float(s.top_k) / std::fmax(dot, kTiny);
      for (int64_t e = 0; e < e_count; ++e) col[e] += kernel[r * e_count + e] * u;
    }
    for (int64_t e = 0; e < e_count; ++e) v[e] = col_target / std::fmax(col[e], kTiny);
  }
  std::vector<float> b(e_count), best_b(e_count), load(e_count), row(e_count);
  for (int64_t e = 0; e < e_count; ++e) b[e] = best_b[e] = s.temperature * std::log(v[e]);
  float best = std::numeric_limits<float>::infinity();
  for (int step = 0; step < s.load_steps; ++step) {
    std::fill(load.begin(), load.end(), 0.0f);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t e = 0; e < e_count; ++e) row[e] = z[r * e_count + e] + b[e];
      const float kth = KthLargest(row, s.top_k);
      for (int64_t e = 0; e < e_count; ++e) load[e] += row[e] >= kth ? 1.0f : 0.0f;
    }
    float peak = -std::numeric_limits<float>::infinity();
    for (float& x : load) peak = std::fmax(peak, x /= col_target);
    const bool better = peak < best;
    if (better) best_b = b, best = peak;
    const float size = s.step_first * std::pow(s.step_decay, float(step));
    for (int64_t e = 0; e < e_count; ++e) b[e] -= size * std::log(std::fmax(load[e], 0.25f));
  }
  std::copy(best_b.begin(), best_b.end(), static_cast<float*>(offsets->untyped_data()));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BalanceOffsetsCpu, BalanceOffsetsImpl,
                              BindBalanceOffsets(ffi::Ffi::Bind()));

MEGAMOE_REGISTER_FFI_WITH_SCRATCH("megamoe_balance_offsets", "cpu", BalanceOffsetsCpu,
                                  NoScratchBytes);

}  // namespace megamoe::router

// Host-side number formats of the CPU handlers: bf16 and e4m3 (FP8, "fn": no infinities, NaN =
// 0x7f/0xff, max 448) conversions with the rounding the GPU kernels and XLA use (round to
// nearest even; fp32 -> e4m3 saturating, as __nv_cvt_float_to_fp8(..., __NV_SATFINITE, ...)).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace megamoe::host {

inline float Bf16ToFloat(uint16_t v) {
  uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40);  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  return uint16_t(bits >> 16);
}

inline float E4m3ToFloat(uint8_t b) {
  const int exp = (b >> 3) & 0xf, mant = b & 7;
  float v;
  if (exp == 0xf && mant == 7) {
    v = NAN;
  } else if (exp == 0) {
    v = std::ldexp(float(mant), -9);  // subnormal: mant/8 * 2^-6
  } else {
    v = std::ldexp(float(8 + mant), exp - 10);  // (1 + mant/8) * 2^(exp-7)
  }
  return (b & 0x80) ? -v : v;
}

inline uint8_t FloatToE4m3(float f) {
  if (std::isnan(f)) return 0x7f;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  const float a = std::fabs(f);
  if (a >= 448.0f) return sign | 0x7e;  // saturate (448 = 0x7e)
  // The quantum at a's binade (at least the subnormal one, 2^-9); a / quantum is exact.
  int e2;
  std::frexp(a, &e2);  // a = m * 2^e2, m in [0.5, 1): floor(log2 a) = e2 - 1
  const int binade = e2 - 1 < -6 ? -6 : e2 - 1;
  const float quantum = std::ldexp(1.0f, binade - 3);
  const float steps = std::nearbyint(a / quantum);  // ties to even (default rounding mode)
  const float v = steps * quantum;                  // the rounded magnitude, <= 448
  if (v == 0.0f) return sign;
  if (v < std::ldexp(1.0f, -6)) return sign | uint8_t(steps);  // subnormal code = mant
  int ev;
  std::frexp(v, &ev);
  const int exp = ev - 1 + 7;
  const int mant = int(std::ldexp(v, -(ev - 1) + 3)) - 8;
  return sign | uint8_t(exp << 3) | uint8_t(mant);
}

}  // namespace megamoe::host

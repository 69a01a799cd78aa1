// x / s for FP8 quantisation, bit for bit the IEEE division, without its slow path.
//
// nvcc compiles `x / s` into a reciprocal-based quotient behind a per-element range test with a
// called slow path (FCHK + BSSY/CALL): no instruction-level parallelism across the values of a
// thread. Every quantiser divides a whole block of values by one scale, so the range test can be
// made once per block instead: DivByScaleHolds(s) on the scale, then DivByScale for each value.
#pragma once

namespace megamoe {

// x / s given r = 1 / s (IEEE): q0 = x r, the remainder x - q0 s exactly by FMA, q = q0 + rem r
// (Markstein's correction: with r correctly rounded and no underflow or overflow on the way, q
// is the correctly rounded quotient). Valid where DivByScaleHolds(s) and x lies in the block
// that s scales (s = Fp8BlockScale(amax), |x| <= amax): the same e4m3 byte as x / s, and the
// same fp32 quotient wherever it is >= 2^-20 (a subnormal x's remainder may round; such
// quotients are e4m3 zero either way). The FP8 harness's DivByScaleTest checks both claims over
// every bf16 x and 4,096 scales.
__device__ __forceinline__ float DivByScale(float x, float s, float r) {
  const float q0 = __fmul_rn(x, r);
  const float rem = fmaf(-q0, s, x);
  // rem 0: q0 is the quotient itself (and keeps -0's sign, which q0 + 0 r would lose).
  return rem == 0.0f ? q0 : fmaf(rem, r, q0);
}

// The scales DivByScale serves: far from fp32's ends, so neither x r nor the remainder
// underflows or overflows for the values of the block.
__device__ __forceinline__ bool DivByScaleHolds(float s) { return s >= 0x1p-60f && s <= 0x1p60f; }

// Calls body(quotient) once, with quotient(x, s, r) == x / s (r = 1 / s) for every x of a block
// that s scales, for every scale s the body uses:
//   pow2: x r, exact (Fp8BlockScale's pow2 scales are 2^e, e in [-126, 119]: r is exact);
//   holds (DivByScaleHolds of every such s): DivByScale;
//   else IEEE `/` (tiny or huge blocks: rare).
// The three bodies are separate instantiations, so none carries a per-element test.
template <class Body>
__device__ __forceinline__ void WithQuotient(bool pow2, bool holds, Body&& body) {
  if (pow2)
    body([](float x, float, float r) { return x * r; });
  else if (holds)
    body([](float x, float s, float r) { return DivByScale(x, s, r); });
  else
    body([](float x, float s, float) { return x / s; });
}

}  // namespace megamoe

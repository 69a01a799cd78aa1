#!/bin/sh
# Builds the standalone harnesses of the fused MoE GEMM core (sm_90a, static cudart, no JAX):
# fused_core_bench (bf16), fused_core_fp8_bench (the e4m3 path) and fused_dgrad_bench (the
# backward's dgrad GEMMs, linked with backend cuda's SwiGLU kernels to check against them); and
# the first two again with the engine's cycle accounting (ffi/gemm/sm90_engine_profile.cuh) as
# fused_core_bench_profile and fused_core_fp8_bench_profile. The bf16 ones are built with the
# product's options (ffi/gemm/engine_build_options.h: the L1 epilogue deferred, L2's staged); the
# bf16 one again with neither deferred as fused_core_bench_staged (+ _profile), and with both as
# fused_core_bench_defer12 (+ _profile); and the product's with the deferred L1 SwiGLU spread
# over eight stages instead of four (MEGAMOE_DEFER_L1_PARTS_PER_GROUP=4) as fused_core_bench_l1x4.
# Usage: benchmarks/kernels/build_fused_core_bench.sh [out_dir]   (default: build/fused_core)
set -e
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${1:-$ROOT/build/fused_core}
CUTLASS=${CUTLASS_INCLUDE:-/work/venv/lib/python3.11/site-packages/cutlass_library/source/include}
mkdir -p "$OUT"
# build NAME LOG KERNEL [SOURCE...]: benchmarks/kernels/NAME.cu (+ SOURCEs under the root) ->
# $OUT/NAME$SUFFIX, compiled with $DEFINES; ptxas's report in $OUT/LOG (its register, spill and
# stack lines for KERNEL printed, and its C75xx notes: wgmma serialised, printed as "info"
# lines).
build() {
  name=$1 log=$2 kernel=$3
  shift 3
  extra=""
  for s in "$@"; do extra="$extra $ROOT/$s"; done
  # shellcheck disable=SC2086
  nvcc -std=c++17 -O3 -lineinfo -gencode=arch=compute_90a,code=sm_90a \
    --expt-relaxed-constexpr -Xptxas -v -DNDEBUG ${DEFINES:-} \
    -I"$ROOT" -I"$CUTLASS" \
    "$ROOT/benchmarks/kernels/$name.cu" $extra -o "$OUT/$name${SUFFIX:-}" 2>&1 | \
    tee "$OUT/$log" | grep -E "error|warning|C75|registers|spill|stack|$kernel" || true
  test -x "$OUT/$name${SUFFIX:-}"
}
# The ten builds are independent: run at once (each prints its ptxas lines when it ends).
build fused_core_bench ptxas.log MoeCore > "$OUT/.b1" 2>&1 &
build fused_core_fp8_bench ptxas_fp8.log Fp8Core > "$OUT/.b2" 2>&1 &
build fused_dgrad_bench ptxas_dgrad.log MoeCore ffi/impls/grouped_swiglu.cu > "$OUT/.b3" 2>&1 &
DEFINES=-DMEGAMOE_ENGINE_PROFILE=1 SUFFIX=_profile \
  build fused_core_bench ptxas_profile.log MoeCore > "$OUT/.b4" 2>&1 &
DEFINES=-DMEGAMOE_ENGINE_PROFILE=1 SUFFIX=_profile \
  build fused_core_fp8_bench ptxas_fp8_profile.log Fp8Core > "$OUT/.b5" 2>&1 &
DEFINES=-DMEGAMOE_DEFER_L1_EPILOGUE=0 SUFFIX=_staged \
  build fused_core_bench ptxas_staged.log MoeCore > "$OUT/.b6" 2>&1 &
DEFINES="-DMEGAMOE_DEFER_L1_EPILOGUE=0 -DMEGAMOE_ENGINE_PROFILE=1" SUFFIX=_staged_profile \
  build fused_core_bench ptxas_staged_profile.log MoeCore > "$OUT/.b7" 2>&1 &
DEFINES="-DMEGAMOE_DEFER_L2_EPILOGUE=1 -DMEGAMOE_DEFER_L1_EPILOGUE=1" SUFFIX=_defer12 \
  build fused_core_bench ptxas_defer12.log MoeCore > "$OUT/.b8" 2>&1 &
DEFINES="-DMEGAMOE_DEFER_L2_EPILOGUE=1 -DMEGAMOE_DEFER_L1_EPILOGUE=1 -DMEGAMOE_ENGINE_PROFILE=1" \
  SUFFIX=_defer12_profile build fused_core_bench ptxas_defer12_profile.log MoeCore \
  > "$OUT/.b9" 2>&1 &
DEFINES=-DMEGAMOE_DEFER_L1_PARTS_PER_GROUP=4 SUFFIX=_l1x4 \
  build fused_core_bench ptxas_l1x4.log MoeCore > "$OUT/.b10" 2>&1 &
wait
failed=0
for i in 1 2 3 4 5 6 7 8 9 10; do cat "$OUT/.b$i"; rm -f "$OUT/.b$i"; done
for b in fused_core_bench fused_core_fp8_bench fused_dgrad_bench fused_core_bench_profile \
         fused_core_fp8_bench_profile fused_core_bench_staged fused_core_bench_staged_profile \
         fused_core_bench_defer12 fused_core_bench_defer12_profile fused_core_bench_l1x4; do
  test -x "$OUT/$b" || { echo "build failed: $b"; failed=1; }
done
exit $failed

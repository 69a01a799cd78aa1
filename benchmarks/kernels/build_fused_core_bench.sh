#!/bin/sh
# Builds the standalone harnesses of the fused MoE GEMM core (sm_90a, static cudart, no JAX):
# fused_core_bench (bf16) and fused_core_fp8_bench (the e4m3 path).
# Usage: benchmarks/kernels/build_fused_core_bench.sh [out_dir]   (default: build/fused_core)
set -e
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${1:-$ROOT/build/fused_core}
CUTLASS=${CUTLASS_INCLUDE:-/work/venv/lib/python3.11/site-packages/cutlass_library/source/include}
mkdir -p "$OUT"
nvcc -std=c++17 -O3 -lineinfo -gencode=arch=compute_90a,code=sm_90a \
  --expt-relaxed-constexpr -Xptxas -v -DNDEBUG \
  -I"$ROOT" -I"$CUTLASS" \
  "$ROOT/benchmarks/kernels/fused_core_bench.cu" -o "$OUT/fused_core_bench" 2>&1 | \
  tee "$OUT/ptxas.log" | grep -E "error|warning|registers|spill|stack|MoeCore" || true
test -x "$OUT/fused_core_bench"
nvcc -std=c++17 -O3 -lineinfo -gencode=arch=compute_90a,code=sm_90a \
  --expt-relaxed-constexpr -Xptxas -v -DNDEBUG \
  -I"$ROOT" -I"$CUTLASS" \
  "$ROOT/benchmarks/kernels/fused_core_fp8_bench.cu" -o "$OUT/fused_core_fp8_bench" 2>&1 | \
  tee "$OUT/ptxas_fp8.log" | grep -E "error|warning|registers|spill|stack|Fp8Core" || true
test -x "$OUT/fused_core_fp8_bench"

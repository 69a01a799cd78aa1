#!/bin/sh
# Builds the standalone harnesses of the fused MoE GEMM core (sm_90a, static cudart, no JAX):
# fused_core_bench (bf16) and fused_core_fp8_bench (the e4m3 path).
# Usage: benchmarks/kernels/build_fused_core_bench.sh [out_dir]   (default: build/fused_core)
set -e
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${1:-$ROOT/build/fused_core}
CUTLASS=${CUTLASS_INCLUDE:-/work/venv/lib/python3.11/site-packages/cutlass_library/source/include}
mkdir -p "$OUT"
# build NAME LOG KERNEL: benchmarks/kernels/NAME.cu -> $OUT/NAME, ptxas's report in $OUT/LOG
# (its register, spill and stack lines for KERNEL printed).
build() {
  nvcc -std=c++17 -O3 -lineinfo -gencode=arch=compute_90a,code=sm_90a \
    --expt-relaxed-constexpr -Xptxas -v -DNDEBUG \
    -I"$ROOT" -I"$CUTLASS" \
    "$ROOT/benchmarks/kernels/$1.cu" -o "$OUT/$1" 2>&1 | \
    tee "$OUT/$2" | grep -E "error|warning|registers|spill|stack|$3" || true
  test -x "$OUT/$1"
}
build fused_core_bench ptxas.log MoeCore
build fused_core_fp8_bench ptxas_fp8.log Fp8Core

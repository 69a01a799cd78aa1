#!/bin/bash
# Times the tile engine's harness variants at the layer's shapes, each plain and then with the
# cycle accounting (ffi/gemm/sm90_engine_profile.cuh), so that the profiled figures can be set
# against the plain ones of the same run. Builds first when the binaries are missing.
# Usage: benchmarks/kernels/run_engine_profile.sh [build_dir] > log
#   (default build_dir: build/fused_core; needs the CUTLASS headers for a build, see
#   build_fused_core_bench.sh). Variants (fused_core_bench --variant): 30B uniform (problem 2)
#   L1 0, L1 mainloop only 4, L2 7, L2 mainloop only 9, one launch 10, one launch + gate_up 11;
#   235B uniform (problem 4) L1 N-major 2, L2 7, one launch L1 N-major 12; FP8 30B L1 and L2,
#   the kernel and no epilogue; then 30B's mainloops alone with three stages against four,
#   alternated twice.
set -u
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
DIR=${1:-$ROOT/build/fused_core}
if [ ! -x "$DIR/fused_core_bench_profile" ]; then
  sh "$ROOT/benchmarks/kernels/build_fused_core_bench.sh" "$DIR" >&2 || exit 1
fi
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv
run() { echo "### $*"; timeout 180 "$@" 2>&1; echo "rc=$?"; }
# The profiled build still passes the checks (odd sizes, one token).
run "$DIR/fused_core_bench_profile" --problem 0 --engine 0
run "$DIR/fused_core_bench_profile" --problem 1 --engine 0
for v in 0 4 7 9 10 11; do
  run "$DIR/fused_core_bench" --problem 2 --engine 0 --variant $v --nocheck
  run "$DIR/fused_core_bench_profile" --problem 2 --engine 0 --variant $v --nocheck
done
for v in 2 7 12; do
  run "$DIR/fused_core_bench" --problem 4 --engine 0 --variant $v --nocheck
  run "$DIR/fused_core_bench_profile" --problem 4 --engine 0 --variant $v --nocheck
done
run "$DIR/fused_core_fp8_bench" --timing --only "30B E128" --modes 03 --reps 11
run "$DIR/fused_core_fp8_bench_profile" --timing --only "30B E128" --modes 03 --reps 11
# The mainloops alone with three stages (engine 1, S3) against four (engine 0): what dedicated
# epilogue staging would cost the stream (FUSED_CORE_NOTES, session 31, "What would close it").
for e in 0 1 0 1; do
  for v in 4 9; do run "$DIR/fused_core_bench" --problem 2 --engine $e --variant $v --nocheck; done
done

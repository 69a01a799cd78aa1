#!/usr/bin/env bash
# Builds the extension on a GPU machine and runs the GPU tests and benchmarks in one call,
# writing logs and results under $OUT (default: ./device_out).
#
#   scripts/device_run.sh [STEP ...]     steps: build keep tests bench   (default: build tests bench)
#
# Needs: python3 with jax[cuda], nanobind, cmake, ninja, nvcc (the device image has them).
# CUTLASS headers: a nvidia-cutlass wheel under .whl/, carried (the device has no network; fetch it
# here with `pip download --no-deps -d .whl nvidia-cutlass==4.2.0.0`)
# or JAX_MEGAMOE_CUTLASS_INCLUDE pointing at an include dir.
# Extra pytest args: PYTEST_ARGS (split on spaces); test paths: PYTEST_PATHS (default tests);
# a -k expression with spaces: PYTEST_K; benchmark commands: BENCH_CMDS (one per line).
# PYTEST_JOBS=N (default 1) runs the test files in N pytest processes sharing the GPU (the suite
# is bound by XLA compilation on the host), each logging to $OUT/tests_jK.log with timestamps.
# JAX_MEGAMOE_DEFER_L2_EPILOGUE=ON (benchmarks) / JAX_MEGAMOE_DEFER_L1_EPILOGUE=OFF build the tile
# engine with / without its deferred L2 / L1 epilogue; every build reconfigures them (defaults
# as CMake's: L2 OFF, L1 ON).
# JAX_MEGAMOE_ENGINE_PROFILE=ON builds the fused kernel with its cycle accounting (benchmarks
# only: fused_phases.py --engine-profile); every build reconfigures it (default OFF).
# Step "keep" copies the built extension to $OUT/so: carry it back next call
# (jax_megamoe/_megamoe.cpython-*.so) and skip "build".
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# Never NVLink multicast (shared hosts): keep these set for every child process.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(build tests bench)
status=0

log() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$OUT/summary.txt"; }

build() {
  if [ -z "${JAX_MEGAMOE_CUTLASS_INCLUDE:-}" ]; then
    local wheel
    wheel=$(ls .whl/nvidia_cutlass-*.whl 2>/dev/null | head -1)
    if [ -n "$wheel" ]; then
      mkdir -p /tmp/cutlass && python3 -m zipfile -e "$wheel" /tmp/cutlass >/dev/null
      export JAX_MEGAMOE_CUTLASS_INCLUDE=/tmp/cutlass/cutlass_library/source/include
    fi
  fi
  log "build (cutlass: ${JAX_MEGAMOE_CUTLASS_INCLUDE:-none})"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.total --format=csv \
    | tee -a "$OUT/summary.txt"
  cmake -S . -B build/device -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DPython_EXECUTABLE="$(command -v python3)" -DJAX_MEGAMOE_CUDA=ON \
      -DJAX_MEGAMOE_CUDA_ARCHS="${JAX_MEGAMOE_CUDA_ARCHS:-}" \
      -DJAX_MEGAMOE_ENGINE_PROFILE="${JAX_MEGAMOE_ENGINE_PROFILE:-OFF}" \
      -DJAX_MEGAMOE_DEFER_L2_EPILOGUE="${JAX_MEGAMOE_DEFER_L2_EPILOGUE:-OFF}" \
      -DJAX_MEGAMOE_DEFER_L1_EPILOGUE="${JAX_MEGAMOE_DEFER_L1_EPILOGUE:-ON}" \
      -DJAX_MEGAMOE_CUTLASS_INCLUDE="${JAX_MEGAMOE_CUTLASS_INCLUDE:-}" >"$OUT/build.log" 2>&1 \
    && cmake --build build/device -j "$(nproc)" >>"$OUT/build.log" 2>&1
  local rc=$?
  if [ $rc -ne 0 ]; then tail -50 "$OUT/build.log"; log "build FAILED"; return $rc; fi
  cp build/device/_megamoe*.so jax_megamoe/
  python3 -c "import jax_megamoe as m; print(m.build_info(), m.cuda_available())" \
    | tee -a "$OUT/summary.txt"
}

tests() {
  local jobs=${PYTEST_JOBS:-1}
  if [ "$jobs" -gt 1 ]; then tests_parallel "$jobs"; return; fi
  log "tests"
  python3 -m pytest -q -rs -m "gpu or multigpu" ${PYTEST_K:+-k "$PYTEST_K"} ${PYTEST_ARGS:-} \
    ${PYTEST_PATHS:-tests} \
    2>&1 | tee "$OUT/tests.log" | tail -40
  local rc=${PIPESTATUS[0]}
  tail -1 "$OUT/tests.log" | tee -a "$OUT/summary.txt"
  return $rc
}

# The test files dealt round-robin to $1 pytest processes; fails if any of them fails.
tests_parallel() {
  local jobs=$1 files=() k
  for path in ${PYTEST_PATHS:-tests}; do
    if [ -d "$path" ]; then files+=("$path"/test_*.py); else files+=("$path"); fi
  done
  log "tests in $jobs processes: ${#files[@]} files"
  local pids=()
  for ((k = 0; k < jobs; k++)); do
    local mine=()
    for ((i = k; i < ${#files[@]}; i += jobs)); do mine+=("${files[$i]}"); done
    [ ${#mine[@]} -eq 0 ] && continue
    ( python3 -m pytest -v -rs -p no:cacheprovider -m "gpu or multigpu" \
        ${PYTEST_K:+-k "$PYTEST_K"} ${PYTEST_ARGS:-} "${mine[@]}" 2>&1 \
        | while IFS= read -r line; do echo "$(date -u +%H:%M:%S) $line"; done \
        > "$OUT/tests_j$k.log"; exit "${PIPESTATUS[0]}" ) &
    pids+=($!)
  done
  local rc=0
  for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
  for ((k = 0; k < jobs; k++)); do
    [ -f "$OUT/tests_j$k.log" ] && tail -1 "$OUT/tests_j$k.log" | tee -a "$OUT/summary.txt"
  done
  return $rc
}

keep() {
  mkdir -p "$OUT/so" && cp jax_megamoe/_megamoe*.so "$OUT/so/" && log "kept $(ls "$OUT/so")"
}

bench() {
  log "bench"
  local cmds=${BENCH_CMDS:-"python3 benchmarks/bench_grouped_mlp.py --out $OUT/bench_grouped_mlp.json"}
  while IFS= read -r cmd; do
    [ -z "$cmd" ] && continue
    log "$cmd"
    bash -c "$cmd" 2>&1 | tee -a "$OUT/bench.log" | tail -30 || status=1
  done <<<"$cmds"
}

for step in "${STEPS[@]}"; do
  "$step" || { status=1; [ "$step" = build ] && break; }
done
log "done (status $status)"
exit $status

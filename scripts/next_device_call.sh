#!/usr/bin/env bash
# The device call the last session prepared and could not run. Each session that leaves GPU
# work behind rewrites it; its results go to benchmarks/RESULTS.md.
#
# With two GPUs (kind nvidia-h200-x2, not lent since session 8), issue 14's items 3 and 7 and
# its EP = 2 bars:
#   1. the multi-GPU tests: the fused layer beside an all_gather, both process models, FP8; the
#      cuda backend's two-process EP and training tests (the CE and balance kernels run per
#      device under the example's mesh: never yet on 2 GPUs);
#   2. the layer at EP = 2, cuda and fused in one run (issue 14's EP = 2 bars);
#   3. the example on a data=1,expert=2 mesh, 20 steps.
# With one GPU (after session 32, whose calls all ran on H100s): the deferred L2 epilogue
# (MEGAMOE_DEFER_L2_EPILOGUE, built in session 32, never run; FUSED_CORE_NOTES, session 32):
#   PART=defer (~5 min): the harness built three ways (plain, L2 deferred, L1 and L2 deferred);
#     the checks of problems 0, 1 and 6 (odd sizes, one token, F = 128; every variant on engine
#     0) in each build, and the outputs' digests of each deferred build against the plain
#     build's (bit for bit; problem 6 is new in session 32, never run);
#     then 30B and 235B L1, L2 and the one launch in the three builds, twice, and the L1 + L2
#     deferred build profiled.
#   PART=defer_product (~9 min), if the harness passed and gained: the extension plain, then
#     with JAX_MEGAMOE_DEFER_L2_EPILOGUE=ON and JAX_MEGAMOE_DEFER_L1_EPILOGUE=ON (DEFER_L1=OFF:
#     L2 alone), fused_phases.py on both (30B and 235B bf16), then the bf16 fused tests on the
#     deferred build.
# The bars are H200 figures: if an H200 comes, also rerun the layer benchmark
# (bench_layer.py --ep 1, cuda and fused) for issue 14's table.
# Each step has its own time limit, so that one hang does not take the others.
#
#   OUT=... PART=defer|defer_product scripts/next_device_call.sh    (carry .whl: the CUTLASS wheel)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false MEGAMOE_EP_TIMEOUT_S=10

nvidia-smi -L | tee "$OUT/gpus.txt"
# PART=defer235: the harness's cycle accounting at 235B (problem 4: L1, L2, one launch), plain
# and deferred, with each build's timing beside it.
if [ "${PART:-defer}" = defer235 ]; then
  mkdir -p /tmp/cutlass && python3 -m zipfile -e .whl/nvidia_cutlass-*.whl /tmp/cutlass >/dev/null
  export CUTLASS_INCLUDE=/tmp/cutlass/cutlass_library/source/include
  timeout 240 sh benchmarks/kernels/build_fused_core_bench.sh build/fused_core \
    > "$OUT/harness_build.log" 2>&1 || { tail -30 "$OUT/harness_build.log"; exit 1; }
  B=build/fused_core
  run() { echo "### $*"; timeout 120 "$@" 2>&1; echo "rc=$?"; }
  for round in 1 2; do
    for b in fused_core_bench fused_core_bench_defer fused_core_bench_defer12; do
      for v in 2 7 12; do run $B/$b --problem 4 --engine 0 --variant $v --nocheck; done
      for v in 2 7 12; do run $B/${b}_profile --problem 4 --engine 0 --variant $v --nocheck; done
    done
  done > "$OUT/defer235.log"
  grep -E "^### |wg0:|per tile|producer:" "$OUT/defer235.log" | head -120
  exit 0
fi
if [ "$(nvidia-smi -L | wc -l)" -lt 2 ] && [ "${PART:-defer}" = defer ]; then
  mkdir -p /tmp/cutlass && python3 -m zipfile -e .whl/nvidia_cutlass-*.whl /tmp/cutlass >/dev/null
  export CUTLASS_INCLUDE=/tmp/cutlass/cutlass_library/source/include
  timeout 240 sh benchmarks/kernels/build_fused_core_bench.sh build/fused_core \
    > "$OUT/harness_build.log" 2>&1 || { tail -30 "$OUT/harness_build.log"; exit 1; }
  B=build/fused_core
  run() { echo "### $*"; timeout 120 "$@" 2>&1; echo "rc=$?"; }
  # Problem 6 (F = 128: L2 tiles of two stages) is new in session 32: run plain too, so that a
  # failure there is placed.
  # Each build's checks; then its outputs' digests against the plain build's, bit for bit.
  for b in fused_core_bench fused_core_bench_defer fused_core_bench_defer12; do
    for pr in 0 1 6; do run $B/$b --problem $pr --engine 0; done > "$OUT/checks_$b.log"
    echo "$b: $(grep -c PASS "$OUT/checks_$b.log") PASS, $(grep -c FAIL "$OUT/checks_$b.log") FAIL"
    grep digest "$OUT/checks_$b.log" > "$OUT/digests_$b.txt"
  done
  for b in fused_core_bench_defer fused_core_bench_defer12; do
    cmp -s "$OUT/digests_fused_core_bench.txt" "$OUT/digests_$b.txt" \
      && echo "$b: digests identical to the plain build's" \
      || echo "$b: DIGESTS DIFFER from the plain build's"
  done
  for round in 1 2 3; do
    for v in 0 7 10 14; do
      for b in fused_core_bench fused_core_bench_defer fused_core_bench_defer12; do
        run $B/$b --problem 2 --engine 0 --variant $v --nocheck
      done
    done
    for v in 2 7 12; do
      for b in fused_core_bench fused_core_bench_defer fused_core_bench_defer12; do
        run $B/$b --problem 4 --engine 0 --variant $v --nocheck
      done
    done
  done > "$OUT/defer_timing.log"
  grep -E "^### |^(30B|235B) " "$OUT/defer_timing.log" | grep -v "^###" | head -40
  # The cycle accounting of each build, on the same machine.
  for b in fused_core_bench_profile fused_core_bench_defer_profile fused_core_bench_defer12_profile; do
    for v in 0 7 10; do
      run $B/$b --problem 2 --engine 0 --variant $v --nocheck
    done
  done > "$OUT/defer_profile.log"
  grep -E "^### |wg0:|per tile" "$OUT/defer_profile.log" | head -60
  exit 0
fi
if [ "$(nvidia-smi -L | wc -l)" -lt 2 ] && [ "${PART:-defer}" = defer_product ]; then
  # DEFER_L1=OFF: the deferred build defers L2 alone (default: L1 and L2).
  for mode in OFF ON; do
    l1=OFF
    [ "$mode" = ON ] && l1=${DEFER_L1:-ON}
    JAX_MEGAMOE_DEFER_L2_EPILOGUE=$mode JAX_MEGAMOE_DEFER_L1_EPILOGUE=$l1 \
      JAX_MEGAMOE_CUDA_ARCHS=90a scripts/device_run.sh build || exit 1
    timeout 150 python3 benchmarks/fused_phases.py --shapes 30b,235b --recipe bf16 --reps 10 \
      --out "$OUT/fused_defer_$mode.json" 2>&1 | tee "$OUT/fused_defer_$mode.log" | grep kernel
  done
  [ "${TESTS:-1}" = 1 ] && timeout 200 python3 -m pytest -q -rs -p no:cacheprovider -n 4 -m gpu \
    -k "not fp8" tests/test_fused_moe.py 2>&1 | tee "$OUT/tests_fused_defer.log" | tail -4
  exit 0
fi
# PART=defer_modes: the extension built four ways (plain; L1, L2, L1 + L2 deferred), then
# fused_phases.py on each in turn, twice (30B and 235B bf16; the same machine, interleaved).
if [ "${PART:-defer}" = defer_modes ]; then
  for mode in OFF:OFF ON:OFF OFF:ON ON:ON; do
    JAX_MEGAMOE_DEFER_L1_EPILOGUE=${mode%%:*} JAX_MEGAMOE_DEFER_L2_EPILOGUE=${mode##*:} \
      JAX_MEGAMOE_CUDA_ARCHS=90a scripts/device_run.sh build > /dev/null || exit 1
    cp jax_megamoe/_megamoe*.so "/tmp/so_${mode/:/_}"
  done
  so=$(ls jax_megamoe/_megamoe*.so)
  for round in 1 2; do
    for mode in OFF:OFF ON:OFF OFF:ON ON:ON; do
      cp "/tmp/so_${mode/:/_}" "$so"
      echo "round $round, deferred L1:L2 $mode"
      timeout 100 python3 benchmarks/fused_phases.py --shapes 30b,235b --recipe bf16 --reps 10 \
        --out "$OUT/phases_${mode/:/_}_$round.json" 2>&1 | grep -E "kernel|rror"
    done
  done | tee "$OUT/defer_modes.log"
  exit 0
fi
# The bf16 fused tests on the extension built last (PART=defer_product left the deferred one).
if [ "${PART:-defer}" = defer_tests ]; then
  timeout 300 python3 -m pytest -q -rs -p no:cacheprovider -n 4 -m gpu -k "not fp8" \
    tests/test_fused_moe.py 2>&1 | tee "$OUT/tests_fused_defer.log" | tail -4
  exit 0
fi
timeout 240 python3 -m pytest -q -rs -m multigpu tests/test_fused_multigpu.py \
  tests/test_ep_two_process.py tests/test_two_process_training.py 2>&1 \
  | tee "$OUT/tests_multigpu.log" | tail -15
timeout 200 python3 benchmarks/bench_layer.py --passes fwd --shapes 30b,235b \
  --recipes bf16,fp8 --impls megamoe:cuda,megamoe:fused --ep 2 --reps 10 --isolate off \
  --out "$OUT/layer_fwd_ep2.json" 2>&1 | tee "$OUT/layer_fwd_ep2.log" | tail -20
timeout 150 python3 examples/train_qwen3_moe.py --config qwen3-30b-a3b --num-layers 4 \
  --seq-len 4096 --batch 8 --ce-chunk 1024 --lr 3e-4 --backend cuda --attention cudnn \
  --mesh data=1,expert=2 --steps 20 --log_every 10 --checkpoint_every 0 --out /tmp/ep2 2>&1 \
  | tr '\r' '\n' | grep -v "step/s\|s/step" | tail -12 | tee "$OUT/example_ep2.log"

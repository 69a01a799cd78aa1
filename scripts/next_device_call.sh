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
# With one GPU (after session 31, whose calls all ran on an H100), issue 14 on the H200:
#   1. the tile engine's cycle accounting at the layer's shapes (run_engine_profile.sh), and the
#      mainloop with three stages against four (the handoff design's first price:
#      FUSED_CORE_NOTES, session 31, "What would close it");
#   2. L2's rows by TMA in the fused kernel, off and on (MEGAMOE_FUSED_L2_TMA; default off
#      after the H100's parity);
#   3. the fused tests that session 31's last call ran out of time for.
#   4. the same accounting inside the fused kernel: an extension built with
#      JAX_MEGAMOE_ENGINE_PROFILE=ON, fused_phases.py --engine-profile (never run yet), and its
#      test; it says whether the tiles wait for the copy's rows and what the epilogue costs there.
# One GPU takes three calls (each under the 600 s limit): PART=profile (1 and 2, ~9 min with
# the builds), then PART=tests (3, ~5 min) and PART=engine (4, ~4 min) on the same warm machine.
# Each step has its own time limit, so that one hang does not take the others.
#
#   OUT=... [PART=profile|tests] scripts/next_device_call.sh      (carry .whl: the CUTLASS wheel)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false MEGAMOE_EP_TIMEOUT_S=10

nvidia-smi -L | tee "$OUT/gpus.txt"
if [ "$(nvidia-smi -L | wc -l)" -lt 2 ] && [ "${PART:-profile}" = engine ]; then
  JAX_MEGAMOE_ENGINE_PROFILE=ON JAX_MEGAMOE_CUDA_ARCHS=90a scripts/device_run.sh build || exit 1
  timeout 120 python3 -m pytest -q -rs -m gpu tests/test_fused_engine_profile.py 2>&1 \
    | tee "$OUT/tests_engine_profile.log" | tail -3
  timeout 150 python3 benchmarks/fused_phases.py --shapes 30b,235b --recipe bf16 --reps 5 \
    --engine-profile --out "$OUT/fused_engine_bf16.json" 2>&1 | tee "$OUT/fused_engine.log"
  timeout 90 python3 benchmarks/fused_phases.py --shapes 30b --recipe fp8 --reps 5 \
    --engine-profile --out "$OUT/fused_engine_fp8.json" 2>&1 | tee -a "$OUT/fused_engine.log"
  exit 0
fi
if [ "$(nvidia-smi -L | wc -l)" -lt 2 ] && [ "${PART:-profile}" = tests ]; then
  ls jax_megamoe/_megamoe*.so >/dev/null 2>&1 || cp build/device/_megamoe*.so jax_megamoe/ ||
    JAX_MEGAMOE_CUDA_ARCHS=90a scripts/device_run.sh build || exit 1
  timeout 420 python3 -m pytest -q -rs -m gpu -k "not fp8 and not virtual" \
    tests/test_fused_moe.py 2>&1 | tee "$OUT/tests_fused.log" | tail -5
  exit 0
fi
JAX_MEGAMOE_CUDA_ARCHS=90a scripts/device_run.sh build || exit 1
if [ "$(nvidia-smi -L | wc -l)" -lt 2 ]; then
  # device_run.sh's build unpacked the wheel's CUTLASS headers here.
  export CUTLASS_INCLUDE=/tmp/cutlass/cutlass_library/source/include
  timeout 240 sh benchmarks/kernels/build_fused_core_bench.sh build/fused_core \
    > "$OUT/harness_build.log" 2>&1
  timeout 240 benchmarks/kernels/run_engine_profile.sh build/fused_core \
    > "$OUT/engine_profile.log" 2>&1
  grep -E "TFLOP|^profile|^  wg|^       " "$OUT/engine_profile.log" | tail -48
  for m in 0 1; do
    MEGAMOE_FUSED_L2_TMA=$m timeout 120 python3 benchmarks/fused_phases.py --shapes 30b,235b \
      --recipe bf16 --reps 10 2>&1 | tee -a "$OUT/fused_l2_tma.log" | grep kernel
    MEGAMOE_FUSED_L2_TMA=$m timeout 90 python3 benchmarks/fused_phases.py --shapes 30b \
      --recipe fp8 --reps 10 2>&1 | tee -a "$OUT/fused_l2_tma.log" | grep kernel
  done
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

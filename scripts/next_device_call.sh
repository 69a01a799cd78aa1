#!/usr/bin/env bash
# The device call the last session prepared and could not run. Each session that leaves GPU
# work behind rewrites it; its results go to benchmarks/RESULTS.md.
#
# After session 30 (issue 15's bars all measured on an H200): what is left needs two GPUs
# (kind nvidia-h200-x2, not lent since session 8). Issue 14's items 3 and 7 and its EP = 2 bars:
#   1. the multi-GPU tests: the fused layer beside an all_gather, both process models, FP8; the
#      cuda backend's two-process EP and training tests (the CE and balance kernels run per
#      device under the example's mesh: never yet on 2 GPUs);
#   2. the layer at EP = 2, cuda and fused in one run (issue 14's EP = 2 bars);
#   3. the example on a data=1,expert=2 mesh, 20 steps.
# Each step has its own time limit, so that one hang does not take the others.
#
#   OUT=... scripts/next_device_call.sh      (carry .whl: the CUTLASS wheel)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false MEGAMOE_EP_TIMEOUT_S=10

nvidia-smi -L | tee "$OUT/gpus.txt"
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] || { echo "needs two GPUs"; exit 2; }
JAX_MEGAMOE_CUDA_ARCHS=90a scripts/device_run.sh build || exit 1
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

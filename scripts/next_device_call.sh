#!/usr/bin/env bash
# The device call the last session prepared and could not run: one call of ~6-8 minutes. Each
# session that leaves GPU work behind rewrites it; its results go to benchmarks/RESULTS.md.
#
# After session 29 (issue 15 on an H200, which session 29 could not get): the LM head's
# cross-entropy kernel and balance's solve kernel (both on by default since their H100 tests)
# against the XLA forms in bar 2's own figure, the step profile at 8 layers with remat full
# (as bench_step.py runs it; an H100's 80 GB does not hold it), then bar 3 (the issue's
# command, 50 steps) on the H200. LAYERS, REMAT: the profile's (default 8, full); BAR3=0 skips
# bar 3.
#
#   OUT=... scripts/next_device_call.sh      (carry .whl: the CUTLASS wheel)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false MEGAMOE_EP_TIMEOUT_S=10
LAYERS=${LAYERS:-8}
REMAT=${REMAT:-full}

JAX_MEGAMOE_CUDA_ARCHS=90a scripts/device_run.sh build || exit 1
python3 -m pytest -q -rs -m gpu tests/test_cross_entropy_kernel.py tests/test_balance_kernel.py \
  2>&1 | tee "$OUT/tests_kernels.log"
profile() {  # $1: both kernels on (1) or off (0)
  MEGAMOE_CE_KERNEL=$1 MEGAMOE_BALANCE_KERNEL=$1 timeout 240 python3 benchmarks/profile_step.py \
    --backend cuda --data random --layers "$LAYERS" --remat "$REMAT" --trace-dir "/tmp/prof_k$1" \
    --out "$OUT/profile_step_30b_${LAYERS}l_${REMAT}_kernels$1.json" --md "" 2>&1 \
    | tee "$OUT/profile_${LAYERS}l_${REMAT}_kernels$1.log" | tail -40
}
# Bar 2's figure first, then bar 3, then the kernels-off comparison: a call cut by its time
# limit loses the least needed part.
profile 1
if [ "${BAR3:-1}" != 0 ]; then
  timeout 240 python3 examples/train_qwen3_moe.py --config qwen3-30b-a3b --num-layers 4 \
    --seq-len 4096 --batch 4 --ce-chunk 1024 --lr 3e-4 --backend cuda --attention cudnn \
    --steps 50 --log_every 10 --checkpoint_every 0 --out /tmp/bar3 2>&1 | tail -20 \
    | tee "$OUT/bar3.log"
  cp /tmp/bar3/metrics.jsonl "$OUT/metrics_bar3.jsonl"
fi
profile 0

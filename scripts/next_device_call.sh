#!/usr/bin/env bash
# The device call the last session prepared and could not run (no GPU was lent): one call,
# ~6 minutes on one H100 or H200. Each session that leaves GPU work behind rewrites it; its
# results go to benchmarks/RESULTS.md.
#
# Session 29: two kernels for issue 15's bar 2, both off by default until this has run: the LM
# head's cross-entropy (megamoe_cross_entropy_grad, models/losses.py CE_KERNEL) and balance's
# offset solve (megamoe_balance_offsets, router.py BALANCE_KERNEL). Build, their GPU tests,
# their benchmarks against the JAX paths, then the step profile with both off and both on
# (LAYERS=4 and REMAT=none by default, the H100's; 8 layers with remat full on an H200 is bar
# 2's own figure).
#
#   OUT=... scripts/next_device_call.sh      (carry .whl: the CUTLASS wheel)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false MEGAMOE_EP_TIMEOUT_S=10
LAYERS=${LAYERS:-4}
REMAT=${REMAT:-none}

JAX_MEGAMOE_CUDA_ARCHS=90a scripts/device_run.sh build || exit 1
python3 -m pytest -q -rs -m gpu tests/test_cross_entropy_kernel.py tests/test_balance_kernel.py \
  2>&1 | tee "$OUT/tests_kernels.log"
MEGAMOE_CE_KERNEL=1 MEGAMOE_BALANCE_KERNEL=1 python3 -m pytest -q -rs tests/test_qwen3_model.py \
  tests/test_routing_balance.py -k "cross_entropy or remat_keeps" 2>&1 \
  | tee -a "$OUT/tests_kernels.log"
python3 benchmarks/ce_logsumexp_passes.py --reps 20 2>&1 | tee "$OUT/ce_chunk.log"
python3 benchmarks/bench_route.py --reps 20 2>&1 | tee "$OUT/route.log"
for on in 0 1; do
  MEGAMOE_CE_KERNEL=$on MEGAMOE_BALANCE_KERNEL=$on timeout 240 python3 benchmarks/profile_step.py \
    --backend cuda --data random --layers "$LAYERS" --remat "$REMAT" --trace-dir "/tmp/prof_k$on" \
    --out "$OUT/profile_step_30b_${LAYERS}l_${REMAT}_kernels$on.json" --md "" 2>&1 \
    | tee "$OUT/profile_${LAYERS}l_${REMAT}_kernels$on.log" | tail -40
done

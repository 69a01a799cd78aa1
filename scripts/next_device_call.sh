#!/usr/bin/env bash
# The device calls the last session prepared and could not run. Each session that leaves GPU
# work behind rewrites it; its results go to benchmarks/RESULTS.md. Written in session 34,
# updated in sessions 35-41. Session 38 ran PART=bars, suite, phases and l2async on an H100
# (the async staging release measured nothing and is gone from the code, with PART=l2async);
# session 39 ran PART=bars on an H100 late, and the clocks beside the 235B forward (the
# kernels power-capped, fused's ~10% below cuda's clock); session 40 ran PART=bars, phases,
# suite and the energy runs on an H200 (RESULTS "Session 40"); session 41 ran PART=step (H100,
# H200) and harness_energy (H100); session 42 ran PART=suite and step on H100s (RESULTS
# "Session 42"); session 43 GPU-tested and landed the EP FP8 backward's dW_gate_up operand read
# from the FP8 rows as they arrived (H100, RESULTS "Session 43"); in session 44 no GPU came;
# session 45 GPU-tested and landed the SwiGLU octet and the single wgrad-operand launcher (H100,
# RESULTS "Session 45"), and the fused handlers' shared checks (ffi/handlers/fused_ops.h), whose
# FP8 virtual-rank tests did not run, nor the new test of their shared scratch check; in session
# 46 no GPU came; both fused handlers' dtype and dims checks moved into fused_ops.h, the
# workspace's device scope restores the thread's context exactly, and the EP handlers switch to
# their shares' CUDA device (all compiled, not GPU-run); session 47 ran PART=suite on an H100:
# all 134 tests passed, covering every change of sessions 45-46 (RESULTS "Session 47"); in
# session 48 no GPU came (PART=bars now splits the fp8 call with weight blocks; the fused
# two-GPU workers' harness runs in CI on CPU devices: tests/test_fused_multigpu_workers_cpu.py).
# First next: the two-GPU parts, in the order ep2, ep2_one_process, ep2_bench, ep2_ep, ep2_train
# (issue 14's first; the five take ~22 min by their estimates, with the start and the build ~27
# of a session's 30 device minutes); at one GPU, PART=step on an H200 (RECIPE=bf16,fp8
# CONFIG=qwen3-235b-a22b LAYERS=1, one call), which decides AUTO_PICKS_FUSED (no H200 came in
# sessions 43-48).
# The combine beside the tiles (branch combine-overlap, sessions 35-36: it loses) is recorded in
# RESULTS "Session 35"/"Session 36" and FUSED_CORE_NOTES; the branch itself is gone.
#
# Two GPUs (kind nvidia-h200-x2, not lent since session 8): issue 14's items 3 and 7 and its
# EP = 2 bars, in five calls on the same warm machine (each builds the extension with its
# defaults if the machine has none, ~85 s). None of the fused two-GPU tests has ever run (a
# review in session 34 expected the old single call not to fit 600 s):
#   PART=ep2 (the default with two GPUs; ~3 min): tests/test_fused_multigpu.py: the fused layer
#     beside an all_gather (reported as not run unless XLA scheduled the kernel inside the
#     collective's window: "FUSED-WORKER-CONCURRENCY"), and two processes.
#   PART=ep2_one_process (~3 min): the same file's one-process tests: bf16 with the backward's
#     kernel pass, FP8 (two recipes).
#   PART=ep2_ep (~4 min): backend cuda's two-process EP tests (tests/test_ep_two_process.py), and a
#     workspace on the second GPU leaving no CUDA context on the first (test_workspace_context.py).
#   PART=ep2_train (~6 min): the example as two processes (tests/test_two_process_training.py).
#   PART=ep2_bench (~6 min): the layer at EP = 2, cuda and fused in one run; the example with
#     backend fused on a data=1,expert=2 mesh, 20 steps (backend cuda's ran in session 8).
# pytest runs verbose and unbuffered, under SIGINT at its limit (so that it still prints its
# failures), with a JUnit XML in $OUT. If a first call times out at stage "routing counts" or
# "expert outputs", rerun that part with CUDA_MODULE_LOADING=EAGER as an A/B (a kernel loaded
# lazily after the fused kernel was queued may wait for it: FUSED_CORE_NOTES "Session 46").
# One GPU:
#   PART=bars (the default; ~4-5 min: 252 s on an H100 in session 39): the extension with its
#     defaults (L2's rows by TMA at one rank since session 37), the fused layer's tests against
#     the reference and bitwise (~2 min), then the layer forward at EP = 1 for issue 14's table
#     (bench_layer.py: cuda, fused, and fused + blocks for fp8; 30B and 235B), then where a
#     call's time goes (fused_phases.py --overhead, bf16 and fp8 with weight blocks (session
#     48: the fp8 + blocks call's split was never measured): CTA 0's phases, alone /
#     queued, every kernel's GPU time per call beside backend cuda's), each step with the GPU's
#     SM clock, power and clock-event reasons sampled beside it (clocks.log: on an H100 in
#     session 38 the 235B bf16 kernel ran 8.9-10.0 ms on one card). The bars are H200 figures:
#     say which card ran it.
#   PART=energy (~4 min): energy, mean power and SM clock per call, fused against cuda (bf16;
#     fp8 with weight blocks; 30B, 235B), calls queued 3 s per run, two interleaved rounds
#     (benchmarks/energy_per_call.py): whether the card's power limit sets the times (session
#     39, H100: at 235B bf16 fused's kernels ran ~10% below cuda's clock under the cap); then
#     fused alone at 235B bf16 under three settings of its overrides (energy_per_call.py
#     --fused-env): the row copy all before the tiles, L2's generic stores, L1 M-block-major.
#   PART=harness_energy (~3 min): the harness's engines at 235B under sustained load (the card
#     at its power limit): the product's, B K-major, and B K-major shared by 2-CTA clusters
#     (multicast), L1 and L2, time per launch and the clock under the cap: whether fewer bytes
#     moved per tile is what would close the 235B bf16 bar at the power limit (session 40).
#   PART=step (~3 min a recipe; RECIPE=bf16|fp8|bf16,fp8, CONFIG=, LAYERS=): the example's
#     training step, cuda against fused in both orders (bench_step.py): backend "auto"'s pick
#     at one GPU (AUTO_PICKS_FUSED in jax_megamoe/backends/fused.py; session 41: parity, H100 fused
#     0.5-0.9% faster, H200 0.1-1.8% slower, so auto keeps cuda; session 42, H100s only, after
#     optimize_remat and the FP8 wgrad operands read in place: bf16 0.4-2.1%, fp8 1.8-1.9%
#     faster). After a change to the backward or to what the forward keeps for it.
#   PART=suite (~6 min): the one-GPU suite of tests/test_fused_moe.py, test_grouped_mlp_ffi.py
#     and test_weight_blocks.py on the extension's defaults (session 38, H100: 125 passed in
#     370 s).
#   PART=harness (~4 min): the standalone harnesses built (ten builds); the bf16 checks of
#     problems 0, 1 and 6 in the product build (L1 epilogue deferred), _staged and _defer12,
#     and their digests against _staged's (bit for bit); then, twice: 30B L1 and 30B / 235B
#     one launch in _staged, the product and _defer12; L2 by TMA alone and one launch with L2
#     by TMA (30B, 235B), and 235B's L1 (N-major) alone, in the product; the clocks sampled
#     beside the timing. Worth it on an H200: the deferred L2 epilogue lost at
#     235B on H100s, whose L2 GEMM waits for data two thirds of the time; on an H200 that GEMM
#     ran at 592 TFLOP/s (FUSED_CORE_NOTES, run 3), so _defer12 against the product build says
#     whether L2's deferral pays there.
#   PART=phases (~5 min): fused_phases.py bf16 and fp8 (30B, 235B: the kernel's phases), 235B
#     bf16 with the copy before the tiles or beside them (MEGAMOE_FUSED_COPY_HEAD 100 / 12 / 0:
#     on an H100 in session 38 the copy was not what holds its GEMMs below CUTLASS's; to
#     repeat on an H200), then the FP8 harness's four modes at 30B (where L1's and L2's
#     epilogue time goes).
# Each step has its own time limit, so that one hang does not take the others.
# To compare two builds of the extension (an A/B of a build option), session 38's PART=l2async
# kept each build's .so and swapped them between rounds (build_kept, use_build):
#   git show fd51552^:scripts/next_device_call.sh
# To compare two commits' engines (an A/B of a kernel change), build the harnesses of each here
# (benchmarks/kernels/build_fused_core_bench.sh DIR, ~85 s on two cores; A from a git worktree),
# carry the two directories and run benchmarks/kernels/harness_ab.sh A_DIR B_DIR $OUT/ab 2.
#
#   OUT=... [PART=bars|energy|harness_energy|step|suite|harness|phases|ep2|ep2_one_process|\
#     ep2_ep|ep2_train|ep2_bench] [RECIPE=bf16|fp8|bf16,fp8] [CONFIG=...] [LAYERS=...] \
#     scripts/next_device_call.sh
#   (carry .whl: the CUTLASS wheel)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# EP waits give up after 60 s: long enough for one process's slower compilation before a first
# call (the tests that time out on purpose set their own).
export XLA_PYTHON_CLIENT_PREALLOCATE=false MEGAMOE_EP_TIMEOUT_S=60 PYTHONUNBUFFERED=1
GPUS=$(nvidia-smi -L | tee "$OUT/gpus.txt" | wc -l)
cat "$OUT/gpus.txt"
run() { echo "### $*"; timeout 120 "$@" 2>&1; echo "rc=$?"; }
# ensure_extension: the extension with its defaults, built unless this machine has one (~85 s).
ensure_extension() {
  python3 -c "import jax_megamoe as m, sys; sys.exit(not m.cuda_available())" 2>/dev/null \
    || JAX_MEGAMOE_CUDA_ARCHS=90a scripts/device_run.sh build || exit 1
}
# build_harnesses: the standalone harnesses into build/fused_core (CUTLASS from the carried wheel).
build_harnesses() {
  mkdir -p /tmp/cutlass && python3 -m zipfile -e .whl/nvidia_cutlass-*.whl /tmp/cutlass >/dev/null
  CUTLASS_INCLUDE=/tmp/cutlass/cutlass_library/source/include timeout 240 \
    sh benchmarks/kernels/build_fused_core_bench.sh build/fused_core \
    > "$OUT/harness_build.log" 2>&1 || { tail -30 "$OUT/harness_build.log"; exit 1; }
}
# bench_fwd_ep1 NAME RECIPE IMPLS SECONDS: bench_layer.py's EP = 1 forward (30B, 235B) into
# $OUT/NAME.{json,log}.
bench_fwd_ep1() {
  timeout "$4" python3 benchmarks/bench_layer.py --passes fwd --shapes 30b,235b --recipes "$2" \
    --impls "$3" --ep 1 --reps 10 --isolate off --out "$OUT/$1.json" 2>&1 \
    | tee "$OUT/$1.log" | tail -12
}
# clocks_start NAME / clocks_stop: the GPU's SM clock, power, temperature and clock-event
# reasons sampled every 200 ms while a step runs; clocks_stop appends the samples to
# $OUT/clocks_samples.csv (after a "# NAME" line) and their summary (benchmarks/gpu_clocks.py)
# to $OUT/clocks.log, and prints it.
clocks_start() {
  local reasons=clocks_event_reasons.active
  nvidia-smi --query-gpu=$reasons --format=csv >/dev/null 2>&1 \
    || reasons=clocks_throttle_reasons.active  # the older drivers' name
  CLOCKS_NAME=$1
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,$reasons \
    --format=csv,noheader,nounits -lms 200 > /tmp/clocks_$1.csv 2>&1 &
  CLOCKS_PID=$!
}
clocks_stop() {
  kill "$CLOCKS_PID" 2>/dev/null
  wait "$CLOCKS_PID" 2>/dev/null
  { echo "# $CLOCKS_NAME"; cat "/tmp/clocks_$CLOCKS_NAME.csv"; } >> "$OUT/clocks_samples.csv"
  python3 benchmarks/gpu_clocks.py "/tmp/clocks_$CLOCKS_NAME.csv" --label "$CLOCKS_NAME" \
    | tee -a "$OUT/clocks.log"
}
# logged_tests NAME SECONDS PYTEST_ARGS...: pytest verbose under SIGINT at its limit, its log and
# JUnit XML in $OUT (NAME.log, NAME.xml), its last lines printed, then the selected tests that
# did not finish (a run cut off at its limit still ends "N passed": scripts/tests_not_run.py).
logged_tests() {
  local name=$1 limit=$2
  shift 2
  timeout -s INT -k 30 "$limit" python3 -m pytest -v -rs --junitxml="$OUT/$name.xml" "$@" 2>&1 \
    | tee "$OUT/$name.log" | tail -25
  # Appended to the log (read whole before the first line is written): a call returns 8 files.
  python3 scripts/tests_not_run.py "$OUT/$name.log" "$OUT/$name.xml" | tee -a "$OUT/$name.log"
}
# multigpu_tests NAME SECONDS FILE...: the multigpu tests of FILEs.
multigpu_tests() {
  local name=$1 limit=$2
  shift 2
  logged_tests "$name" "$limit" --durations=0 -m multigpu "$@"
}

if [ "$GPUS" -ge 2 ]; then
  ensure_extension
  case "${PART:-ep2}" in
  ep2) multigpu_tests tests_fused_multigpu 420 tests/test_fused_multigpu.py \
    -k "all_gather or two_processes" ;;
  ep2_one_process) multigpu_tests tests_fused_one_process 420 tests/test_fused_multigpu.py \
    -k each_recipe ;;
  ep2_ep) multigpu_tests tests_ep_two_process 420 tests/test_ep_two_process.py \
    tests/test_workspace_context.py ;;
  ep2_train) multigpu_tests tests_two_process_training 480 tests/test_two_process_training.py ;;
  ep2_bench)
    timeout 200 python3 benchmarks/bench_layer.py --passes fwd --shapes 30b,235b \
      --recipes bf16,fp8 --impls megamoe:cuda,megamoe:fused --ep 2 --reps 10 --isolate off \
      --time-budget 160 \
      --out "$OUT/layer_fwd_ep2.json" 2>&1 | tee "$OUT/layer_fwd_ep2.log" | tail -20
    timeout 150 python3 examples/train_qwen3_moe.py --config qwen3-30b-a3b --num-layers 4 \
      --seq-len 4096 --batch 8 --ce-chunk 1024 --lr 3e-4 --backend fused --attention cudnn \
      --mesh data=1,expert=2 --steps 20 --log_every 10 --checkpoint_every 0 --out /tmp/ep2 \
      2>&1 | tr '\r' '\n' | grep -v "step/s\|s/step" | tail -12 | tee "$OUT/example_ep2.log"
    ;;
  *) echo "PART=${PART}: unknown with two GPUs (ep2, ep2_one_process, ep2_ep, ep2_train or"\
       "ep2_bench)"; exit 2 ;;
  esac
  exit 0
fi

case "${PART:-bars}" in
harness)
  build_harnesses
  B=build/fused_core
  # bf16: each build's checks (one log, a section per build), then its digests against the
  # staged build's.
  BUILDS="fused_core_bench_staged fused_core_bench fused_core_bench_defer12"
  for b in $BUILDS; do
    echo "#### $b"
    for pr in 0 1 6; do run $B/$b --problem $pr --engine 0; done
  done > "$OUT/harness_checks.log"
  tmp=$(mktemp -d)
  for b in $BUILDS; do
    awk -v h="#### $b" '/^#### /{on = ($0 == h); next} on' "$OUT/harness_checks.log" > "$tmp/$b"
    echo "$b: $(grep -c PASS "$tmp/$b") PASS, $(grep -c FAIL "$tmp/$b") FAIL"
    grep digest "$tmp/$b" > "$tmp/$b.digests"
  done
  for b in fused_core_bench fused_core_bench_defer12; do
    if [ -s "$tmp/$b.digests" ] && cmp -s "$tmp/fused_core_bench_staged.digests" "$tmp/$b.digests"
    then echo "$b: $(wc -l < "$tmp/$b.digests") digest lines, identical to the staged build's"
    else echo "$b: DIGESTS DIFFER from the staged build's (or none printed)"
    fi
  done
  rm -rf "$tmp"
  clocks_start harness_timing
  for round in 1 2; do
    for b in fused_core_bench_staged fused_core_bench fused_core_bench_defer12; do
      run $B/$b --problem 2 --engine 0 --variant 0 --nocheck
      run $B/$b --problem 2 --engine 0 --variant 10 --nocheck
      run $B/$b --problem 4 --engine 0 --variant 12 --nocheck
    done
    # L2's rows by TMA (one rank's layout); at 235B also L1 (N-major) and L2 alone, whose sum
    # against the one launch says whether mixing them costs (session 32, H100: it did not).
    run $B/fused_core_bench --problem 2 --engine 0 --variant 19 --nocheck
    run $B/fused_core_bench --problem 2 --engine 0 --variant 20 --nocheck
    run $B/fused_core_bench --problem 4 --engine 0 --variant 20 --nocheck
    run $B/fused_core_bench --problem 4 --engine 0 --variant 2 --nocheck
    run $B/fused_core_bench --problem 4 --engine 0 --variant 19 --nocheck
  done > "$OUT/harness_timing.log"
  clocks_stop
  grep -E "^### |L1 contiguous-A|one launch|rows by TMA" "$OUT/harness_timing.log" \
    | uniq | head -100
  ;;
bars)
  JAX_MEGAMOE_CUDA_ARCHS=90a scripts/device_run.sh build || exit 1
  # A call returns at most 8 files: the GPU's name and device_run.sh's summary (the build's
  # info) are printed above, the build log matters only when the build fails (device_run.sh
  # prints its tail then). Session 39 kept summary.txt, and the tests' log did not come back.
  rm -f "$OUT/gpus.txt" "$OUT/build.log" "$OUT/summary.txt"
  # The build's fused kernel against the reference and bitwise run to run (bf16, fp8, the kernel
  # backward, L2's rows by TMA) before it is timed: 18 tests, 120 s with -n 4 on an H100.
  logged_tests tests_fused_quick 200 -n 4 -m gpu tests/test_fused_moe.py \
    -k "one_gpu_matches_reference or bitwise or l2_rows"
  rm -f "$OUT/tests_fused_quick.xml"  # the log says the same; a call returns at most 8 files
  clocks_start layer_fwd_bf16_ep1
  bench_fwd_ep1 layer_fwd_bf16_ep1 bf16 megamoe:cuda,megamoe:fused 200
  clocks_stop
  clocks_start layer_fwd_fp8_ep1
  bench_fwd_ep1 layer_fwd_fp8_ep1 fp8 megamoe:cuda,megamoe:fused,megamoe:fused+blocks 250
  clocks_stop
  rm -f "$OUT"/*.png  # a call returns at most 8 files
  for recipe in bf16 fp8; do
    for shape in 30b 235b; do
      clocks_start "fused_overhead_${shape}_$recipe"
      echo "## $shape $recipe"
      # FP8 with weight blocks, as the table's fused + blocks row whose call the split explains.
      timeout 100 python3 benchmarks/fused_phases.py --shapes $shape --recipe $recipe --reps 10 \
        --overhead $([ $recipe = fp8 ] && echo --weight-blocks) 2>&1 \
        | grep -v "^WARNING\|^I0000\|^W0000"
      clocks_stop
    done
  done | tee "$OUT/fused_overhead.log" | grep -E "fwd: kernel|GEMM region|alone|queued|^clocks"
  ;;
energy)
  # Whether the card's power limit sets the backends' times: energy, mean power and the SM
  # clock per call, fused against cuda, calls queued for 3 s per run, two interleaved rounds
  # (session 39, H100: under the power cap the 235B bf16 forward's kernels ran at ~1.5 GHz with
  # fused and ~1.7 with cuda).
  ensure_extension
  for recipe in bf16 fp8; do
    timeout 200 python3 benchmarks/energy_per_call.py --shapes 30b,235b --recipe $recipe \
      --out "$OUT/energy_$recipe.json" 2>&1 | grep -v "^WARNING\|^I0000\|^W0000"
  done | tee "$OUT/energy.log"
  # What in the fused kernel draws the power at 235B bf16: the whole row copy before the tiles
  # (none beside them), L2's rows by generic stores, L1's tiles M-block-major; each against the
  # default, interleaved.
  timeout 200 python3 benchmarks/energy_per_call.py --shapes 235b --recipe bf16 --impls fused \
    --fused-env "MEGAMOE_FUSED_COPY_HEAD=100;MEGAMOE_FUSED_L2_TMA=0;MEGAMOE_FUSED_L1_ORDER=m" \
    --out "$OUT/energy_variants.json" 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" \
    | tee "$OUT/energy_variants.log"
  ;;
harness_energy)
  # Whether fewer bytes moved per tile buys time on a power-capped card (session 40, H200:
  # sustained, both backends hold the 700 W limit, and no override of the fused kernel moved its
  # energy per call). The harness's engines at 235B uniform, each run ~3 s of launches queued
  # back to back (the median launch is under the cap): S4 (the product's engine), S4-BK (B read
  # K-major) and S4-BK-C2 (S4-BK with 2-CTA clusters sharing B by multicast: half of B's
  # L2-to-SMEM traffic; session 17 measured it at parity at boost clocks); L1 N-major (variant
  # 2) and L2 (variant 7); two rounds, interleaved; the clock and power sampled beside each.
  build_harnesses
  for round in 1 2; do
    for engine in 0 2 3; do
      for variant in 2 7; do
        iters=600
        [ $variant = 7 ] && iters=1000
        clocks_start "r${round}_engine${engine}_variant$variant"
        timeout 60 build/fused_core/fused_core_bench --problem 4 --engine $engine \
          --variant $variant --nocheck --iters $iters 2>&1 | grep -E "TFLOP/s" | head -1
        clocks_stop
      done
    done
  done | tee "$OUT/harness_energy.log"
  ;;
step)
  # Backend "auto"'s pick at one GPU: the example's training step (the 30B config by default,
  # 16,384 tokens, remat full), cuda against fused, RECIPE=bf16 (default), fp8 or both
  # (RECIPE=bf16,fp8: ~5 min with the build at 235B x 1 layer, session 41's timing), in both run
  # orders. Eight layers do not fit an H100's 80 GB (both backends run out of memory in XLA's
  # autotuning), so an H100 runs four (LAYERS= overrides); CONFIG=qwen3-235b-a22b with LAYERS=1
  # times the 235B shape, whose bf16 forward is slower with fused than cuda on H100s (README).
  # Session 41: H100, 30B x 4, fused 0.5-0.9% faster (bf16, fp8); H200, 30B x 8 and 235B x 1
  # (bf16), fused 0.1-1.8% slower: "auto" keeps cuda.
  ensure_extension
  layers=${LAYERS:-$(grep -q H200 "$OUT/gpus.txt" && echo 8 || echo 4)}
  recipes=${RECIPE:-bf16}
  for recipe in ${recipes//,/ }; do
    for order in cuda,fused fused,cuda; do
      timeout 270 python3 benchmarks/bench_step.py --config "${CONFIG:-qwen3-30b-a3b}" \
        --layers "$layers" --backends $order --recipe "$recipe" --reps 10 --time-budget 200 \
        --out "$OUT/step_${recipe}_${order/,/_}.json" --md "$OUT/step.md" 2>&1 \
        | grep -v "^WARNING\|^I0000\|^W0000" | tee "$OUT/step_${recipe}_${order/,/_}.log" \
        | tail -4
    done
    # One log and one json per recipe (both orders; the json keyed by order): a call returns at
    # most 8 files.
    cat "$OUT/step_${recipe}"_*_*.log > "$OUT/step_${recipe}.log" 2>/dev/null
    python3 -c 'import json, sys; json.dump({f.split("/")[-1][:-5]: json.load(open(f))
      for f in sys.argv[2:]}, open(sys.argv[1], "w"), indent=1)' "$OUT/step_${recipe}.json" \
      "$OUT/step_${recipe}"_*_*.json
    rm -f "$OUT/step_${recipe}"_*_*.log "$OUT/step_${recipe}"_*_*.json
  done
  rm -f "$OUT"/*.png
  ;;
suite)
  # The one-GPU suite of the fused layer, the grouped MLP and the weight blocks, with the
  # extension's defaults: after a change to the kernels or their handlers; and the workspace's
  # CUDA context check (session 46). Session 38 (H100): 125 passed in 370 s; session 45: 132 in
  # 410 s; session 47: 133 of 134 by the 470 s limit (the build took 98 s), before the stale-
  # signal test dropped from 20 compiled sizes to 4 (~160 s less). 470 s keeps the build and
  # the tests inside one 600 s call.
  ensure_extension
  logged_tests tests_gpu_suite 470 -n 4 -m gpu tests/test_fused_moe.py \
    tests/test_grouped_mlp_ffi.py tests/test_weight_blocks.py tests/test_workspace_context.py
  ;;
phases)
  # Where the product's time goes today (bf16 and fp8, 30B and 235B: each phase of the fused
  # kernel, CTA 0's clock), and the FP8 core's L1 / L2 in the harness's four modes (the kernel,
  # no global stores, no SwiGLU math, no epilogue: differences place the epilogue's time).
  ensure_extension
  for recipe in bf16 fp8; do
    echo "## $recipe"
    timeout 120 python3 benchmarks/fused_phases.py --shapes 30b,235b --recipe $recipe --reps 10 \
      2>&1 | grep -v "^WARNING\|^I0000\|^W0000"
  done | tee "$OUT/fused_phases.log"
  # Whether the copy beside the tiles slows 235B bf16's GEMMs against CUTLASS's: the whole
  # copy first (100) against the default head (12) and none (0), interleaved (session 38, H100:
  # kernel 10.42 / 9.78 / 9.35 ms, GEMM region 9.23 / 9.23 / 8.89: it does not).
  timeout 150 python3 benchmarks/fused_phases.py --shapes 235b --copy-heads 100,12,0 --reps 10 \
    2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tee "$OUT/fused_copy_heads_235b.log" | tail -30
  build_harnesses
  timeout 150 build/fused_core/fused_core_fp8_bench --timing --only "E128 x 1024" --modes 0123 \
    --reps 21 2>&1 | tee "$OUT/fp8_modes.log" | grep -E "PASS|FAIL|median" | tail -12
  ;;
*)
  echo "PART=${PART}: unknown (bars, energy, harness_energy, step, suite, harness or phases)"
  exit 2
  ;;
esac

#!/bin/sh
# A/B of two builds of the standalone harnesses (two output directories of
# build_fused_core_bench.sh, e.g. main's and a change's), on one GPU:
#   1. each build's checks: the bf16 harness's problems 0, 1 and 6 (odd sizes, one token, F = 128)
#      in its product build (L1 epilogue deferred) and its staged build, the FP8 harness's
#      problems, the dgrad harness's problems 0 and 1; each harness also runs its exhaustive
#      fast-path test (every bf16 gate value against the exact SwiGLU / SwiGLU backward);
#   2. the digests of B's outputs against A's, build by build (bit for bit);
#   3. timing, A then B, ROUNDS times (clocks and heat shared): bf16 30B L1, 30B L1 + L2 in one
#      launch and 235B one launch, in both bf16 builds; FP8 30B (the kernel, mode 0); the dgrad
#      core at 30B.
# Each step has its own time limit. Writes OUT/checks_A.log, checks_B.log, timing.log and
# summary.txt (printed last, after the timing lines).
# Usage: benchmarks/kernels/harness_ab.sh A_DIR B_DIR OUT [ROUNDS]   (ROUNDS default 2)
set -u
A=$1 B=$2 OUT=$3 ROUNDS=${4:-2}
mkdir -p "$OUT"
run() { echo "### $*"; timeout 150 "$@" 2>&1; echo "rc=$?"; }
BF16="fused_core_bench fused_core_bench_staged"
# checks DIR: every check of one side's builds, each harness's section headed "#### NAME".
checks() {
  for b in $BF16; do
    echo "#### $b"
    for pr in 0 1 6; do run "$1/$b" --problem $pr --engine 0; done
  done
  echo "#### fused_core_fp8_bench"
  run "$1/fused_core_fp8_bench"
  echo "#### fused_dgrad_bench"
  for pr in 0 1; do run "$1/fused_dgrad_bench" --problem $pr; done
}
checks "$A" > "$OUT/checks_A.log"
checks "$B" > "$OUT/checks_B.log"
# section SIDE NAME: the lines of harness NAME's section in SIDE's checks.
section() { awk -v h="#### $2" '/^#### /{on = ($0 == h); next} on' "$OUT/checks_$1.log"; }
tmp=$(mktemp -d)
{
  for side in A B; do
    for b in $BF16 fused_core_fp8_bench fused_dgrad_bench; do
      section $side $b > "$tmp/$side.$b"
      echo "$side $b: $(grep -c PASS "$tmp/$side.$b") PASS, $(grep -c FAIL "$tmp/$side.$b") FAIL," \
        "rc != 0: $(grep -c 'rc=[1-9]' "$tmp/$side.$b")"
    done
  done
  grep -h "fast path" "$OUT"/checks_A.log "$OUT"/checks_B.log | sort | uniq -c
  # (The dgrad harness prints no digests: its check compares dgate_up with backend cuda's
  # SwigluBackward word for word, "0 words differ".)
  grep -ho "dgate_up vs cuda SwigluBackward: [0-9]* words differ" "$OUT"/checks_*.log \
    | sort | uniq -c
  for b in $BF16 fused_core_fp8_bench; do
    grep digest "$tmp/A.$b" > "$tmp/dA"
    grep digest "$tmp/B.$b" > "$tmp/dB"
    if [ -s "$tmp/dA" ] && cmp -s "$tmp/dA" "$tmp/dB"; then
      echo "$b: $(wc -l < "$tmp/dA") digest lines, B's identical to A's"
    else
      echo "$b: DIGESTS DIFFER between A and B (or none printed)"
    fi
  done
} > "$OUT/summary.txt"
rm -rf "$tmp"
for round in $(seq "$ROUNDS"); do
  for side in A B; do
    dir=$A; [ $side = B ] && dir=$B
    echo "## round $round, $side ($dir)"
    for b in $BF16; do
      run "$dir/$b" --problem 2 --engine 0 --variant 0 --nocheck
      run "$dir/$b" --problem 2 --engine 0 --variant 10 --nocheck
      run "$dir/$b" --problem 4 --engine 0 --variant 12 --nocheck
    done
    run "$dir/fused_core_fp8_bench" --timing --only "E128 x 1024" --modes 0
    run "$dir/fused_dgrad_bench" --problem 2 --nocheck
  done
done > "$OUT/timing.log"
# Each bf16 and dgrad line is printed twice by its harness (the run, then its summary).
grep -E "^## |L1 contiguous-A \(TMA box\)|one launch|median" "$OUT/timing.log" | uniq
cat "$OUT/summary.txt"

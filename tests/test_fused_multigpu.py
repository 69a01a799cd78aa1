"""Backend "fused" with its EP group across two GPUs (EP = 2), in both process models: one
process driving both GPUs (forward and gradients against the oracle, bitwise run to run; and
beside an all_gather that XLA may run on another stream at the same time; the backward on
backend cuda's kernels), and one process per GPU (jax.distributed on localhost; the backward's
kernel pass); and from one process, bf16 with the backward's kernel pass and recipes fp8 /
fp8_pow2. The workers run as subprocesses with a time limit, so a hang fails the test instead
of stalling the suite. Two GPUs; skipped (reported as not run) with fewer."""

import sys

import pytest

from subprocesses import TESTS, free_port, gpu_worker_env, outputs_report, run_all

pytestmark = pytest.mark.multigpu

EP_TIMEOUT_S = 20  # every wait of the EP kernels gives up after this (then the test fails)
# A worker's whole run (compilation, 20+ calls, the oracle): a hang fails one test without
# using up the device call that runs all four (scripts/next_device_call.sh PART=ep2, 420 s).
TIME_LIMIT_S = 200


REPORT_TAIL = 4000  # characters of each worker's output a failure shows


def test_one_process_two_gpus_beside_an_all_gather():
  """The fused layer and an all_gather in one jit program, 20 calls: neither hangs nor gives a
  wrong answer (the kernel leaves SMs to other kernels when EP spans GPUs: fused.max_ctas).
  Its gradients take backend cuda's kernels on the residuals (MEGAMOE_FUSED_BACKWARD=0); the
  two-process test takes the backward's kernel pass."""
  env = gpu_worker_env(MEGAMOE_EP_TIMEOUT_S=str(EP_TIMEOUT_S), MEGAMOE_FUSED_BACKWARD="0",
                       XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true")
  procs, outs = run_all([[sys.executable, "-m", "fused_multigpu_worker", "all_gather"]], [env],
                        timeout=TIME_LIMIT_S, cwd=str(TESTS.parent))
  assert procs[0].returncode == 0 and "FUSED-WORKER-OK 0" in outs[0], (
      outputs_report(procs, outs, REPORT_TAIL))
  # Right answers alone would pass with the two run one after the other: unless the program has
  # the kernel inside the collective's window, what this test is for did not run (the answers,
  # right, are not a failure of the kernel).
  if "FUSED-WORKER-CONCURRENCY overlapped" not in outs[0]:
    pytest.skip("not run: XLA did not schedule the fused layer inside the all_gather's "
                "asynchronous window, so the two never ran at the same time (issue 14 item 3 "
                "untested; the 20 calls' answers were right):\n" + outs[0][-1500:])


def test_two_processes_one_gpu_each():
  port = free_port()
  env = gpu_worker_env(MEGAMOE_EP_TIMEOUT_S=str(EP_TIMEOUT_S))
  commands = [[sys.executable, "-m", "fused_multigpu_worker", "two_process", str(i), str(port)]
              for i in range(2)]
  procs, outs = run_all(commands, [env, env], timeout=TIME_LIMIT_S, cwd=str(TESTS.parent))
  for i, (p, out) in enumerate(zip(procs, outs)):
    assert p.returncode == 0 and f"FUSED-WORKER-OK {i}" in out, (
        outputs_report(procs, outs, REPORT_TAIL))


@pytest.mark.parametrize("recipe", ["bf16", "fp8", "fp8_pow2"])
def test_one_process_each_recipe(recipe):
  """One process, the EP group across its two GPUs. bf16: the backward's kernel pass (the
  all_gather test takes backend cuda's kernels, the two-process test the kernel pass across
  processes). fp8 / fp8_pow2: e4m3 rows + scales over NVLink into the peer's pool, both GEMMs
  in FP8, against the FP8 emulation. Forward and gradients, 20 calls bitwise equal."""
  env = gpu_worker_env(MEGAMOE_EP_TIMEOUT_S=str(EP_TIMEOUT_S))
  procs, outs = run_all([[sys.executable, "-m", "fused_multigpu_worker", "two_gpus", recipe]],
                        [env], timeout=TIME_LIMIT_S, cwd=str(TESTS.parent))
  assert procs[0].returncode == 0 and "FUSED-WORKER-OK 0" in outs[0], (
      outputs_report(procs, outs, REPORT_TAIL))

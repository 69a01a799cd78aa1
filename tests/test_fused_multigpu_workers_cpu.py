"""The two-GPU workers of tests/test_fused_multigpu.py, dry-run on the CPU: every mode on backend
reference over two CPU devices (or two processes of one each), so that the workers' own code --
the shardings, the oracle (FP8's included), jax.distributed, the checks and their messages -- is
tested in CI, though the two GPUs that run them for real are rarely lent. What this cannot test
is the fused kernel itself (FUSED_WORKER_BACKEND in tests/fused_multigpu_worker.py)."""

import os
import sys

import pytest

from subprocesses import TESTS, free_port, outputs_report, run_all

TIME_LIMIT_S = 300


def _env(devices: int) -> dict:
  # tests/ only on the path (and as the working directory): the workers import the installed
  # package, as the tests do.
  env = dict(os.environ, FUSED_WORKER_BACKEND="reference", JAX_PLATFORMS="cpu",
             PYTHONUNBUFFERED="1",
             PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
  for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    env.pop(name, None)
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  return env


def _run(commands, envs):
  procs, outs = run_all(commands, envs, timeout=TIME_LIMIT_S, cwd=str(TESTS))
  report = outputs_report(procs, outs)
  for i, (p, out) in enumerate(zip(procs, outs)):
    assert p.returncode == 0 and f"FUSED-WORKER-OK {i}" in out, report
  return outs


@pytest.mark.parametrize("recipe", ["bf16", "fp8"])
def test_one_process_two_devices(recipe):
  out = _run([[sys.executable, "-m", "fused_multigpu_worker", "two_gpus", recipe]], [_env(2)])[0]
  assert "process 0: rel errors" in out


def test_beside_an_all_gather():
  """The worker reports whether the layer ran inside the collective's window (on the CPU there
  is no asynchronous all-gather, so: not overlapped, and the test on GPUs would say not run)."""
  out = _run([[sys.executable, "-m", "fused_multigpu_worker", "all_gather"]], [_env(2)])[0]
  assert "FUSED-WORKER-CONCURRENCY not-overlapped" in out, out[-2000:]


def test_two_processes():
  port = free_port()
  outs = _run([[sys.executable, "-m", "fused_multigpu_worker", "two_process", str(i), str(port)]
               for i in range(2)], [_env(1), _env(1)])
  for i, out in enumerate(outs):
    assert f"process {i}: rel errors" in out


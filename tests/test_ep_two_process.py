"""Expert-parallel kernels with one process per GPU (jax.distributed on localhost): CUDA IPC
handles exchanged through jax.distributed's key-value store, forward and gradients against the
oracle, with the workspace created up front or while jax.jit traces, each process's GPU chosen by
local_device_ids (every GPU visible) or by CUDA_VISIBLE_DEVICES; and a process that dies mid-step
makes the other fail within the EP timeout instead of hanging."""

import os
import re
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

pytestmark = pytest.mark.multigpu

_TESTS = Path(__file__).resolve().parent
EP_TIMEOUT_S = 10


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run_workers(mode: str, visibility: str, extra_env=None, timeout=240):
  port = _free_port()
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(_TESTS), str(_TESTS.parent),
                                       env.get("PYTHONPATH", "")])
  env.pop("XLA_FLAGS", None)  # no virtual CPU devices in the workers
  env.pop("CUDA_VISIBLE_DEVICES", None)
  env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
             XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1", **(extra_env or {}))
  procs = []
  for i in range(2):
    own = dict(env, CUDA_VISIBLE_DEVICES=str(i)) if visibility == "cuda_visible_devices" else env
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "ep_two_process_worker", str(i), str(port), mode], env=own,
        cwd=str(_TESTS.parent), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
  outs = []
  try:
    for p in procs:
      out, _ = p.communicate(timeout=timeout)
      outs.append(out)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  return procs, outs


@pytest.mark.parametrize("visibility", ["local_device_ids", "cuda_visible_devices"])
@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_two_processes_one_gpu_each(mode, visibility):
  procs, outs = _run_workers(mode, visibility)
  for i, (p, out) in enumerate(zip(procs, outs)):
    assert p.returncode == 0 and f"EP-WORKER-OK {i}" in out, f"process {i}:\n{out[-4000:]}"


def test_a_process_dying_mid_step_makes_the_other_fail_not_hang():
  procs, outs = _run_workers("die", "local_device_ids",
                             extra_env=dict(MEGAMOE_EP_TIMEOUT_S=str(EP_TIMEOUT_S)))
  report = "\n".join(f"--- process {i} (exit {p.returncode}):\n{o[-3000:]}"
                     for i, (p, o) in enumerate(zip(procs, outs)))
  assert procs[1].returncode == 17 and "EP-WORKER-DYING 1" in outs[1], report
  failure = re.search(r"EP-WORKER-PEER-FAILURE ([\d.]+) call \d+: (.*)", outs[0])
  if failure is None:
    # jax.distributed's own failure detection (missing heartbeats, 100 s by default) may end the
    # process first: also a failure with a message, not a hang, but not the EP timeout's.
    assert "JAX distributed service detected fatal errors" in outs[0], report
    warnings.warn("process 0 was ended by jax.distributed's failure detection before the EP "
                  "timeout fired")
    return
  elapsed, message = float(failure.group(1)), failure.group(2)
  assert "timed out after" in message and "rank 0" in message, report
  assert elapsed < EP_TIMEOUT_S + 30, report

"""Expert-parallel kernels with one process per GPU (jax.distributed on localhost): CUDA IPC
handles exchanged through process_allgather, forward and gradients against the oracle."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multigpu

_TESTS = Path(__file__).resolve().parent


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_one_gpu_each():
  port = _free_port()
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(_TESTS), str(_TESTS.parent),
                                       env.get("PYTHONPATH", "")])
  env.pop("XLA_FLAGS", None)  # no virtual CPU devices in the workers
  env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
             XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1")
  procs = [subprocess.Popen([sys.executable, "-m", "ep_two_process_worker", str(i), str(port)],
                            env=env, cwd=str(_TESTS.parent), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(2)]
  outs = []
  try:
    for p in procs:
      out, _ = p.communicate(timeout=240)
      outs.append(out)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for i, (p, out) in enumerate(zip(procs, outs)):
    assert p.returncode == 0 and f"EP-WORKER-OK {i}" in out, f"process {i}:\n{out[-4000:]}"

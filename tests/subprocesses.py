"""Running test workers as separate processes: a free localhost port for jax.distributed, and
processes run to completion (or killed at a time limit, so that a hang fails, not stalls)."""

import os
import socket
import subprocess
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_all(commands: list[list[str]], envs: list[dict], *, timeout: float, cwd=None
            ) -> tuple[list[subprocess.Popen], list[str]]:
  """Starts commands[i] with envs[i] together, waits for all (stdout and stderr merged) and
  kills whatever still runs at `timeout` seconds (subprocess.TimeoutExpired propagates)."""
  procs = [subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
           for cmd, env in zip(commands, envs)]
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=timeout)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  return procs, outs


def gpu_worker_env(**extra) -> dict:
  """The environment of a GPU test worker: tests/ and the repo on PYTHONPATH (workers are run as
  `python -m <module>` from the repo root), every GPU visible, no virtual CPU devices, never
  NVLink multicast, no preallocation (workers share the GPUs)."""
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(TESTS.parent), env.get("PYTHONPATH", "")])
  env.pop("XLA_FLAGS", None)
  env.pop("CUDA_VISIBLE_DEVICES", None)
  env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
             XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1", **extra)
  return env

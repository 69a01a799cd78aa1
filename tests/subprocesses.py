"""Running test workers as separate processes: a free localhost port for jax.distributed, and
processes run to completion (or killed at a time limit, so that a hang fails, not stalls, and
says where each process was)."""

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class WorkersTimedOut(subprocess.TimeoutExpired):
  """Workers still running at run_all's time limit (killed); the message carries every worker's
  last output, so that a hang shows where each process was."""

  def __init__(self, cmd, timeout, report: str):
    super().__init__(cmd, timeout)
    self.report = report

  def __str__(self):
    return f"workers still running after {self.timeout} s, killed:\n{self.report}"


def run_all(commands: list[list[str]], envs: list[dict], *, timeout: float, cwd=None,
            peer_grace: float | None = 60.0) -> tuple[list[subprocess.Popen], list[str]]:
  """Starts commands[i] with envs[i] together and waits for all (stdout and stderr merged, read
  by one thread per process, so that no pipe fills and stalls a worker).

  A worker that exits with a non-zero code usually leaves its peers blocked (in a collective,
  a handshake or a kernel's wait): `peer_grace` seconds later the ones still running are killed
  and their output says so (None: wait for them until `timeout`). At `timeout` seconds every
  worker still running is killed and WorkersTimedOut (a subprocess.TimeoutExpired) is raised
  with each worker's last output.
  """
  procs = [subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
           for cmd, env in zip(commands, envs)]
  chunks: list[list[str]] = [[] for _ in procs]
  readers = [threading.Thread(target=lambda p=p, c=c: c.extend(iter(p.stdout.readline, "")),
                              daemon=True) for p, c in zip(procs, chunks)]
  for r in readers:
    r.start()
  start = time.monotonic()
  failed = None  # (when, which, exit code) of the first worker that exited non-zero
  cause = None  # why the wait ended with workers still running: "timeout" or "peer failed"
  try:
    while None in [p.poll() for p in procs]:  # every worker polled (sets its returncode)
      now = time.monotonic()
      if now - start > timeout:
        cause = "timeout"
        break
      if failed is None:
        bad = [i for i, p in enumerate(procs) if p.returncode not in (None, 0)]
        if bad:
          failed = (now, bad[0], procs[bad[0]].returncode)
      elif peer_grace is not None and now - failed[0] > peer_grace:
        cause = "peer failed"
        break
      time.sleep(0.2)
  finally:
    still = [i for i, p in enumerate(procs) if p.poll() is None]
    for i in still:
      procs[i].kill()
    for p in procs:
      p.wait()
    for r in readers:
      r.join(timeout=10)
  outs = ["".join(c) for c in chunks]
  if cause == "peer failed":
    for i in still:
      outs[i] += (f"\n[run_all: killed {peer_grace:.0f} s after process {failed[1]} exited with "
                  f"code {failed[2]}]")
  if cause == "timeout":
    raise WorkersTimedOut(commands, timeout, outputs_report(procs, outs, killed=still))
  return procs, outs


def outputs_report(procs, outs, tail: int = 3000, killed=()) -> str:
  """Each worker's exit (or "killed at the time limit" for the indices in `killed`) and the last
  `tail` characters of its output: what a failed multi-process test prints."""
  return "\n".join(
      f"--- process {i} ({'killed at the time limit' if i in killed else f'exit {p.returncode}'})"
      f":\n{o[-tail:]}" for i, (p, o) in enumerate(zip(procs, outs)))


def visible_gpu(i: int, env=None) -> str:
  """The CUDA_VISIBLE_DEVICES value that gives a worker the i-th GPU this test process sees:
  the i-th entry of the test process's own CUDA_VISIBLE_DEVICES where it has one (a slice of a
  larger host: "0" would name the host's first GPU, not the slice's), else str(i)."""
  env = os.environ if env is None else env
  entries = _launch().visible_gpu_entries(env)
  if entries is None:
    return str(i)
  if i >= len(entries):
    raise ValueError(f"GPU {i} asked of CUDA_VISIBLE_DEVICES="
                     f"{env['CUDA_VISIBLE_DEVICES']!r}, which names {len(entries)}")
  return entries[i]


def _launch():
  """examples/launch.py, which reads CUDA_VISIBLE_DEVICES as CUDA does."""
  sys.path.insert(0, str(TESTS.parent / "examples"))
  try:
    import launch  # noqa: PLC0415
  finally:
    sys.path.pop(0)
  return launch


def gpu_worker_env(**extra) -> dict:
  """The environment of a GPU test worker: tests/ and the repo on PYTHONPATH (workers are run as
  `python -m <module>` from the repo root), the GPUs this test process sees (its
  CUDA_VISIBLE_DEVICES kept, so that a worker's local_device_ids=[i] is the same i-th GPU), no
  virtual CPU devices, never NVLink multicast, no preallocation (workers share the GPUs)."""
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(TESTS.parent), env.get("PYTHONPATH", "")])
  env.pop("XLA_FLAGS", None)
  env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
             XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1", **extra)
  return env

"""How a process of the examples joins a multi-process run, and which GPUs it drives.

Several processes (one per host, or one per GPU) are joined with jax.distributed.initialize when
the environment says so:
  JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID   any launcher (host:port of
                                                               process 0, count, this one's index)
  SLURM (srun, SLURM_NTASKS > 1) or Open MPI (mpirun, OMPI_COMM_WORLD_SIZE > 1): jax finds them

The GPUs of this process (jax.distributed.initialize's local_device_ids, chosen here because
jax's own default under SLURM / Open MPI -- GPU <local rank> -- is wrong for one process per host
and for a launcher that already gave each process its GPU):
  MEGAMOE_LOCAL_DEVICE_IDS=all          every GPU the process sees (one process per host)
  MEGAMOE_LOCAL_DEVICE_IDS=local_rank   GPU number <local rank> (one process per GPU, all visible)
  MEGAMOE_LOCAL_DEVICE_IDS=0,1          these ordinals (among the GPUs the process sees)
  unset: JAX_LOCAL_DEVICE_IDS if set (jax's own), else from the launcher's processes per host
  (SLURM_STEP_TASKS_PER_NODE / SLURM_NTASKS_PER_NODE / SLURM_TASKS_PER_NODE,
  OMPI_COMM_WORLD_LOCAL_SIZE, LOCAL_WORLD_SIZE) and local rank (SLURM_LOCALID,
  OMPI_COMM_WORLD_LOCAL_RANK, LOCAL_RANK): one process on the host -> every GPU it sees; several,
  each seeing fewer GPUs than there are processes (the launcher set CUDA_VISIBLE_DEVICES per
  process, e.g. srun --gpus-per-task=1) -> every GPU it sees; several, each seeing them all ->
  GPU <local rank>. Several processes on a host with no launcher variable need one of the above
  (or CUDA_VISIBLE_DEVICES per process): they would all drive every GPU.
"""

from __future__ import annotations

import ctypes
import os
import re
from typing import Mapping

LOCAL_DEVICE_IDS_ENV = "MEGAMOE_LOCAL_DEVICE_IDS"


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int | None:
  if name not in env:
    return default
  try:
    return int(env[name])
  except ValueError:
    raise ValueError(f"{name} must be an integer, got {env[name]!r}") from None


def _slurm_tasks_on_this_node(env: Mapping[str, str]) -> int | None:
  """Tasks of this job step on this node, from SLURM's "2(x3),1"-style lists."""
  for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
    spec = env.get(name, "").strip()
    if not spec:
      continue
    counts = []
    for part in spec.split(","):
      m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
      if m is None:
        raise ValueError(f"{name} must look like '2(x3),1', got {spec!r}")
      counts += [int(m.group(1))] * int(m.group(2) or 1)
    node = _int(env, "SLURM_NODEID", 0)
    return counts[node] if len(counts) > 1 and node < len(counts) else counts[0]
  return None


def local_rank_and_size(env: Mapping[str, str]) -> tuple[int | None, int | None]:
  """(this process's index among the processes of its host, how many there are), as the
  launcher says; None where it says nothing."""
  if _int(env, "SLURM_NTASKS", 1) > 1 and "SLURM_LOCALID" in env:
    return _int(env, "SLURM_LOCALID"), _slurm_tasks_on_this_node(env)
  if "OMPI_COMM_WORLD_LOCAL_RANK" in env:
    return (_int(env, "OMPI_COMM_WORLD_LOCAL_RANK"),
            _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE"))
  if "LOCAL_RANK" in env:
    return _int(env, "LOCAL_RANK"), _int(env, "LOCAL_WORLD_SIZE")
  return None, None


def visible_gpu_entries(env: Mapping[str, str]) -> list[str] | None:
  """CUDA_VISIBLE_DEVICES's entries up to the first invalid one, as CUDA reads it (indices or
  UUIDs); None where it is unset (every GPU visible)."""
  visible = env.get("CUDA_VISIBLE_DEVICES")
  if visible is None:
    return None
  entries = []
  for entry in visible.split(","):
    if not entry.strip() or entry.strip().startswith("-"):
      break
    entries.append(entry.strip())
  return entries


def visible_gpu_count(env: Mapping[str, str]) -> int:
  """GPUs this process sees, before JAX initialises: CUDA_VISIBLE_DEVICES's entries (up to the
  first invalid one, as CUDA reads it), else the CUDA driver's count (0 without a driver)."""
  entries = visible_gpu_entries(env)
  if entries is not None:
    return len(entries)
  try:
    cuda = ctypes.CDLL("libcuda.so.1")
  except OSError:
    return 0
  count = ctypes.c_int(0)
  if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
    return 0
  return count.value


def local_device_ids(env: Mapping[str, str], gpu_count: int) -> list[int] | None:
  """The GPU ordinals this process drives (see the module doc); None: leave it to jax (no GPU,
  or JAX_LOCAL_DEVICE_IDS)."""
  spec = env.get(LOCAL_DEVICE_IDS_ENV, "").strip()
  rank, size = local_rank_and_size(env)
  if spec == "all":
    return list(range(gpu_count)) or None
  if spec == "local_rank":
    if rank is None:
      raise ValueError(f"{LOCAL_DEVICE_IDS_ENV}=local_rank, but the launcher set no local rank "
                       f"(SLURM_LOCALID, OMPI_COMM_WORLD_LOCAL_RANK or LOCAL_RANK)")
    if gpu_count and rank >= gpu_count:
      raise ValueError(f"{LOCAL_DEVICE_IDS_ENV}=local_rank: local rank {rank}, but this process "
                       f"sees {gpu_count} GPU(s)")
    return [rank]
  if spec:
    try:
      ids = [int(part) for part in spec.split(",")]
    except ValueError:
      raise ValueError(f"{LOCAL_DEVICE_IDS_ENV} must be 'all', 'local_rank' or GPU ordinals such "
                       f"as '0,1', got {spec!r}") from None
    if gpu_count and not all(0 <= i < gpu_count for i in ids):
      raise ValueError(f"{LOCAL_DEVICE_IDS_ENV}={spec}: this process sees {gpu_count} GPU(s), "
                       f"ordinals 0..{gpu_count - 1}")
    return ids
  if env.get("JAX_LOCAL_DEVICE_IDS") or gpu_count == 0:
    return None
  if size is None or size <= 1 or gpu_count < size:
    return list(range(gpu_count))
  if rank is None or not 0 <= rank < gpu_count:
    raise ValueError(f"{size} processes on this host, each seeing {gpu_count} GPUs, but the "
                     f"local rank is {rank}: set {LOCAL_DEVICE_IDS_ENV}")
  return [rank]


def distributed_kwargs(env: Mapping[str, str], gpu_count: int | None = None) -> dict | None:
  """Arguments of jax.distributed.initialize for this process; None for a single process.
  gpu_count: GPUs this process sees (default: visible_gpu_count)."""
  explicit = "JAX_NUM_PROCESSES" in env
  if not (explicit or _int(env, "SLURM_NTASKS", 1) > 1
          or _int(env, "OMPI_COMM_WORLD_SIZE", 1) > 1):
    return None
  kwargs = {}
  if explicit:
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_PROCESS_ID"):
      if not env.get(name):
        raise ValueError(f"JAX_NUM_PROCESSES={env['JAX_NUM_PROCESSES']} is set, so {name} must "
                         f"be too (JAX_COORDINATOR_ADDRESS: host:port of process 0; "
                         f"JAX_PROCESS_ID: this process's index)")
    kwargs = dict(coordinator_address=env["JAX_COORDINATOR_ADDRESS"],
                  num_processes=_int(env, "JAX_NUM_PROCESSES"),
                  process_id=_int(env, "JAX_PROCESS_ID"))
  # else: jax reads the coordinator, count and index from SLURM / Open MPI itself.
  ids = local_device_ids(env, visible_gpu_count(env) if gpu_count is None else gpu_count)
  if ids is not None:
    kwargs["local_device_ids"] = ids
  return kwargs


def init_distributed(env: Mapping[str, str] | None = None) -> None:
  """jax.distributed.initialize() when launched as several processes (before any other JAX
  call); prints which devices this process drives."""
  kwargs = distributed_kwargs(os.environ if env is None else env)
  if kwargs is None:
    return
  import jax
  jax.distributed.initialize(**kwargs)
  print(f"process {jax.process_index()} of {jax.process_count()}: local devices "
        f"{jax.local_devices()}", flush=True)

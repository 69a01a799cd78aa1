"""examples/launch.py: which processes join a run and which GPUs each drives, for the launch
layouts of a pod (pure functions of the environment; nothing is initialised)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))
import launch  # noqa: E402

sys.path.pop(0)

EXPLICIT = dict(JAX_COORDINATOR_ADDRESS="10.0.0.1:1234", JAX_NUM_PROCESSES="2",
                JAX_PROCESS_ID="1")
SLURM = dict(SLURM_JOB_ID="77", SLURM_STEP_NODELIST="node[1-2]", SLURM_PROCID="9")


def test_single_process_needs_no_initialisation():
  assert launch.distributed_kwargs({}, gpu_count=8) is None
  assert launch.distributed_kwargs(dict(SLURM_NTASKS="1", SLURM_LOCALID="0"), gpu_count=8) is None


def test_explicit_variables():
  want = dict(coordinator_address="10.0.0.1:1234", num_processes=2, process_id=1)
  assert launch.distributed_kwargs(EXPLICIT, gpu_count=0) == want  # CPU: no GPU to choose
  # One process per host: every GPU it sees.
  assert launch.distributed_kwargs(EXPLICIT, gpu_count=8) == want | dict(
      local_device_ids=list(range(8)))
  # One process per GPU, every GPU visible, local rank from the launcher (torchrun-style).
  env = EXPLICIT | dict(LOCAL_RANK="1", LOCAL_WORLD_SIZE="2")
  assert launch.distributed_kwargs(env, gpu_count=2)["local_device_ids"] == [1]
  # Same, but the launcher set CUDA_VISIBLE_DEVICES per process: its one GPU.
  env = env | dict(CUDA_VISIBLE_DEVICES="1")
  assert launch.distributed_kwargs(env)["local_device_ids"] == [0]
  with pytest.raises(ValueError, match="JAX_NUM_PROCESSES=2 is set, so JAX_PROCESS_ID must be"):
    launch.distributed_kwargs({k: v for k, v in EXPLICIT.items() if k != "JAX_PROCESS_ID"}, 0)
  with pytest.raises(ValueError, match="JAX_PROCESS_ID must be an integer, got 'one'"):
    launch.distributed_kwargs(EXPLICIT | dict(JAX_PROCESS_ID="one"), 0)


@pytest.mark.parametrize("tasks_per_node, gpus, local_id, want", [
    ("1(x2)", 8, "0", list(range(8))),   # srun --ntasks-per-node=1: one process per host
    ("8(x2)", 8, "3", [3]),              # one process per GPU, every GPU visible
    ("8(x2)", 1, "3", [0]),              # srun --gpus-per-task=1: the launcher's GPU
    ("2(x3),1", 8, "0", list(range(8))),  # node 3 of a ragged step runs one task
])
def test_slurm_layouts(tasks_per_node, gpus, local_id, want):
  env = SLURM | dict(SLURM_NTASKS="7", SLURM_LOCALID=local_id,
                     SLURM_STEP_TASKS_PER_NODE=tasks_per_node,
                     SLURM_NODEID="3" if "," in tasks_per_node else "0")
  # The coordinator, count and index are jax's SLURM detection's; the GPUs are chosen here
  # (jax alone would give every process GPU <SLURM_LOCALID> only).
  assert launch.distributed_kwargs(env, gpu_count=gpus) == dict(local_device_ids=want)


def test_open_mpi_local_rank():
  env = dict(OMPI_COMM_WORLD_SIZE="16", OMPI_COMM_WORLD_LOCAL_RANK="5",
             OMPI_COMM_WORLD_LOCAL_SIZE="8")
  assert launch.distributed_kwargs(env, gpu_count=8) == dict(local_device_ids=[5])


def test_megamoe_local_device_ids_overrides():
  env = EXPLICIT | dict(LOCAL_RANK="1", LOCAL_WORLD_SIZE="2")
  ids = lambda value, gpus=8: launch.distributed_kwargs(
      env | {launch.LOCAL_DEVICE_IDS_ENV: value}, gpu_count=gpus).get("local_device_ids")
  assert ids("all") == list(range(8))
  assert ids("local_rank") == [1]
  assert ids("2,3") == [2, 3]
  with pytest.raises(ValueError, match=r"MEGAMOE_LOCAL_DEVICE_IDS must be 'all', 'local_rank' "
                                       r"or GPU ordinals such as '0,1', got 'gpu0'"):
    ids("gpu0")
  with pytest.raises(ValueError, match="MEGAMOE_LOCAL_DEVICE_IDS=4: this process sees 2 GPU"):
    ids("4", gpus=2)
  with pytest.raises(ValueError, match="local_rank, but the launcher set no local rank"):
    launch.local_device_ids({launch.LOCAL_DEVICE_IDS_ENV: "local_rank"}, 8)
  # jax's own variable is left to jax.
  assert "local_device_ids" not in launch.distributed_kwargs(
      EXPLICIT | dict(JAX_LOCAL_DEVICE_IDS="3"), gpu_count=8)


def test_visible_gpu_count_reads_cuda_visible_devices_as_cuda_does():
  assert launch.visible_gpu_count(dict(CUDA_VISIBLE_DEVICES="0,1")) == 2
  assert launch.visible_gpu_count(dict(CUDA_VISIBLE_DEVICES="")) == 0
  assert launch.visible_gpu_count(dict(CUDA_VISIBLE_DEVICES="2,-1,3")) == 1
  assert launch.visible_gpu_count(dict(CUDA_VISIBLE_DEVICES="GPU-8f1e,GPU-77aa")) == 2

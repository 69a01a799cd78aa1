"""examples/train_qwen3_moe.py launched as two processes (jax.distributed on localhost): it
trains, saves and resumes checkpoints across processes, and its losses match the one-process run
of the same mesh.

CPU (CI): 2 processes x 2 CPU devices (gloo collectives), backend reference, mesh data=2,
expert=2 -- the multi-host layout, EP inside a process, FSDP/data across processes.
GPU (multigpu, 2 GPUs): backend cuda in the launch layouts of a pod -- EP across processes (one
GPU each; every GPU visible with the GPU chosen from the local rank, and CUDA_VISIBLE_DEVICES per
process), and data=2, expert=1 (only data parallelism crosses processes).
"""

import json
import os
import re
import shutil
import sys

import numpy as np
import pytest

from subprocesses import free_port, outputs_report, run_all, visible_gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_qwen3_moe.py")
NO_MULTICAST = dict(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
                    NVSHMEM_DISABLE_NVLS="1")


def _base_env(**extra) -> dict:
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             PYTHONUNBUFFERED="1", **NO_MULTICAST)
  for name in ("XLA_FLAGS", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
               "LOCAL_RANK", "LOCAL_WORLD_SIZE",
               "MEGAMOE_LOCAL_DEVICE_IDS"):
    env.pop(name, None)
  env.update(extra)
  return env


def _losses(out) -> dict:
  with open(os.path.join(out, "losses.json")) as f:
    return json.load(f)


def train(out, args, process_envs: list[dict], timeout=600) -> tuple[dict, list[str]]:
  """Runs the example as len(process_envs) processes (one: no jax.distributed); returns process
  0's losses.json and every process's output."""
  port = free_port()
  envs = []
  for i, env in enumerate(process_envs):
    if len(process_envs) > 1:
      env = env | dict(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                       JAX_NUM_PROCESSES=str(len(process_envs)), JAX_PROCESS_ID=str(i))
    envs.append(env)
  procs, outputs = run_all([[sys.executable, SCRIPT, "--out", str(out), *args]] * len(envs),
                           envs, timeout=timeout)
  report = outputs_report(procs, outputs)
  assert all(p.returncode == 0 for p in procs), report
  return _losses(out), outputs


def _resume_copy(src, dst, keep_step: int):
  """dst: src's run as if preempted after checkpoint `keep_step`."""
  shutil.copytree(src, dst)
  for step in os.listdir(os.path.join(dst, "checkpoints")):
    if step.isdigit() and int(step) > keep_step:
      shutil.rmtree(os.path.join(dst, "checkpoints", step))


def _parity(name, got, want, rtol):
  got, want = np.asarray(got["loss"]), np.asarray(want["loss"])
  assert got.shape == want.shape, (got, want)
  rel = float(np.max(np.abs(got - want) / np.abs(want)))
  print(f"PARITY {name}: bitwise={bool(np.array_equal(got, want))} max_rel={rel:.3g} "
        f"(first {got[0]:.6f}, last {got[-1]:.6f} vs {want[-1]:.6f})")
  assert rel <= rtol, f"{name}: losses {got} vs {want} (max relative difference {rel:.3g})"


# --- CPU: CI --------------------------------------------------------------------------------

# float32 compute: the one difference between the layouts is the order of the cross-process
# (gloo) sums against the in-process ones, rounding at 1e-7 that a few steps keep near there.
CPU_ARGS = ["--num-layers", "1", "--steps", "6", "--batch", "8", "--seq-len", "32", "--lr",
            "1e-2", "--log-every", "3", "--no-progress", "--checkpoint-every", "3",
            "--backend", "reference", "--dtype", "float32", "--mesh", "data=2,expert=2"]


def test_cpu_two_processes_train_resume_and_match_one_process(tmp_path):
  cpu = lambda devices: _base_env(JAX_PLATFORMS="cpu",
                                  XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  one, _ = train(tmp_path / "one", CPU_ARGS, [cpu(4)])
  two, outputs = train(tmp_path / "two", CPU_ARGS, [cpu(2), cpu(2)])
  assert "process 1 of 2: local devices" in outputs[1]
  assert two["step"] == list(range(1, 7))
  assert two["ce"][-1] < two["ce"][0] - 1.0, two["ce"]
  _parity("cpu data=2,expert=2, 2 processes vs 1", two, one, rtol=1e-5)
  assert sorted(os.listdir(tmp_path / "two" / "checkpoints")) == ["3", "6"]

  # Preempted after step 3: both processes restore the checkpoint they wrote together and redo
  # steps 4..6 with the same program and reduction order as before: the same losses, bitwise.
  _resume_copy(tmp_path / "two", tmp_path / "resumed", keep_step=3)
  resumed, outputs = train(tmp_path / "resumed", CPU_ARGS + ["--resume"], [cpu(2), cpu(2)])
  assert "resumed from step 3" in outputs[0]
  assert resumed["step"] == list(range(1, 7))
  assert resumed["loss"] == two["loss"]


# --- GPU: two processes, one GPU each --------------------------------------------------------

# Autotuning off: each process would otherwise time GEMM algorithms on its own and may pick
# others than the one-process run, changing the rounding (the comparison would still pass within
# bf16 noise, but not show whether the layouts agree bitwise).
GPU_ENV = dict(XLA_PYTHON_CLIENT_PREALLOCATE="false", XLA_FLAGS="--xla_gpu_autotune_level=0")
GPU_ARGS = ["--steps", "8", "--log-every", "4", "--no-progress", "--checkpoint-every", "4",
            "--backend", "cuda"]
# bf16 compute: where the layouts round differently, 8 steps amplify it to ~1e-3; a wrong
# exchange or resume is far off (the loss falls by ~1.0 over these steps).
BF16_RTOL = 2e-2
# Each GPU run of the example (compile + 8 steps) gives up after this, so that a hung run is
# reported with its processes' output (subprocesses.WorkersTimedOut) well inside the limit the
# device call gives the whole file (scripts/next_device_call.sh PART=ep2_train: 480 s for six
# runs), not cut off by that limit's SIGINT, which loses the workers' output.
GPU_RUN_TIMEOUT_S = 150


def _per_process(layout: str) -> list[dict]:
  if layout == "local_rank":  # the GPUs the test sees; launch.py picks the <LOCAL_RANK>-th
    return [_base_env(LOCAL_RANK=str(i), LOCAL_WORLD_SIZE="2", **GPU_ENV) for i in range(2)]
  if layout == "cuda_visible_devices":  # each process sees its own GPU only
    return [_base_env(CUDA_VISIBLE_DEVICES=visible_gpu(i), **GPU_ENV) for i in range(2)]
  raise ValueError(layout)


@pytest.fixture(scope="module")
def one_process_runs(tmp_path_factory):
  """One process driving both GPUs, per mesh (the baselines)."""
  runs = {}

  def get(mesh):
    if mesh not in runs:
      out = tmp_path_factory.mktemp("one_process")
      runs[mesh] = train(out, GPU_ARGS + ["--mesh", mesh], [_base_env(**GPU_ENV)],
                         timeout=GPU_RUN_TIMEOUT_S)[0]
    return runs[mesh]
  return get


@pytest.mark.multigpu
@pytest.mark.parametrize("layout", ["local_rank", "cuda_visible_devices"])
def test_gpu_ep_across_processes(tmp_path, one_process_runs, layout):
  """--mesh data=1,expert=2: the EP group spans the two processes (CUDA IPC handles exchanged
  while the train step is traced); checkpoints saved and resumed by both processes."""
  args = GPU_ARGS + ["--mesh", "data=1,expert=2"]
  two, outputs = train(tmp_path / "two", args, _per_process(layout), timeout=GPU_RUN_TIMEOUT_S)
  assert "process 1 of 2: local devices" in outputs[1]
  # The layer took the NVLink kernels over CUDA IPC, not XLA's collectives (backend cuda's
  # fallback when they cannot serve the mesh): the run's last line, from process 0, says so.
  assert re.search(r"NVLink EP workspaces \d+ \([1-9]\d* across processes,", outputs[0]), (
      f"no EP workspace across processes reported:\n{outputs[0][-2000:]}")
  _parity(f"gpu data=1,expert=2 [{layout}], 2 processes vs 1", two,
          one_process_runs("data=1,expert=2"), BF16_RTOL)
  if layout != "local_rank":
    return
  _resume_copy(tmp_path / "two", tmp_path / "resumed", keep_step=4)
  resumed, outputs = train(tmp_path / "resumed", args + ["--resume"], _per_process(layout),
                           timeout=GPU_RUN_TIMEOUT_S)
  assert "resumed from step 4" in outputs[0]
  _parity("gpu data=1,expert=2 resumed at step 4 vs straight", resumed, two, BF16_RTOL)
  assert resumed["loss"][:4] == two["loss"][:4]  # the first four come from metrics.jsonl


@pytest.mark.multigpu
def test_gpu_data_parallel_across_processes(tmp_path, one_process_runs):
  """--mesh data=2,expert=1: each EP group is inside one process (no exchange at all), only
  FSDP/data parallelism crosses processes -- the multi-host layout, one GPU per host."""
  args = GPU_ARGS + ["--mesh", "data=2,expert=1"]
  two, _ = train(tmp_path / "two", args, _per_process("local_rank"), timeout=GPU_RUN_TIMEOUT_S)
  _parity("gpu data=2,expert=1, 2 processes vs 1", two, one_process_runs("data=2,expert=1"),
          BF16_RTOL)

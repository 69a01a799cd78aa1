"""Test set-up: 8 virtual CPU devices (set before JAX initialises), no GPU preallocation, GPU
markers skip cleanly."""

import os

# No preallocation: the multi-GPU tests start worker processes on GPUs this process also holds,
# which would otherwise keep 75% of each GPU's memory from them.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)


def pytest_collection_modifyitems(config, items):
  import jax_megamoe
  from jax_megamoe import _ffi

  reason = _ffi.cuda_unavailable_reason()
  num_gpus = len(_ffi.gpu_devices())
  for item in items:
    if "gpu" in item.keywords and reason is not None:
      item.add_marker(pytest.mark.skip(reason=f"not run: {reason}"))
    if "multigpu" in item.keywords and (reason is not None or num_gpus < 2):
      item.add_marker(pytest.mark.skip(
          reason=f"not run: needs 2 GPUs with the CUDA build ({reason or f'{num_gpus} GPU'})"))
  del jax_megamoe

"""The one place that loads the native extension and registers its XLA FFI targets.

Import is cheap and safe on any machine: when the extension is missing (a source checkout that
was never built) `extension()` returns None and only the pure-JAX backends are available.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from typing import Any

import jax


@functools.cache
def _load_extension() -> tuple[Any | None, str | None]:
  try:
    return importlib.import_module("jax_megamoe._megamoe"), None
  except ModuleNotFoundError as e:
    if e.name != "jax_megamoe._megamoe":
      raise
    return None, "the native extension jax_megamoe._megamoe was not built (pip install the package)"
  except ImportError as e:  # built but broken (e.g. a missing symbol): say so, don't hide it
    warnings.warn(f"jax_megamoe: the native extension failed to load: {e}", RuntimeWarning)
    return None, f"the native extension jax_megamoe._megamoe failed to load: {e}"


def extension() -> Any | None:
  """The compiled module jax_megamoe._megamoe, or None when it is missing or failed to load."""
  return _load_extension()[0]


@functools.cache
def register_targets() -> tuple[tuple[str, str], ...]:
  """Registers every FFI handler of the extension with XLA, once; returns (name, platform)."""
  ext = extension()
  if ext is None:
    return ()
  registered = []
  for name, platform, capsule in ext.ffi_targets():
    jax.ffi.register_ffi_target(name, capsule, platform=platform)
    registered.append((name, platform))
  return tuple(registered)


def has_target(name: str, platform: str) -> bool:
  """Whether the extension provides FFI target `name` for `platform` ("cpu" or "CUDA")."""
  return (name, platform) in register_targets()


def build_info() -> dict[str, Any]:
  """What the extension was built with: cuda_archs, cuda_version, jaxlib_version, cutlass."""
  ext = extension()
  if ext is None:
    return {"extension": False, "cuda_archs": [], "cuda_version": "", "jaxlib_version": "",
            "cutlass": False}
  info = dict(ext.build_info())
  info["extension"] = True
  info["cuda_archs"] = list(info["cuda_archs"])
  return info


def _arch_of(device: jax.Device) -> str | None:
  capability = getattr(device, "compute_capability", None)
  if not capability:
    return None
  major, minor = str(capability).split(".")[:2]
  return f"{major}{minor}"


def gpu_devices() -> list[jax.Device]:
  try:
    return list(jax.devices("gpu"))
  except RuntimeError:
    return []


def cuda_available() -> bool:
  """True when the CUDA kernels were built AND every visible GPU is an architecture they cover."""
  built = {arch.rstrip("a") for arch in build_info()["cuda_archs"]}
  devices = gpu_devices()
  if not built or not devices:
    return False
  return all(_arch_of(d) in built for d in devices)


@functools.cache
def cuda_unavailable_reason() -> str | None:
  """Why the CUDA kernels cannot run here, or None when they can (fixed for the process: the
  extension and the GPUs do not change)."""
  info = build_info()
  if not info["extension"]:
    return _load_extension()[1]
  if not info["cuda_archs"]:
    return ("the extension was built without CUDA (no nvcc found at build time, or "
            "JAX_MEGAMOE_CUDA=OFF)")
  devices = gpu_devices()
  if not devices:
    return f"JAX sees no GPU (backend {jax.default_backend()!r})"
  archs = sorted({_arch_of(d) or "?" for d in devices})
  if not cuda_available():
    return f"the GPUs are sm_{archs} but the kernels were built for {info['cuda_archs']}"
  return None


def gemm_scratch_bytes(num_groups: int) -> int:
  """Device scratch of one grouped-GEMM handler (group offsets + a grouped GEMM's argument
  arrays and CUTLASS workspace) for `num_groups` experts; the handler checks it and names the
  shortfall. An upper bound until the extension reports the exact size."""
  return (2 << 20) + 512 * num_groups

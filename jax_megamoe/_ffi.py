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


def custom_call_platforms(target: str, platforms: tuple[str, ...], mesh) -> tuple[str, ...]:
  """Of `platforms` (jax.lax.platform_dependent's names: "cuda", "cpu"), those where a custom
  call to `target` runs here: its handler is registered and, for "cuda", every visible GPU is
  one the kernels were built for. With no mesh (`mesh` None), none where JAX sees several
  devices: XLA would gather a custom call's operands onto every device; under a mesh the
  caller runs it per device (shard_map)."""
  if mesh is None and jax.device_count() > 1:
    return ()
  return tuple(p for p in platforms
               if has_target(target, "CUDA" if p == "cuda" else p)
               and (p != "cuda" or cuda_available()))


def scratch_bytes(target: str, num_groups: int) -> int:
  """Bytes of the scratch (`workspace`) result FFI target `target` needs for `num_groups` expert
  groups, as its handlers compute it (the CUDA one for the visible GPUs; CPU handlers need none).
  Raises RuntimeError without the extension, ValueError for a target with no scratch result."""
  ext = extension()
  if ext is None:
    raise RuntimeError(f"jax_megamoe: {_load_extension()[1]}")
  return int(ext.scratch_bytes(target, int(num_groups)))


def launch_counts() -> dict[str, int]:
  """Launches so far, in this process, of the kernels a heuristic picks over another path
  (ffi/common/launch_counts.h), counted when a handler enqueues them (a replayed CUDA graph does
  not count); {} without the extension."""
  ext = extension()
  return {} if ext is None else {str(k): int(v) for k, v in ext.launch_counts().items()}


def build_info() -> dict[str, Any]:
  """What the extension was built with: cuda_archs, cuda_version, jaxlib_version, cutlass,
  and the fused kernel's tile-engine options (ffi/gemm/engine_build_options.h; all False
  without the CUDA kernels): engine_profile (its cycle accounting, benchmarks), defer_l1_epilogue
  (half of each bf16 L1 tile's h written during the next tile's mainloop: the default),
  and defer_l2_epilogue (the same for L2's rows, benchmarks)."""
  ext = extension()
  if ext is None:
    return {"extension": False, "cuda_archs": [], "cuda_version": "", "jaxlib_version": "",
            "cutlass": False, "engine_profile": False, "defer_l2_epilogue": False,
            "defer_l1_epilogue": False}
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


# The grouped-GEMM handlers whose scratch gemm_scratch_bytes sizes.
_GEMM_TARGETS = ("megamoe_grouped_mlp_fwd", "megamoe_grouped_mlp_bwd", "megamoe_grouped_gemm",
                 "megamoe_grouped_gemm_fp8", "megamoe_grouped_wgrad_fp8")


def gemm_scratch_bytes(num_groups: int) -> int:
  """Device scratch of one grouped-GEMM handler (group offsets + a grouped GEMM's argument
  arrays and CUTLASS workspace) for `num_groups` experts, as C++ computes it (scratch_bytes): the
  most any of them needs in this build; the handler checks it and names the shortfall."""
  return max(scratch_bytes(t, num_groups) for t in _GEMM_TARGETS
             if has_target(t, "cpu") or has_target(t, "CUDA"))

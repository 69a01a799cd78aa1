"""The installed package: the extension, its build facts and FFI registration."""

import os

import pytest

import jax_megamoe as jm
from jax_megamoe import _ffi


def test_extension_present_when_required():
  if os.environ.get("JAX_MEGAMOE_REQUIRE_EXTENSION") != "1" and _ffi.extension() is None:
    pytest.skip("not run: the native extension is not built in this environment")
  assert _ffi.extension() is not None, "jax_megamoe._megamoe failed to import"


def test_build_info_fields():
  info = jm.build_info()
  for key in ("cuda_archs", "cuda_version", "jaxlib_version"):
    assert key in info
  assert isinstance(info["cuda_archs"], list)
  if info["extension"]:
    assert info["jaxlib_version"]
    assert all(a in ("90a", "100a") for a in info["cuda_archs"])
    assert bool(info["cuda_archs"]) == bool(info["cuda_version"])


def test_cuda_available_is_consistent():
  available = jm.cuda_available()
  assert isinstance(available, bool)
  assert (_ffi.cuda_unavailable_reason() is None) == available


def test_targets_registered_once():
  first = _ffi.register_targets()
  assert _ffi.register_targets() is first  # cached: registration happens once
  assert len(first) == len(set(first))
  assert all(platform in ("cpu", "CUDA") for _, platform in first)

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
  options = ("cutlass", "engine_profile", "defer_l2_epilogue", "defer_l1_epilogue")
  for key in options:
    assert isinstance(info[key], bool), (key, info[key])
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


def _require_extension():
  if _ffi.extension() is None:
    pytest.skip("not run: the native extension is not built in this environment")


def test_scratch_bytes_come_from_the_handlers():
  _require_extension()
  for target in ("megamoe_grouped_mlp_fwd", "megamoe_grouped_mlp_bwd", "megamoe_grouped_gemm_fp8",
                 "megamoe_fp8_swiglu_quantize"):
    assert _ffi.scratch_bytes(target, 8) >= 0
  with pytest.raises(ValueError, match="has no scratch result"):
    _ffi.scratch_bytes("megamoe_fp8_quantize_rows", 8)
  with pytest.raises(ValueError, match="no FFI target megamoe_no_such_op"):
    _ffi.scratch_bytes("megamoe_no_such_op", 8)
  with pytest.raises(ValueError, match="num_groups must be >= 1"):
    _ffi.scratch_bytes("megamoe_grouped_mlp_fwd", 0)


@pytest.mark.gpu
def test_cuda_scratch_bytes_cover_offsets_and_gemm():
  e = 64
  offsets = 4 * (e + 1)
  # The quantisers keep only the offsets (cuda_fp8 sizes them so): exact.
  assert _ffi.scratch_bytes("megamoe_fp8_swiglu_quantize", e) == offsets
  assert _ffi.scratch_bytes("megamoe_fp8_quantize_wgrad_operand", e) == 2 * offsets
  assert _ffi.scratch_bytes("megamoe_fp8_swiglu_backward_quantize", e) == 2 * offsets
  # The GEMMs: the offsets rounded up to 256 bytes, then the GEMM's argument arrays (7 or 11
  # 256-byte aligned arrays of e entries) and CUTLASS's per-SM tensor maps.
  for target in ("megamoe_grouped_mlp_fwd", "megamoe_grouped_mlp_bwd", "megamoe_grouped_gemm",
                 "megamoe_grouped_gemm_fp8", "megamoe_grouped_wgrad_fp8"):
    assert _ffi.scratch_bytes(target, e) > 512 + 7 * 8 * e, target
  assert (_ffi.scratch_bytes("megamoe_grouped_mlp_fwd", 2 * e)
          > _ffi.scratch_bytes("megamoe_grouped_mlp_fwd", e))


def test_extension_exports_no_project_or_xla_symbols():
  """The module's dynamic symbols: its PyInit and the C++ standard library's weak templates,
  none of this project's or of the XLA FFI headers' (hidden visibility in every translation
  unit, CUDA's included: CMakeLists.txt), nor a C++ runtime linked into it."""
  import shutil
  import subprocess
  ext = _ffi.extension()
  nm = shutil.which("nm")
  if ext is None or nm is None:
    pytest.skip("not run: needs the built extension and binutils' nm")
  out = subprocess.run([nm, "-D", "--defined-only", "-C", ext.__file__], capture_output=True,
                       text=True, check=True).stdout
  symbols = [line.split(" ", 2)[1:] for line in out.splitlines() if line.count(" ") >= 2]
  names = [name for _, name in symbols]
  leaked = [n for n in names if n.startswith(("xla::", "megamoe::", "cute::", "cutlass::"))]
  assert any(n.startswith("PyInit_") for n in names)
  assert not leaked, f"{len(leaked)} exported, e.g. {leaked[:3]}"
  # A statically linked C++ runtime exports its own definitions (T, not the weak W of template
  # instances): then they mix with the process's libstdc++ and the module's ostreams break
  # (every handler error segfaulted under jaxlib 0.11.2). CMakeLists.txt: --exclude-libs.
  runtime = [n for kind, n in symbols if kind in ("T", "D", "B", "R") and
             n.startswith(("std::", "__cxa", "__gxx", "_Unwind", "__cxxabi", "operator new",
                           "operator delete", "__gcc_personality", "__dynamic_cast"))]
  assert not runtime, f"the C++ runtime is exported: {len(runtime)}, e.g. {runtime[:3]}"

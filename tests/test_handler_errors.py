"""An FFI handler's validation error reaches Python as an exception naming the argument, and
does not take the process down. Each case runs in a child process (a crash there is this test's
failure, not the test run's end), on the CPU handlers, which share their checks with the CUDA
ones (ffi/handlers/*_ops.h).

Found (benchmarks/RESULTS.md, sessions 10 and 12): on the GPU machines both cases segfaulted
the child under jaxlib 0.11.2. Their g++ links the C++ runtime statically, the module exported
that copy, and formatting a number into the error message went through the process's other
libstdc++ (cuda-gdb: ostream::_M_insert<long> -> codecvt::do_unshift). A -static-libstdc++
build here loses the message's numbers instead of crashing, which these cases also catch. The
module is now linked with --exclude-libs,ALL (CMakeLists.txt); tests/test_build.py checks that
no C++ runtime is exported. The probe cases (tests/ffi_error_probe/probe.cc, built here with
the C++ compiler against jax.ffi.include_dir()) fail the same way from a library of minimal
handlers with this project's binding shapes: where those raise and the extension's cases do
not, the cause is in the extension, not in jaxlib or a binding shape."""

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

import jax_megamoe
from jax_megamoe import _ffi
from jax_megamoe.backends import cuda_fp8

_needs_cpu_handlers = pytest.mark.skipif(
    not all(_ffi.has_target(t, "cpu") for t in cuda_fp8.TARGETS),
    reason="not run: the native extension (with the FP8 CPU handlers) is not built")

def _expect_raised(script: str, message: str):
  """Runs `script` in a child process on the CPU platform: it must exit normally, having printed
  RAISED and `message` (what the error must say). The child imports the jax_megamoe that this
  process imported (the installed one in CI, not the source tree: it runs outside the tree)."""
  package_root = str(pathlib.Path(jax_megamoe.__file__).resolve().parent.parent)
  path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        timeout=120, cwd=tempfile.gettempdir(),
                        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": path})
  assert proc.returncode == 0, (f"the child died (status {proc.returncode}) instead of "
                                f"raising:\n{proc.stderr[-2000:]}")
  assert "RAISED" in proc.stdout and message in proc.stdout, proc.stdout + proc.stderr[-2000:]


_CASES = {
    # The handler's shape check on a result (bypassing the Python wrapper's own checks).
    "result_shape": ("""
        out = (jax.ShapeDtypeStruct((256, 128), jnp.float8_e4m3fn),
               jax.ShapeDtypeStruct((256, 2), jnp.float32))
        r = jax.ffi.ffi_call(cuda_fp8.QUANTIZE_ROWS_TARGET, out)(x, pow2=np.int64(0))
        """, "scale has shape [256, 2], expected [256, 1]"),
    # An operand's shape check (a weight-gradient operand with one scale row short).
    "operand_shape": ("""
        gs = jnp.asarray([100, 0, 28, 1, 127], jnp.int32)
        a = cuda_fp8.quantize_wgrad_operand(x, gs)
        r = cuda_fp8.grouped_wgrad_quantized(cuda_fp8.WgradOperand(a.q, a.scale[:-1]), gs, a)
        """, "a_scale has shape [6, 128], expected [7, 128]"),
}


@_needs_cpu_handlers
@pytest.mark.parametrize("case", sorted(_CASES))
def test_handler_error_raises_and_names_the_argument(case):
  body, message = _CASES[case]
  script = textwrap.dedent("""
      import jax, numpy as np, jax.numpy as jnp
      from jax_megamoe.backends import cuda_fp8
      x = jnp.asarray(np.random.default_rng(0).standard_normal((256, 128)), jnp.bfloat16)
      try:
      {body}
        jax.block_until_ready(r)
        print("NO ERROR RAISED")
      except Exception as e:
        print("RAISED", type(e).__name__, e)
      """).replace("{body}", textwrap.indent(textwrap.dedent(body), "  "))
  _expect_raised(script, message)


_PROBES = {  # handler symbol -> (python building its operands and results, message)
    "ProbeOneResult": ("args = (jnp.zeros((4,), jnp.float32),); "
                       "outs = jax.ShapeDtypeStruct((4,), jnp.float32); attrs = {}",
                       "one_result has shape [2], expected [4]"),
    "ProbeTwoResultsAndAttr": ("args = (jnp.zeros((4,), jnp.float32),); "
                               "outs = (jax.ShapeDtypeStruct((4,), jnp.float32),) * 2; "
                               "attrs = {'pow2': np.int64(0)}",
                               "two_results_attr has shape [2], expected [4]"),
    "ProbeTypedBuffers": ("args = (jnp.zeros((4,), jnp.bfloat16), jnp.zeros((4,), jnp.int32)); "
                          "outs = jax.ShapeDtypeStruct((4,), jnp.float32); attrs = {}",
                          "typed_buffers has shape [2], expected [4]"),
}


@pytest.fixture(scope="module")
def probe_library(tmp_path_factory):
  """tests/ffi_error_probe/probe.cc built into a shared library against this JAX's FFI
  headers (not run without a C++ compiler)."""
  import jax
  compiler = shutil.which("c++") or shutil.which("g++")
  if compiler is None:
    pytest.skip("not run: no C++ compiler to build the FFI error probe")
  source = pathlib.Path(__file__).parent / "ffi_error_probe" / "probe.cc"
  lib = tmp_path_factory.mktemp("ffi_error_probe") / "probe.so"
  subprocess.run([compiler, "-std=c++17", "-O1", "-shared", "-fPIC", "-I",
                  jax.ffi.include_dir(), str(source), "-o", str(lib)], check=True,
                 capture_output=True, timeout=300)
  return lib


@pytest.mark.parametrize("symbol", sorted(_PROBES))
def test_minimal_handler_error_raises(probe_library, symbol):
  setup, message = _PROBES[symbol]
  script = textwrap.dedent(f"""
      import ctypes, jax, numpy as np, jax.numpy as jnp
      lib = ctypes.cdll.LoadLibrary({str(probe_library)!r})
      jax.ffi.register_ffi_target("probe", jax.ffi.pycapsule(lib.{symbol}), platform="cpu")
      {setup}
      try:
        jax.block_until_ready(jax.ffi.ffi_call("probe", outs)(*args, **attrs))
        print("NO ERROR RAISED")
      except Exception as e:
        print("RAISED", type(e).__name__, e)
      """)
  _expect_raised(script, message)

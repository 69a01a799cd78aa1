"""An FFI handler's validation error reaches Python as an exception naming the argument, and
does not take the process down. Each case runs in a child process (a crash there is this test's
failure, not the test run's end), on the CPU handlers, which share their checks with the CUDA
ones (ffi/handlers/*_ops.h).

Known: with jaxlib 0.11.2 (the GPU machines' JAX) both cases segfault the child, CPU and CUDA
handlers alike, where a minimal handler returning the same ffi::Error raises (measured
2026-12-02; benchmarks/RESULTS.md, session 10). jaxlib 0.10.2 (CI) raises."""

import os
import subprocess
import sys
import textwrap

import pytest

from jax_megamoe import _ffi
from jax_megamoe.backends import cuda_fp8

pytestmark = pytest.mark.skipif(
    not all(_ffi.has_target(t, "cpu") for t in cuda_fp8.TARGETS),
    reason="not run: the native extension (with the FP8 CPU handlers) is not built")

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
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 0, (f"the child died (status {proc.returncode}) instead of "
                                f"raising:\n{proc.stderr[-2000:]}")
  assert "RAISED" in proc.stdout and message in proc.stdout, proc.stdout + proc.stderr[-2000:]

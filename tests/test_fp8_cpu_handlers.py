"""The blockwise-FP8 ops of jax_megamoe.backends.cuda_fp8 through their CPU FFI handlers (the
same contracts as the CUDA ones): quantisation bit for bit against jax_megamoe.fp8, the GEMM on
quantised operands against the emulation, the fused SwiGLU + quantisation, FP8 rows read in
place with a row stride, and the FP8 MLP forward and gradients. Runs in CI; the CUDA twins run
in tests/test_grouped_mlp_ffi.py on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_megamoe import _ffi, fp8
from jax_megamoe.backends import cuda_fp8
from moe_oracles import rel_err

pytestmark = pytest.mark.skipif(
    not all(_ffi.has_target(t, "cpu") for t in cuda_fp8.TARGETS),
    reason="not run: the native extension (with the FP8 CPU handlers) is not built")

CPU = jax.devices("cpu")[0]


def _rows(seed, n, k):
  """Rows of very different magnitudes (so block scales differ), a zero row, an e4m3-saturating
  outlier and a value in e4m3's subnormal range after scaling."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, k)) * np.exp(2 * rng.standard_normal((n, 1)))
  x[1] = 0.0
  x[2, 5] = 1e4
  x[3, :128] = np.linspace(-1, 1, 128) * 1e-3
  x[3, 7] = 1.0
  return jnp.asarray(x, jnp.bfloat16)


def _group_sizes(rng, e, total):
  cuts = np.sort(rng.integers(0, total + 1, size=e - 1))
  sizes = np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int32)
  sizes[0] = 0  # an empty expert
  sizes[-1] += total - sizes.sum()
  return jnp.asarray(sizes)


def _dequantized_rows(rows):
  return np.asarray(cuda_fp8.dequantize_rows(rows, jnp.float32))


@pytest.mark.parametrize("pow2", [False, True])
def test_quantize_rows_and_weights_bit_exact(pow2):
  spec = fp8.get_recipe("fp8_pow2" if pow2 else "fp8")
  x = _rows(1, 37, 384)
  rows = jax.jit(lambda a: cuda_fp8.quantize_rows(a, pow2=pow2))(x)
  # An all-zero block must not give a NaN (a denormal scale flushed to 0 once made 0 / 0).
  assert np.all(np.isfinite(_dequantized_rows(rows))) and np.all(np.asarray(rows.scale) > 0)
  np.testing.assert_array_equal(_dequantized_rows(rows), np.asarray(fp8.quantize_activation(x, spec)))
  w = jnp.asarray(np.random.default_rng(2).standard_normal((3, 256, 384)) * 0.05, jnp.bfloat16)
  blocks = jax.jit(lambda a: cuda_fp8.quantize_weights(a, pow2=pow2))(w)
  assert blocks.q.shape == (3, 384, 256) and blocks.scale.shape == (3, 2, 3)
  deq = np.swapaxes(np.asarray(blocks.q.astype(jnp.float32)), 1, 2) * np.repeat(
      np.repeat(np.asarray(blocks.scale), 128, axis=1), 128, axis=2)
  np.testing.assert_array_equal(deq, np.asarray(fp8.quantize_weight(w, spec)))
  if pow2:
    s = np.asarray(rows.scale)
    assert np.all(np.exp2(np.round(np.log2(s))) == s)


def test_grouped_gemm_quantized_matches_emulation_and_reads_strided_rows():
  spec = fp8.get_recipe("fp8")
  rng = np.random.default_rng(3)
  n, k, p, e = 70, 256, 128, 4
  gs = _group_sizes(rng, e, 61)
  a = _rows(4, n, k)
  b = jnp.asarray(rng.standard_normal((e, k, p)) * 0.05, jnp.bfloat16)
  a_rows = cuda_fp8.quantize_rows(a)
  d = np.asarray(jax.jit(cuda_fp8.grouped_gemm_quantized)(a_rows, gs, cuda_fp8.quantize_weights(b))
                 .astype(jnp.float32))
  want = np.asarray(jax.lax.ragged_dot(fp8.quantize_activation(a, spec),
                                       fp8.quantize_weight(b, spec), gs,
                                       precision=jax.lax.Precision.HIGHEST))
  total = int(np.sum(np.asarray(gs)))
  assert np.all(d[total:] == 0)
  assert rel_err(d[:total], want[:total]) < 5e-3
  # The same rows packed as the EP dispatch moves them, read in place (row stride > K).
  strided = cuda_fp8.unpack_rows(cuda_fp8.pack_rows(a_rows), k)
  assert strided.q.shape[1] > k
  d_strided = jax.jit(cuda_fp8.grouped_gemm_quantized)(strided, gs, cuda_fp8.quantize_weights(b))
  np.testing.assert_array_equal(np.asarray(d_strided.astype(jnp.float32)), d)


@pytest.mark.parametrize("pow2", [False, True])
def test_swiglu_quantize_fuses_swiglu_and_row_quantisation(pow2):
  rng = np.random.default_rng(5)
  n, f, e = 50, 256, 3
  gs = _group_sizes(rng, e, 41)
  gate_up = jnp.asarray(rng.standard_normal((n, 2 * f)) * 2, jnp.bfloat16)
  h, rows = jax.jit(lambda g, s: cuda_fp8.swiglu_quantize(g, s, pow2=pow2))(gate_up, gs)
  total = int(np.sum(np.asarray(gs)))
  g32 = np.asarray(gate_up.astype(jnp.float32))
  want = (g32[:, :f] / (1 + np.exp(-g32[:, :f])) * g32[:, f:]).astype(np.float32)
  got = np.asarray(h.astype(jnp.float32))
  np.testing.assert_allclose(got[:total], want[:total], rtol=1e-2, atol=1e-6)
  assert np.all(got[total:] == 0)
  again = cuda_fp8.quantize_rows(h, pow2=pow2)
  np.testing.assert_array_equal(
      np.asarray(jax.lax.bitcast_convert_type(rows.q[:total], jnp.uint8)),
      np.asarray(jax.lax.bitcast_convert_type(again.q[:total], jnp.uint8)))
  np.testing.assert_array_equal(np.asarray(rows.scale[:total]), np.asarray(again.scale[:total]))


@pytest.mark.parametrize("recipe", ["fp8", "fp8_pow2"])
def test_fp8_mlp_forward_and_gradients_match_the_recipe(recipe):
  """cuda_fp8.grouped_mlp (CPU handlers, with the bf16 backward handler) against the recipe's
  definition: fp8 forward, straight-through backward on the unquantised operands."""
  spec = fp8.get_recipe(recipe)
  rng = np.random.default_rng(6)
  n, hdim, f, e = 60, 256, 128, 4
  gs = _group_sizes(rng, e, 53)
  x = jnp.asarray(rng.standard_normal((n, hdim)), jnp.bfloat16)
  wgu = jnp.asarray(rng.standard_normal((e, hdim, 2 * f)) / 16, jnp.bfloat16)
  wd = jnp.asarray(rng.standard_normal((e, f, hdim)) / 11, jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((n, hdim)), jnp.bfloat16)

  def oracle(x, wgu, wd):
    gu = fp8.ragged_dot(x, wgu, gs, spec)
    hid = (jax.nn.silu(gu[:, :f]) * gu[:, f:]).astype(x.dtype)
    y = fp8.ragged_dot(hid, wd, gs, spec)
    return jnp.where((jnp.arange(n) < jnp.sum(gs))[:, None], y, 0.0).astype(x.dtype)

  def ours(x, wgu, wd):
    return cuda_fp8.grouped_mlp(x, gs, wgu, wd, pow2=recipe == "fp8_pow2")

  results = {}
  for name, fn in (("ours", ours), ("oracle", oracle)):
    y, vjp = jax.vjp(fn, x, wgu, wd)
    results[name] = (y, *vjp(dy))
  f32 = lambda a: np.asarray(a.astype(jnp.float32))
  for label, a, b in zip(("y", "dx", "dw_gate_up", "dw_down"), results["ours"], results["oracle"]):
    assert rel_err(f32(a), f32(b)) < 2e-2, label
  total = int(np.sum(np.asarray(gs)))
  assert np.all(f32(results["ours"][0])[total:] == 0)

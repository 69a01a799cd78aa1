"""FP8 rows packed into bf16 rows (what the EP dispatch kernels move for recipe "fp8"): the
packing is lossless, bit for bit, and the rows are whole 16-byte transfer granules (CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_megamoe.backends import cuda_fp8


@pytest.mark.parametrize("hidden", [128, 384, 2048, 4096])
def test_pack_unpack_is_lossless(hidden):
  rng = np.random.default_rng(hidden)
  tokens = 37
  # Every e4m3 bit pattern, including NaN and negative zero, must survive the bf16 view.
  q_bits = rng.integers(0, 256, (tokens, hidden), dtype=np.uint8)
  scale = (rng.standard_normal((tokens, hidden // 128)) * 1e-3).astype(np.float32)
  rows = cuda_fp8.QuantizedRows(
      jax.lax.bitcast_convert_type(jnp.asarray(q_bits), jnp.float8_e4m3fn), jnp.asarray(scale))
  packed = cuda_fp8.pack_rows(rows)
  assert packed.dtype == jnp.bfloat16
  assert packed.shape == (tokens, cuda_fp8.packed_width(hidden))
  assert (packed.shape[1] * 2) % 16 == 0
  assert packed.shape[1] * 2 < 2 * hidden  # less than a bf16 row on the wire
  back = cuda_fp8.unpack_rows(packed, hidden)
  # The values stay in place (the GEMM reads the packed rows with a row stride).
  assert back.q.shape == (tokens, 2 * packed.shape[1]) and back.k == hidden
  np.testing.assert_array_equal(
      np.asarray(jax.lax.bitcast_convert_type(back.q[:, :hidden], jnp.uint8)), q_bits)
  np.testing.assert_array_equal(
      np.asarray(cuda_fp8.dequantize_rows(back, jnp.float32)),
      np.asarray(cuda_fp8.dequantize_rows(rows, jnp.float32)))
  np.testing.assert_array_equal(np.asarray(back.scale).view(np.uint32), scale.view(np.uint32))


def test_dequantize_rows_applies_each_block_scale():
  q = jnp.asarray(np.arange(256, dtype=np.float32).reshape(1, 256) % 7 - 3, jnp.float8_e4m3fn)
  scale = jnp.asarray([[0.5, 4.0]], jnp.float32)
  got = cuda_fp8.dequantize_rows(cuda_fp8.QuantizedRows(q, scale), jnp.float32)
  want = np.asarray(q.astype(jnp.float32)) * np.repeat([[0.5, 4.0]], 128, axis=1)
  np.testing.assert_array_equal(np.asarray(got), want)


def test_quantisers_name_the_bad_operand():
  with pytest.raises(ValueError, match="x axis 1 must be a multiple of 128"):
    cuda_fp8.quantize_rows(jnp.zeros((4, 100), jnp.bfloat16))
  with pytest.raises(ValueError, match="w must be a 3-D bfloat16 array"):
    cuda_fp8.quantize_weights(jnp.zeros((4, 128, 128), jnp.float32))
  with pytest.raises(ValueError, match="F a multiple of 128"):
    cuda_fp8.swiglu_quantize(jnp.zeros((4, 192), jnp.bfloat16), jnp.ones((2,), jnp.int32))


def test_fp8_dispatch_refused_with_the_reason():
  """Asking for FP8 rows where they cannot travel names why, before any workspace exists."""
  from jax.sharding import AxisType
  from jax_megamoe.backends import cuda_ep
  mesh = jax.make_mesh((2,), ("expert",), axis_types=(AxisType.Auto,),
                       devices=jax.devices("cpu")[:2])
  x = jnp.zeros((8, 256), jnp.bfloat16)
  ids = jnp.zeros((8, 2), jnp.int32).at[:, 1].set(1)
  w = jnp.full((8, 2), 0.5, jnp.float32)
  wgu, wd = jnp.zeros((4, 256, 256), jnp.bfloat16), jnp.zeros((4, 128, 256), jnp.bfloat16)
  from jax_megamoe.backends import cuda_fp8, reference
  with pytest.raises(ValueError, match="fp8_dispatch=True cannot be served: the expert MLP is not"):
    cuda_ep.expert_parallel_moe(x, ids, w, wgu, wd, mesh=mesh, mlp=reference.grouped_mlp,
                                fp8_dispatch=True)
  with pytest.raises(ValueError, match="fp8_dispatch=True cannot be served: x is float32"):
    f32 = lambda a: a.astype(jnp.float32)
    cuda_ep.expert_parallel_moe(f32(x), ids, w, f32(wgu), f32(wd), mesh=mesh,
                                mlp=cuda_fp8.RowsMlp(), fp8_dispatch=True)

"""The reference backend's ragged exchange, run on CPU over an emulated ragged_all_to_all (XLA:CPU
has none): forward and gradients agree with the padded exchange. Checks the custom VJP's
offsets; the real collective runs in tests/test_reference_gpu.py."""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType

import jax_megamoe as jm
from jax_megamoe import parallel
from jax_megamoe.backends import reference
from moe_oracles import rel_err


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name):
  """ragged_all_to_all's semantics over a padded all_to_all (any platform)."""
  ep = input_offsets.shape[0]
  block = operand.shape[0]
  padded = jnp.concatenate([operand, jnp.zeros_like(operand)])
  row = jnp.arange(block)
  mask_shape = (block,) + (1,) * (operand.ndim - 1)
  send = jnp.stack([
      jnp.where((row < send_sizes[p]).reshape(mask_shape),
                jax.lax.dynamic_slice_in_dim(padded, input_offsets[p], block), 0)
      for p in range(ep)])
  got = jax.lax.all_to_all(send, axis_name, 0, 0)  # [source, block, ...]
  where = jax.lax.all_to_all(output_offsets.reshape(ep, 1), axis_name, 0, 0).reshape(ep)
  dest = jnp.where(row[None, :] < recv_sizes[:, None], where[:, None] + row[None, :],
                   output.shape[0])
  return output.at[dest.reshape(-1)].set(got.reshape(-1, *operand.shape[1:]), mode="drop")


@pytest.mark.parametrize("routing", ["random", "skewed", "masked"])
def test_ragged_exchange_vjp_matches_padded(monkeypatch, routing):
  monkeypatch.setattr(parallel, "ragged_all_to_all", emulated_ragged_all_to_all)
  mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)
  ks = jax.random.split(jax.random.PRNGKey(3), 5)
  tokens, hidden, ffn, experts, top_k = 32, 16, 8, 8, 2
  x = jax.random.normal(ks[0], (tokens, hidden))
  w, ids, _ = jm.route(jax.random.normal(ks[1], (tokens, experts)), top_k)
  if routing == "skewed":
    ids = ids.at[:, 0].set(7)
    ids = jnp.where(ids[:, 1:] == 7, 6, ids[:, 1:]).reshape(tokens, 1)
    ids = jnp.concatenate([jnp.full((tokens, 1), 7, jnp.int32), ids], axis=1)
  if routing == "masked":
    ids = ids.at[::2, 1].set(-1)
  wgu = jax.random.normal(ks[2], (experts, hidden, 2 * ffn)) / hidden ** 0.5
  wd = jax.random.normal(ks[3], (experts, ffn, hidden)) / ffn ** 0.5
  cot = jax.random.normal(ks[4], x.shape)

  def loss(exchange, x, w, wgu, wd):
    y = parallel.expert_parallel_moe(x, ids, w, wgu, wd, mesh=mesh, expert_axis="expert",
                                     mlp=reference.grouped_mlp,
                                     exchange=exchange)
    return jnp.sum(y * cot), y

  results = {}
  for exchange in ("padded", "ragged"):
    fn = jax.jit(jax.value_and_grad(functools.partial(loss, exchange), argnums=(0, 1, 2, 3),
                                    has_aux=True))
    results[exchange] = fn(x, w, wgu, wd)
  (_, y_padded), g_padded = results["padded"]
  (_, y_ragged), g_ragged = results["ragged"]
  assert rel_err(y_ragged, y_padded) < 1e-6
  for name, a, b in zip(("x", "topk_weights", "w_gate_up", "w_down"), g_ragged, g_padded):
    assert rel_err(a, b) < 1e-6, name

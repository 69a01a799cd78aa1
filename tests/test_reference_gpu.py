"""Reference backend on GPUs: the ragged_all_to_all exchange agrees with the padded one and with
the float64 oracle, forward and gradients (needs 2 GPUs; skipped elsewhere)."""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType

import jax_megamoe as jm
from jax_megamoe import parallel
from jax_megamoe.backends import reference
from moe_oracles import assert_errors_below, dense_moe, numpy_moe, rel_err


def _gpu_mesh():
  gpus = jax.devices("gpu")
  return jax.make_mesh((len(gpus),), ("expert",), axis_types=(AxisType.Auto,), devices=gpus)


def _layer(exchange, mesh, x, ids, w, wgu, wd):
  return parallel.expert_parallel_moe(x, ids, w, wgu, wd, mesh=mesh, expert_axis="expert",
                                      mlp=reference.grouped_mlp,
                                      exchange=exchange)


@pytest.mark.multigpu
@pytest.mark.parametrize("routing", ["random", "one_expert", "masked"])
def test_ragged_exchange_matches_padded_and_oracle(routing):
  mesh = _gpu_mesh()
  ks = jax.random.split(jax.random.PRNGKey(0), 4)
  tokens, hidden, ffn, experts, top_k = 64 * mesh.size, 64, 32, 8, 2
  x = jax.random.normal(ks[0], (tokens, hidden))
  w, ids, _ = jm.route(jax.random.normal(ks[1], (tokens, experts)), top_k)
  if routing == "one_expert":
    ids = ids.at[:, 0].set(experts - 1).at[:, 1].set(experts - 2)
  if routing == "masked":
    ids = ids.at[::2, 1].set(-1)
  wgu = jax.random.normal(ks[2], (experts, hidden, 2 * ffn)) / hidden ** 0.5
  wd = jax.random.normal(ks[3], (experts, ffn, hidden)) / ffn ** 0.5
  want = numpy_moe(x, ids, w, wgu, wd)
  cot = jax.random.normal(jax.random.PRNGKey(5), x.shape)
  grads = {}
  for exchange in ("padded", "ragged"):
    fn = jax.jit(functools.partial(_layer, exchange, mesh))
    err = rel_err(fn(x, ids, w, wgu, wd), want)
    assert err < 1e-5, f"{exchange} forward rel err {err:.3g}"
    grads[exchange] = jax.jit(jax.grad(lambda *a: jnp.sum(fn(a[0], ids, *a[1:]) * cot),
                                       argnums=(0, 1, 2, 3)))(x, w, wgu, wd)
  oracle = jax.grad(lambda *a: jnp.sum(dense_moe(a[0], ids, *a[1:]) * cot),
                    argnums=(0, 1, 2, 3))(x, w, wgu, wd)
  errors = {(exchange, name): float(rel_err(g, r)) for exchange, got in grads.items()
            for name, g, r in zip(("dx", "dtopk_weights", "dw_gate_up", "dw_down"), got, oracle)}
  assert_errors_below(errors, 1e-5)

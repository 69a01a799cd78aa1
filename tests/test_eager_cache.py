"""Eager moe() calls under a mesh compile once per (mesh, options, shapes): a repeated call
with the same shapes is served from the cache instead of being traced and compiled again."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

import jax_megamoe as jm
from jax_megamoe import parallel

H, F, E, K = 16, 8, 8, 2


def cpu_mesh(shape, axes):
  return jax.make_mesh(shape, axes, devices=jax.devices("cpu")[:8])


@pytest.fixture
def traces(monkeypatch):
  """Counts how often moe() builds its expert-parallel computation (once per trace)."""
  count = [0]
  original = parallel.expert_parallel_moe

  def counting(*args, **kwargs):
    count[0] += 1
    return original(*args, **kwargs)

  monkeypatch.setattr(parallel, "expert_parallel_moe", counting)
  return count


def _problem(tokens, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  x = jax.random.normal(keys[0], (tokens, H))
  # Distinct experts per token (as route gives them).
  ids = jnp.argsort(jax.random.uniform(keys[1], (tokens, E)), axis=1)[:, :K].astype(jnp.int32)
  w = jax.random.uniform(keys[2], (tokens, K))
  gu = 0.3 * jax.random.normal(keys[3], (E, H, 2 * F))
  dn = 0.3 * jax.random.normal(keys[3], (E, F, H))
  return x, ids, w, gu, dn


def test_repeated_eager_calls_trace_once(traces):
  mesh = cpu_mesh((2, 4), ("data", "expert"))
  x, ids, w, gu, dn = _problem(24)  # a token count no other test uses: a cold cache
  first = jm.moe(x, ids, w, gu, dn, mesh=mesh, backend="reference")
  assert traces[0] == 1
  for _ in range(3):
    again = jm.moe(x + 1, ids, w, gu, dn, mesh=mesh, backend="reference")
  assert traces[0] == 1, "an eager call with the same shapes was traced again"
  # Same values as the jitted op, and new shapes or options compile anew.
  jitted = jax.jit(lambda *a: jm.moe(*a, mesh=mesh, backend="reference"))
  np.testing.assert_array_equal(first, jitted(x, ids, w, gu, dn))
  np.testing.assert_array_equal(again, jitted(x + 1, ids, w, gu, dn))
  traces[0] = 0
  jm.moe(*_problem(32), mesh=mesh, backend="reference")
  jm.moe(x, ids, w, gu, dn, mesh=cpu_mesh((8,), ("expert",)), backend="reference")
  assert traces[0] == 2


def test_eager_call_still_checks_concrete_ids():
  mesh = cpu_mesh((2, 4), ("data", "expert"))
  x, ids, w, gu, dn = _problem(24)
  with pytest.raises(ValueError, match=r"topk_ids must be in \[0, 8\)"):
    jm.moe(x, ids.at[0, 0].set(E), w, gu, dn, mesh=mesh)


def test_module_under_a_mesh_eagerly_traces_once(traces):
  mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Auto,) * 2,
                       devices=jax.devices("cpu")[:8])
  layer = jm.MoE(H, F, E, K, rngs=nnx.Rngs(0), dtype=jnp.float32, mesh=mesh,
                 backend="reference")
  x = jax.random.normal(jax.random.PRNGKey(1), (5, 8, H))  # 40 tokens: a cold cache
  y = layer(x)
  layer(x * 2)
  assert traces[0] == 1
  assert y.shape == x.shape

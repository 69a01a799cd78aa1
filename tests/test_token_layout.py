"""The layouts' row permutations (jax_megamoe.token_layout): token_rows, sorted_rows and
slot_order give x[order // k], rows[order] and rows[inverse], and their gradients are those of
the plain gathers (bit for bit, a token's k cotangents added in float32 in slot order),
computed by gathers: the local layer's gradient program scatters no rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_megamoe
from jax_megamoe import token_layout
from jaxpr_helpers import sub_jaxprs


def _row_scatters(jaxpr) -> list:
  """The scatter equations (nested jaxprs included) whose output has rows (ndim >= 2): the
  int32 [T*k] scatter of sort_by_expert's inverse is not one."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name.startswith("scatter") and any(
        len(v.aval.shape) >= 2 for v in eqn.outvars):
      found.append((eqn.primitive.name, [v.aval.shape for v in eqn.outvars]))
    for sub in sub_jaxprs(eqn.params):
      found += _row_scatters(sub)
  return found


def _ids(rng, tokens, top_k, experts, masked=0.2):
  ids = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k].astype(np.int32)
  ids[rng.random((tokens, top_k)) < masked] = -1
  return jnp.asarray(ids)


@pytest.mark.parametrize("tokens, top_k, dtype", [(13, 3, jnp.float32), (1, 1, jnp.float32),
                                                  (40, 8, jnp.bfloat16)])
def test_permutations_and_their_gradients_are_the_gathers(tokens, top_k, dtype):
  rng = np.random.default_rng(tokens * 10 + top_k)
  experts, hidden = 16, 24
  ids = _ids(rng, tokens, top_k, experts)
  slots = token_layout.sort_by_expert(ids.reshape(-1), experts)
  x = jnp.asarray(rng.standard_normal((tokens, hidden)), dtype)
  rows = jnp.asarray(rng.standard_normal((tokens * top_k, hidden)), dtype)
  g = jnp.asarray(rng.standard_normal((tokens * top_k, hidden)), dtype)

  np.testing.assert_array_equal(token_layout.token_rows(x, slots, top_k),
                                x[slots.order // top_k])
  np.testing.assert_array_equal(token_layout.slot_order(rows, slots), rows[slots.inverse])
  np.testing.assert_array_equal(token_layout.sorted_rows(rows, slots), rows[slots.order])

  _, ours = jax.vjp(lambda a: token_layout.token_rows(a, slots, top_k), x)
  # The plain gather's cotangent, summed per token in slot order in float32.
  want = np.zeros((tokens, hidden), np.float32)
  flat = np.asarray(g, np.float32)
  for t in range(tokens):
    for j in range(top_k):
      want[t] += flat[int(slots.inverse[t * top_k + j])]
  np.testing.assert_array_equal(np.asarray(ours(g)[0], np.float32),
                                want.astype(dtype).astype(np.float32))

  for ours_fn, perm in ((token_layout.slot_order, slots.inverse),
                        (token_layout.sorted_rows, slots.order)):
    _, ours = jax.vjp(lambda a: ours_fn(a, slots), rows)
    _, plain = jax.vjp(lambda a: a[perm], rows)
    np.testing.assert_array_equal(ours(g)[0], plain(g)[0])


def test_local_layer_gradients_have_no_row_scatter():
  """The reference layer without a mesh (the local layer): its gradients match a dense oracle
  computed here, and its gradient program scatters no rows."""
  rng = np.random.default_rng(3)
  t, h, f, e, k = 24, 16, 8, 6, 3
  x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
  ids = _ids(rng, t, k, e)
  w = jnp.asarray(rng.random((t, k)), jnp.float32)
  wgu = jnp.asarray(rng.standard_normal((e, h, 2 * f)) * 0.3, jnp.float32)
  wd = jnp.asarray(rng.standard_normal((e, f, h)) * 0.3, jnp.float32)
  dy = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)

  def layer(x, w, wgu, wd):
    return jnp.vdot(jax_megamoe.moe(x, ids, w, wgu, wd, backend="reference"), dy)

  def dense(x, w, wgu, wd):  # every token through each of its experts, one at a time
    y = jnp.zeros_like(x)
    for j in range(k):
      e_j = jnp.maximum(ids[:, j], 0)
      gu = jnp.einsum("th,thf->tf", x, wgu[e_j])
      hid = jax.nn.silu(gu[:, :f]) * gu[:, f:]
      out = jnp.einsum("tf,tfh->th", hid, wd[e_j])
      y = y + jnp.where(ids[:, j, None] >= 0, w[:, j, None] * out, 0.0)
    return jnp.vdot(y, dy)

  grads = jax.grad(layer, argnums=(0, 1, 2, 3))
  for a, b in zip(grads(x, w, wgu, wd), jax.grad(dense, argnums=(0, 1, 2, 3))(x, w, wgu, wd)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)
  assert not _row_scatters(jax.make_jaxpr(grads)(x, w, wgu, wd).jaxpr)

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_megamoe as jm


def test_route_matches_numpy():
  logits = jax.random.normal(jax.random.PRNGKey(1), (37, 16)) * 3
  weights, ids, aux = jm.route(logits, 4, norm_topk_prob=True)
  assert weights.dtype == jnp.float32 and ids.dtype == jnp.int32
  lg = np.asarray(logits, np.float64)
  probs = np.exp(lg - lg.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  want_ids = np.argsort(-probs, axis=-1, kind="stable")[:, :4]
  np.testing.assert_array_equal(np.asarray(ids), want_ids)
  top = np.take_along_axis(probs, want_ids, -1)
  np.testing.assert_allclose(weights, top / top.sum(-1, keepdims=True), rtol=1e-5)
  load = np.stack([np.bincount(want_ids.ravel(), minlength=16)]).ravel() / want_ids.size
  np.testing.assert_allclose(aux.expert_load, load, rtol=1e-6)
  np.testing.assert_allclose(aux.load_balancing_loss, 16 * np.sum(load * probs.mean(0)),
                             rtol=1e-5)
  lse = np.log(np.exp(lg).sum(-1))
  np.testing.assert_allclose(aux.z_loss, np.mean(lse ** 2), rtol=1e-5)


def test_route_without_renormalisation_keeps_softmax_values():
  logits = jax.random.normal(jax.random.PRNGKey(2), (5, 8))
  weights, ids, _ = jm.route(logits, 2, norm_topk_prob=False)
  probs = jax.nn.softmax(logits, -1)
  np.testing.assert_allclose(weights, jnp.take_along_axis(probs, ids, -1), rtol=1e-6)


def test_route_balanced_loss_is_one_for_uniform_routing():
  logits = jnp.tile(jnp.eye(4) * 10, (2, 1))  # tokens spread evenly over 4 experts
  _, _, aux = jm.route(logits, 1)
  np.testing.assert_allclose(aux.load_balancing_loss, 1.0, rtol=1e-3)


@pytest.mark.parametrize("top_k", [0, 9, 2.0])
def test_route_rejects_bad_top_k(top_k):
  with pytest.raises(ValueError, match="top_k"):
    jm.route(jnp.zeros((3, 8)), top_k)


def test_route_rejects_bad_logits_shape():
  with pytest.raises(ValueError, match="logits"):
    jm.route(jnp.zeros((3, 8, 2)), 2)


def test_route_accepts_numpy_integer_top_k():
  import numpy as np
  want = jm.route(jnp.arange(24.0).reshape(3, 8), 2)
  got = jm.route(jnp.arange(24.0).reshape(3, 8), np.int64(2))
  assert got[1].shape == (3, 2)
  np.testing.assert_array_equal(got[1], want[1])


def test_route_rejects_bool_top_k():
  with pytest.raises(ValueError, match="top_k must be an int .* got True"):
    jm.route(jnp.zeros((3, 8)), True)


def test_route_with_no_tokens_gives_zero_aux_not_nan():
  weights, ids, aux = jm.route(jnp.zeros((0, 8)), 2)
  assert weights.shape == ids.shape == (0, 2)
  assert float(aux.load_balancing_loss) == 0.0 and float(aux.z_loss) == 0.0
  np.testing.assert_array_equal(aux.expert_load, np.zeros(8, np.float32))
  # Under jit and grad too: a zero-token batch contributes nothing, not NaN.
  grad = jax.grad(lambda lg: jm.route(lg, 2)[2].load_balancing_loss)(jnp.zeros((0, 8)))
  assert grad.shape == (0, 8)

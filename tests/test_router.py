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

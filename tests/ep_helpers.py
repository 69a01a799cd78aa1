"""Shared inputs and an independent dense oracle for the expert-parallel tests."""

import jax
import jax.numpy as jnp
import numpy as np

# Re-exported for the EP tests.
from moe_oracles import assert_errors_below, dense_moe, rel_err  # noqa: F401


def routing(rng, tokens, num_experts, top_k, *, mask_fraction=0.0):
  """Distinct expert ids per token (as top-k gives), some slots masked with -1; fp32 weights."""
  scores = rng.random((tokens, num_experts))
  ids = np.argsort(scores, axis=1)[:, :top_k].astype(np.int32)
  if mask_fraction:
    ids[rng.random(ids.shape) < mask_fraction] = -1
  weights = rng.random((tokens, top_k)).astype(np.float32)
  weights /= weights.sum(axis=1, keepdims=True)
  return ids, weights


def weights_for(rng, num_experts, hidden, ffn, dtype):
  w_gate_up = (rng.standard_normal((num_experts, hidden, 2 * ffn)) / np.sqrt(hidden))
  w_down = (rng.standard_normal((num_experts, ffn, hidden)) / np.sqrt(ffn))
  return jnp.asarray(w_gate_up, dtype), jnp.asarray(w_down, dtype)


def value_and_grads(layer, x, ids, w, wgu, wd, dy):
  """layer(x, ids, w, wgu, wd) -> y, jitted, and the gradients of sum(y * dy) with respect to
  x, w, wgu and wd."""
  def loss(x, w, wgu, wd):
    y = layer(x, ids, w, wgu, wd)
    return jnp.sum(y.astype(jnp.float32) * dy), y
  (_, y), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
      x, w, wgu, wd)
  return y, g


def dense_grouped_mlp(x_sorted, group_sizes, w_gate_up, w_down, *, recipe=None):
  """Per-row expert MLP (gathers each row's weights): same contract as reference.grouped_mlp."""
  del recipe
  ffn = w_down.shape[1]
  ends = jnp.cumsum(group_sizes)
  rows = jnp.arange(x_sorted.shape[0])
  expert = jnp.searchsorted(ends, rows, side="right")
  valid = expert < group_sizes.shape[0]
  expert = jnp.minimum(expert, group_sizes.shape[0] - 1)
  hp = jax.lax.Precision.HIGHEST
  gate_up = jnp.einsum("nh,nhf->nf", x_sorted.astype(jnp.float32),
                       w_gate_up[expert].astype(jnp.float32), precision=hp)
  hidden = (jax.nn.silu(gate_up[:, :ffn]) * gate_up[:, ffn:]).astype(x_sorted.dtype)
  out = jnp.einsum("nf,nfh->nh", hidden.astype(jnp.float32), w_down[expert].astype(jnp.float32),
                   precision=hp)
  return jnp.where(valid[:, None], out, 0.0).astype(x_sorted.dtype)

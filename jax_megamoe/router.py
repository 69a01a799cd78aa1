"""Top-k softmax router with Qwen3's renormalisation and the usual auxiliary losses."""

from __future__ import annotations

import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp


class RouterAux(NamedTuple):
  """Auxiliary outputs of `route`.

  load_balancing_loss: scalar, E * sum_e f_e * P_e (Switch/Qwen3 form): f_e is the fraction of
    routed slots that picked expert e, P_e the mean router probability of e. 1.0 when balanced.
  z_loss: scalar, mean over tokens of logsumexp(logits)^2 (ST-MoE), keeps logits small.
  expert_load: [E] float32, the fraction f_e (sums to 1); useful for logging imbalance.
  With no tokens (T = 0) all three are zeros: nothing was routed, so nothing to balance.
  """

  load_balancing_loss: jax.Array
  z_loss: jax.Array
  expert_load: jax.Array


def route(logits: jax.Array, top_k: int, *, norm_topk_prob: bool = True
          ) -> tuple[jax.Array, jax.Array, RouterAux]:
  """Routes tokens to experts.

  Args:
    logits: [T, E] router logits, any float dtype (computed in float32).
    top_k: experts per token, an integer (Python or numpy, not bool) with 1 <= top_k <= E.
    norm_topk_prob: renormalise the k selected probabilities to sum to 1 (Qwen3's
      norm_topk_prob); otherwise they keep their softmax values.

  Returns:
    (topk_weights float32 [T, k], topk_ids int32 [T, k], RouterAux). Ties pick the lower id.
  """
  if logits.ndim != 2:
    raise ValueError(f"logits must be [tokens, experts], got shape {logits.shape}")
  num_experts = logits.shape[1]
  if (isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral)
      or not 1 <= top_k <= num_experts):
    raise ValueError(f"top_k must be an int in [1, {num_experts}] (the number of experts), "
                     f"got {top_k!r}")
  top_k = int(top_k)
  logits = logits.astype(jnp.float32)
  probs = jax.nn.softmax(logits, axis=-1)
  topk_weights, topk_ids = jax.lax.top_k(probs, top_k)
  if norm_topk_prob:
    topk_weights = topk_weights / jnp.sum(topk_weights, axis=-1, keepdims=True)
  topk_ids = topk_ids.astype(jnp.int32)
  if logits.shape[0] == 0:  # the means below would be 0 / 0
    zero = jnp.zeros((), jnp.float32)
    return topk_weights, topk_ids, RouterAux(zero, zero, jnp.zeros((num_experts,), jnp.float32))

  one_hot = jax.nn.one_hot(topk_ids, num_experts, dtype=jnp.float32)  # [T, k, E]
  expert_load = jnp.mean(jnp.sum(one_hot, axis=1), axis=0) / top_k    # [E], sums to 1
  mean_prob = jnp.mean(probs, axis=0)                                  # [E]
  load_balancing_loss = num_experts * jnp.sum(jax.lax.stop_gradient(expert_load) * mean_prob)
  z_loss = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
  return topk_weights, topk_ids, RouterAux(load_balancing_loss, z_loss, expert_load)

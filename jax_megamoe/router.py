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


def route(logits: jax.Array, top_k: int, *, norm_topk_prob: bool = True,
          selection_bias: jax.Array | None = None
          ) -> tuple[jax.Array, jax.Array, RouterAux]:
  """Routes tokens to experts.

  Args:
    logits: [T, E] router logits, any float dtype (computed in float32).
    top_k: experts per token, an integer (Python or numpy, not bool) with 1 <= top_k <= E.
    norm_topk_prob: renormalise the k selected probabilities to sum to 1 (Qwen3's
      norm_topk_prob); otherwise they keep their softmax values.
    selection_bias: optional [E] per-expert bias added to the logits only to choose the top k
      (DeepSeek-V3's auxiliary-loss-free balancing; see update_selection_bias): the weights are
      still the unbiased softmax probabilities of the chosen experts, and no gradient reaches
      the bias. None or zeros: the same routing as without it.

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
  if selection_bias is None:
    topk_weights, topk_ids = jax.lax.top_k(probs, top_k)
  else:
    if selection_bias.shape != (num_experts,):
      raise ValueError(f"selection_bias must be [num_experts={num_experts}], got shape "
                       f"{selection_bias.shape}")
    biased = logits + jax.lax.stop_gradient(selection_bias.astype(jnp.float32))
    _, topk_ids = jax.lax.top_k(biased, top_k)
    topk_weights = jnp.take_along_axis(probs, topk_ids, axis=-1)
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


def update_selection_bias(bias: jax.Array, expert_load: jax.Array, rate: float) -> jax.Array:
  """One step of DeepSeek-V3's auxiliary-loss-free load balancing (arXiv:2412.19437, sec.
  2.1.2): every expert whose share of the routed slots is above the mean (1/E) has its
  selection bias lowered by `rate`, every one below it raised by `rate`:
  bias + rate * sign(1/E - expert_load). bias, expert_load: [..., E] (expert_load as
  RouterAux.expert_load, rows summing to one). Returns float32."""
  load = expert_load.astype(jnp.float32)
  mean = 1.0 / load.shape[-1]
  return bias.astype(jnp.float32) + rate * jnp.sign(mean - load)

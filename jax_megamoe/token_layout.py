"""Token <-> expert-row layouts shared by every backend: sort routed slots by expert, and
reduce expert outputs back over the top-k slots in a fixed order."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class SortedSlots(NamedTuple):
  """Routed slots (token t, slot j -> flat index t * k + j) sorted by expert.

  order: [T*k] flat slot index at each sorted position (masked slots last).
  inverse: [T*k] sorted position of each flat slot (inverse permutation of `order`).
  group_sizes: [E] int32 valid slots per expert.
  """

  order: jax.Array
  inverse: jax.Array
  group_sizes: jax.Array


def sort_by_expert(expert_ids: jax.Array, num_experts: int) -> SortedSlots:
  """expert_ids: [N] int32 in [0, E), or outside it for a masked slot. Stable (deterministic)."""
  valid = (expert_ids >= 0) & (expert_ids < num_experts)
  key = jnp.where(valid, expert_ids, num_experts)
  order = jnp.argsort(key, stable=True).astype(jnp.int32)
  inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32))
  group_sizes = jnp.bincount(key, length=num_experts + 1)[:num_experts].astype(jnp.int32)
  return SortedSlots(order, inverse, group_sizes)


def masked_weights(topk_ids: jax.Array, topk_weights: jax.Array, num_experts: int) -> jax.Array:
  """[T, k] float32 routing weights with masked slots (id -1 or out of range) set to 0."""
  valid = (topk_ids >= 0) & (topk_ids < num_experts)
  return jnp.where(valid, topk_weights.astype(jnp.float32), 0.0)


def combine_slots(slot_out: jax.Array, weights: jax.Array, dtype) -> jax.Array:
  """y[t] = sum_j weights[t, j] * slot_out[t, j] in float32, summed over j in order.

  slot_out: [T, k, H]; weights: [T, k] float32. Returns [T, H] in `dtype`.
  """
  terms = slot_out.astype(jnp.float32) * weights[:, :, None]
  acc = terms[:, 0]
  for j in range(1, terms.shape[1]):  # fixed order: bitwise reproducible
    acc = acc + terms[:, j]
  return acc.astype(dtype)

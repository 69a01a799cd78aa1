"""Token <-> expert-row layouts shared by every backend: sort routed slots by expert, move rows
between token, slot and sorted order (gathers both ways, their gradients included), and reduce
expert outputs back over the top-k slots in a fixed order."""

from __future__ import annotations

import functools
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


# The layouts' row permutations, with VJPs that gather: XLA's reverse of a row gather is a
# scatter-add of T*k rows (512 MiB at the 30B shape, ~2 ms each on an H200: session 10's trace
# of backend "cuda" without a mesh), where each cotangent here is a gather of the same size.


def token_rows(x: jax.Array, slots: SortedSlots, top_k: int) -> jax.Array:
  """[T*k, H]: x[t] at each sorted position of a slot of token t (x[order // k]). Its VJP:
  dx[t] = the sum of its k slots' cotangents, gathered by `inverse` and added in slot order in
  float32 (deterministic)."""
  return _token_rows(x, slots.order, slots.inverse, top_k)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _token_rows(x, order, inverse, top_k):
  return x[order // top_k]


def _token_rows_fwd(x, order, inverse, top_k):
  return _token_rows(x, order, inverse, top_k), inverse


def _token_rows_bwd(top_k, inverse, g):
  per_slot = g[inverse].reshape(-1, top_k, g.shape[-1]).astype(jnp.float32)
  acc = per_slot[:, 0]
  for j in range(1, top_k):  # fixed order
    acc = acc + per_slot[:, j]
  return acc.astype(g.dtype), None, None


_token_rows.defvjp(_token_rows_fwd, _token_rows_bwd)


def sorted_rows(rows: jax.Array, slots: SortedSlots) -> jax.Array:
  """[T*k, ...]: rows in flat slot order put in sorted order (rows[order]); the inverse of
  slot_order. Its VJP is the cotangent gathered by `inverse`."""
  return _permute(rows, slots.order, slots.inverse)


def slot_order(rows: jax.Array, slots: SortedSlots) -> jax.Array:
  """[T*k, ...]: the sorted rows back in flat slot order (rows[inverse]). Its VJP is the
  cotangent gathered by `order` (a permutation's transpose is its inverse)."""
  return _permute(rows, slots.inverse, slots.order)


@jax.custom_vjp
def _permute(rows, perm, inverse_perm):
  return rows[perm]


def _permute_fwd(rows, perm, inverse_perm):
  return rows[perm], inverse_perm


def _permute_bwd(inverse_perm, g):
  return g[inverse_perm], None, None


_permute.defvjp(_permute_fwd, _permute_bwd)


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

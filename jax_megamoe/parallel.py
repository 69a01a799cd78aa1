"""Expert parallelism through XLA collectives: the shard_map layer used by every backend that
has no dispatch/combine kernels of its own.

Layout (DESIGN.md §3): tokens are sharded over every mesh axis (data and expert alike), experts
over `expert_axis`. Inside each expert-parallel group (the devices that differ only in their
`expert_axis` coordinate) every device sends each routed slot to the rank that owns its expert
through a padded all_to_all, runs the grouped MLP over the rows it received, and sends the
results back, where the top-k slots are reduced in a fixed order.

The padded exchange reserves, per destination, room for all T*k slots of the source (so it is
dropless whatever the routing): memory is EP * T_local * k * H per device. It is the oracle, not
the fast path; the "cuda" backend replaces it with NVLink kernels.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jax_megamoe import token_layout

GroupedMlp = Callable[..., jax.Array]


def token_axes(mesh: Mesh) -> tuple[str, ...]:
  """The mesh axes that shard tokens: all of them."""
  return tuple(mesh.axis_names)


def expert_parallel_moe(x, topk_ids, topk_weights, w_gate_up, w_down, *, mesh: Mesh,
                        expert_axis: str, grouped_mlp: GroupedMlp, recipe: str | None):
  """moe() under a mesh; argument shapes as in jax_megamoe.moe (already validated)."""
  tokens = P(token_axes(mesh))
  experts = P(expert_axis)
  shard_fn = functools.partial(_expert_parallel_shard, expert_axis=expert_axis,
                               ep_size=mesh.shape[expert_axis],
                               num_experts=w_gate_up.shape[0], grouped_mlp=grouped_mlp,
                               recipe=recipe)
  in_specs = (tokens, tokens, tokens, experts, experts)
  args = (x, topk_ids, topk_weights, w_gate_up, w_down)
  if AxisType.Auto not in mesh.axis_types:
    # Explicit-axes meshes type their shardings: lay the inputs out as the shard_map expects,
    # whatever sharding they arrive with (Auto meshes let shard_map reshard by itself).
    args = [jax.reshard(arg, NamedSharding(mesh, spec)) for arg, spec in zip(args, in_specs)]
  return jax.shard_map(shard_fn, mesh=mesh, in_specs=in_specs, out_specs=tokens)(*args)


def _expert_parallel_shard(x, topk_ids, topk_weights, w_gate_up, w_down, *, expert_axis,
                           ep_size, num_experts, grouped_mlp, recipe):
  """One device: x [T, H], topk_* [T, k], w_* [E / ep_size, ...] (its own experts)."""
  num_tokens, top_k = topk_ids.shape
  hidden = x.shape[1]
  experts_per_rank = num_experts // ep_size
  num_slots = num_tokens * top_k

  # Sort this device's slots by global expert id: destination ranks become contiguous.
  flat_ids = topk_ids.reshape(-1)
  slots = token_layout.sort_by_expert(flat_ids, num_experts)
  sorted_ids = flat_ids[slots.order]
  position = jnp.arange(num_slots, dtype=jnp.int32)
  valid = position < jnp.sum(slots.group_sizes)
  rank_counts = slots.group_sizes.reshape(ep_size, experts_per_rank).sum(axis=1)
  rank_offsets = jnp.cumsum(rank_counts) - rank_counts
  dest = jnp.where(valid, sorted_ids // experts_per_rank, ep_size)  # ep_size: dropped
  dest_clamped = jnp.minimum(dest, ep_size - 1)
  row = position - rank_offsets[dest_clamped]

  # Dispatch: [ep, T*k] send buffers, padding rows tagged with the sentinel expert.
  rows = x[slots.order // top_k]
  send_x = jnp.zeros((ep_size, num_slots, hidden), x.dtype).at[dest, row].set(rows, mode="drop")
  send_e = jnp.full((ep_size, num_slots), experts_per_rank, jnp.int32).at[dest, row].set(
      sorted_ids % experts_per_rank, mode="drop")
  recv_x = jax.lax.all_to_all(send_x, expert_axis, 0, 0)  # [source rank, slot, H]
  recv_e = jax.lax.all_to_all(send_e, expert_axis, 0, 0)

  # Local experts over everything received, grouped by local expert.
  local = token_layout.sort_by_expert(recv_e.reshape(-1), experts_per_rank)
  out = grouped_mlp(recv_x.reshape(-1, hidden)[local.order], local.group_sizes, w_gate_up,
                    w_down, recipe=recipe)
  out = out[local.inverse].reshape(ep_size, num_slots, hidden)

  # Combine: results back to their source, then the fixed-order top-k reduction.
  back = jax.lax.all_to_all(out, expert_axis, 0, 0)  # [expert rank, slot, H]
  slot_sorted = jnp.where(valid[:, None], back[dest_clamped, row], 0)
  slot_out = slot_sorted[slots.inverse].reshape(num_tokens, top_k, hidden)
  weights = token_layout.masked_weights(topk_ids, topk_weights, num_experts)
  return token_layout.combine_slots(slot_out, weights, x.dtype)

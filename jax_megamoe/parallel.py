"""Expert parallelism through XLA collectives (the exchange of every backend that has no
dispatch/combine kernels of its own), and the one shard_map of every expert-parallel layer
(`shard_over_mesh`).

Layout (DESIGN.md §3): tokens are sharded over every mesh axis (data and expert alike), experts
over `expert_axis`. Inside each expert-parallel group (the devices that differ only in their
`expert_axis` coordinate) every device sends each routed slot to the rank that owns its expert,
runs the grouped MLP over the rows it received, and sends the results back, where the top-k
slots are reduced in a fixed order.

Two exchanges, same function: "ragged" (lax.ragged_all_to_all: only the routed rows travel; GPU
only) and "padded" (lax.all_to_all of [EP, T*k, H] buffers; every platform, XLA:CPU has no
ragged_all_to_all). Both are dropless whatever the routing: a device's receive buffer holds
EP * T_local * k rows of H. This is the oracle, not the fast path; the "cuda" backend replaces
it with NVLink kernels.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jax_megamoe import token_layout, varying
from jax_megamoe.validation import LayerShape, check_layer_args

# (x_sorted [N, H], group_sizes [E_local], w_gate_up, w_down) -> y_sorted [N, H]: the expert MLP
# over rows grouped by expert, recipe already bound (contract: backends.reference.grouped_mlp).
# FP8 MLPs also take blocks= (the weights already quantised: jax_megamoe.weight_blocks).
GroupedMlp = Callable[..., jax.Array]


def token_axes(mesh: Mesh) -> tuple[str, ...]:
  """The mesh axes that shard tokens: all of them."""
  return tuple(mesh.axis_names)


EXCHANGES = ("auto", "ragged", "padded")


# "auto" means "padded" on every platform: XLA:CPU has no ragged_all_to_all, and on 2 x H200
# (jax 0.11.2, 2026-11-30, benchmarks/RESULTS.md) ragged_all_to_all moved the same rows ~50x
# slower than all_to_all (24.7 ms vs 0.43 ms at 16,384 tokens x top-8, H=2048). "ragged" stays
# selectable for when XLA's implementation catches up.
DEFAULT_EXCHANGE = "padded"


def shard_map(f, mesh: Mesh, in_specs, out_specs, *, check_vma: bool = True):
  """jax.shard_map with the varying-axes check on or off, in either spelling jax has used."""
  try:
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=check_vma)
  except TypeError:  # older spelling
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_rep=check_vma)


def auto_axes(mesh: Mesh) -> bool:
  """Whether `mesh` has Auto axes (shardings left to XLA), not only Explicit ones (shardings
  in the arrays' types)."""
  return AxisType.Auto in tuple(getattr(mesh, "axis_types", (AxisType.Auto,)))


def _laid_out(mesh: Mesh, args, in_specs):
  """args as shard_map expects them: explicit-axes meshes type their shardings, so the inputs
  are resharded to the specs whatever sharding they arrive with (Auto meshes let shard_map
  reshard by itself). An arg may be a pytree (its spec applies to every leaf)."""
  if auto_axes(mesh):
    return args
  return [jax.tree.map(lambda a, spec=spec: jax.reshard(a, NamedSharding(mesh, spec)), arg)
          for arg, spec in zip(args, in_specs)]


def shard_over_mesh(per_device: Callable[..., jax.Array], mesh: Mesh, expert_axis: str,
                    args, *, check_vma: bool = True) -> jax.Array:
  """Runs per_device(x, topk_ids, topk_weights, w_gate_up, w_down[, weight_blocks]) on every
  device of `mesh` (DESIGN.md §3): tokens sharded over every mesh axis, experts over
  `expert_axis` (the weights and, when given, their blocks: jax_megamoe.weight_blocks); the
  result is tokens-sharded. The one shard_map of every expert-parallel layer."""
  tokens = P(token_axes(mesh))
  experts = P(expert_axis)
  in_specs = (tokens, tokens, tokens) + (experts,) * (len(args) - 3)
  args = _laid_out(mesh, args, in_specs)
  return shard_map(per_device, mesh, in_specs, tokens, check_vma=check_vma)(*args)


def shard_over_tokens(per_device: Callable, mesh: Mesh, args, num_outputs: int, *,
                      check_vma: bool = True):
  """per_device(*args) on every device of `mesh` over its own tokens: every arg and each of the
  `num_outputs` results sharded along their leading axis over every mesh axis (the tokens'
  layout, DESIGN.md §3), e.g. a router statistic solved per device without collectives."""
  in_specs = (P(token_axes(mesh)),) * len(args)
  out_specs = (P(token_axes(mesh)),) * num_outputs
  return shard_map(per_device, mesh, in_specs, out_specs, check_vma=check_vma)(
      *_laid_out(mesh, args, in_specs))


def shard_over_experts(per_device: Callable, mesh: Mesh, expert_axis: str, args):
  """per_device(*args) on every device of `mesh` over its experts: every arg (a pytree) and the
  result sharded along their leading axis over `expert_axis` (e.g. quantising the weights)."""
  in_specs = (P(expert_axis),) * len(args)
  return shard_map(per_device, mesh, in_specs, P(expert_axis))(*_laid_out(mesh, args, in_specs))


def expert_parallel_moe(x, topk_ids, topk_weights, w_gate_up, w_down, *, mesh: Mesh,
                        expert_axis: str, mlp: GroupedMlp, shape: LayerShape | None = None,
                        exchange: str = "auto", weight_blocks=None):
  """moe() under a mesh with the collective exchange around `mlp` (x_sorted, group_sizes,
  w_gate_up, w_down[, blocks=]) -> y_sorted. `shape`: the validated sizes
  (jax_megamoe.validation); None validates the arguments here. weight_blocks: the weights
  already quantised (jax_megamoe.weight_blocks), handed to `mlp` as blocks=."""
  if exchange not in EXCHANGES:
    raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
  if shape is None:
    shape = check_layer_args(x, topk_ids, topk_weights, w_gate_up, w_down, mesh, expert_axis)
  if exchange == "auto":
    exchange = DEFAULT_EXCHANGE
  shard_fn = functools.partial(_expert_parallel_shard, expert_axis=expert_axis,
                               ep_size=shape.ep_size, num_experts=shape.num_experts, mlp=mlp,
                               exchange=exchange)
  args = (x, topk_ids.astype(jnp.int32), topk_weights.astype(jnp.float32), w_gate_up, w_down)
  if weight_blocks is not None:
    args += (weight_blocks,)
  return shard_over_mesh(shard_fn, mesh, expert_axis, args)


def _expert_parallel_shard(x, topk_ids, topk_weights, w_gate_up, w_down, weight_blocks=None, *,
                           expert_axis, ep_size, num_experts, mlp, exchange):
  """One device: x [T, H], topk_* [T, k], w_* [E / ep_size, ...] (its own experts; so are the
  weight blocks, when given)."""
  if weight_blocks is not None:
    mlp = functools.partial(mlp, blocks=weight_blocks)
  num_tokens, top_k = topk_ids.shape
  experts_per_rank = num_experts // ep_size

  # Sort this device's slots by global expert id: destination ranks become contiguous.
  flat_ids = topk_ids.reshape(-1)
  slots = token_layout.sort_by_expert(flat_ids, num_experts)
  sorted_ids = flat_ids[slots.order]
  valid = jnp.arange(flat_ids.shape[0]) < jnp.sum(slots.group_sizes)
  route = _SlotRoute(
      rows=token_layout.token_rows(x, slots, top_k), local_expert=sorted_ids % experts_per_rank,
      rank_counts=slots.group_sizes.reshape(ep_size, experts_per_rank).sum(axis=1),
      dest=jnp.where(valid, sorted_ids // experts_per_rank, ep_size))

  exchange_fn = _ragged_exchange if exchange == "ragged" else _padded_exchange

  def local_experts(rows, local_expert):
    """Grouped MLP over received rows; padding rows carry local_expert == experts_per_rank."""
    local = token_layout.sort_by_expert(local_expert, experts_per_rank)
    out = mlp(token_layout.sorted_rows(rows, local), local.group_sizes, w_gate_up, w_down)
    return token_layout.slot_order(out, local)

  slot_sorted = exchange_fn(route, local_experts, expert_axis=expert_axis, ep_size=ep_size,
                            padding_expert=experts_per_rank)
  slot_sorted = jnp.where(valid[:, None], slot_sorted, 0)
  slot_out = token_layout.slot_order(slot_sorted, slots).reshape(num_tokens, top_k, x.shape[1])
  weights = token_layout.masked_weights(topk_ids, topk_weights, num_experts)
  return token_layout.combine_slots(slot_out, weights, x.dtype)


class _SlotRoute(NamedTuple):
  """A device's slots sorted by expert: rows [N, H], local_expert [N] (id on its rank),
  rank_counts [EP] (the first sum(rank_counts) slots are valid), dest [N] (EP if invalid)."""

  rows: jax.Array
  local_expert: jax.Array
  rank_counts: jax.Array
  dest: jax.Array


def _padded_exchange(route, local_experts, *, expert_axis, ep_size, padding_expert):
  """all_to_all of [EP, N, H] buffers: slot i goes to row (dest, i - offset[dest])."""
  num_slots, hidden = route.rows.shape
  rank_offsets = jnp.cumsum(route.rank_counts) - route.rank_counts
  dest_clamped = jnp.minimum(route.dest, ep_size - 1)
  row = jnp.arange(num_slots) - rank_offsets[dest_clamped]
  send_x = jnp.zeros((ep_size, num_slots, hidden), route.rows.dtype).at[route.dest, row].set(
      route.rows, mode="drop")
  send_e = jnp.full((ep_size, num_slots), padding_expert, jnp.int32).at[route.dest, row].set(
      route.local_expert, mode="drop")
  recv_x = jax.lax.all_to_all(send_x, expert_axis, 0, 0)  # [source rank, slot, H]
  recv_e = jax.lax.all_to_all(send_e, expert_axis, 0, 0)
  out = local_experts(recv_x.reshape(-1, hidden), recv_e.reshape(-1))
  back = jax.lax.all_to_all(out.reshape(ep_size, num_slots, hidden), expert_axis, 0, 0)
  return back[dest_clamped, row]


def _ragged_exchange(route, local_experts, *, expert_axis, ep_size, padding_expert):
  """ragged_all_to_all: only routed rows travel, received rows packed source by source."""
  del ep_size
  num_slots = route.rows.shape[0]
  counts = jax.lax.all_gather(route.rank_counts, expert_axis)  # [source, dest]
  capacity = counts.shape[0] * num_slots  # every source could send all its slots here
  recv_x = _ragged_transfer(route.rows, counts, capacity, 0, False, expert_axis)
  recv_e = _ragged_transfer(route.local_expert, counts, capacity, padding_expert, False,
                            expert_axis)
  out = local_experts(recv_x, recv_e)
  # Back: each source's rows return to where they left its sorted buffer.
  return _ragged_transfer(out, counts, num_slots, 0, True, expert_axis)


# The collective _ragged_transfer uses; tests on CPU (no ragged_all_to_all in XLA:CPU) swap in
# an emulation.
ragged_all_to_all = jax.lax.ragged_all_to_all


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _ragged_transfer(operand, counts, out_rows, fill, reverse, axis_name):
  """Moves rows between the ranks of `axis_name`; counts [source, dest] rows.

  Forward: my rows, sorted by destination, into every destination's buffer [out_rows, ...],
  packed by source rank (rows no one wrote hold `fill`). Reverse: exactly the inverse. Each
  direction's VJP is the other direction: JAX 0.11.2's own transpose of ragged_all_to_all gave
  wrong gradients here (2 x H200, benchmarks/RESULTS.md).
  """
  me = jax.lax.axis_index(axis_name)
  send_offsets = jnp.cumsum(counts, axis=1) - counts  # row offsets in each source's buffer
  recv_offsets = jnp.cumsum(counts, axis=0) - counts  # row offsets in each dest's buffer
  if reverse:
    offsets = (recv_offsets[:, me], counts[:, me], send_offsets[:, me], counts[me])
  else:
    offsets = (send_offsets[me], counts[me], recv_offsets[me], counts[:, me])
  output = jnp.full((out_rows, *operand.shape[1:]), fill, operand.dtype)
  # On GPUs (jax 0.11.2) the result is typed like `output`, invariant; the rows differ per rank.
  return varying.cast_varying(ragged_all_to_all(operand, output, *offsets, axis_name=axis_name),
                              (axis_name,))


def _ragged_transfer_fwd(operand, counts, out_rows, fill, reverse, axis_name):
  out = _ragged_transfer(operand, counts, out_rows, fill, reverse, axis_name)
  return out, (counts, operand.shape[0])


def _ragged_transfer_bwd(out_rows, fill, reverse, axis_name, residuals, cotangent):
  del out_rows, fill
  counts, in_rows = residuals
  return _ragged_transfer(cotangent, counts, in_rows, 0, not reverse, axis_name), None


_ragged_transfer.defvjp(_ragged_transfer_fwd, _ragged_transfer_bwd)

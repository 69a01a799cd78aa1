"""The JAX-native expert-parallel MoE layer a user would write today (MaxText style): argsort the
routed slots by expert, jax.lax.ragged_all_to_all them to the ranks that own the experts,
regroup by local expert, jax.lax.ragged_dot SwiGLU experts, and the same way back.

Same contract as jax_megamoe.moe (x [T, H], topk_ids / topk_weights [T, k], w_gate_up
[E, H, 2F], w_down [E, F, H]; tokens sharded over every mesh axis, experts over expert_axis),
bf16 or fp32 only. Receive buffers are sized for the worst case (every slot of every peer), so
it is dropless, as MaxText's dropless path.

XLA:CPU has no ragged-all-to-all. exchange="padded" replaces it with an exact emulation over
jax.lax.all_to_all of per-peer padded blocks (same offsets and sizes, same result), which is how
the CPU smoke test checks this layer's numerics; exchange="auto" picks it on CPU only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P


def exchange_for(platform: str, exchange: str = "auto") -> str:
  if exchange == "auto":
    return "padded" if platform == "cpu" else "ragged"
  if exchange not in ("ragged", "padded"):
    raise ValueError(f"exchange must be 'auto', 'ragged' or 'padded', got {exchange!r}")
  return exchange


def moe(x, topk_ids, topk_weights, w_gate_up, w_down, *, mesh: Mesh, expert_axis: str = "expert",
        exchange: str = "auto"):
  """y [T, H] in x's dtype; differentiable w.r.t. x, topk_weights and the expert weights."""
  tokens, experts = P(tuple(mesh.axis_names)), P(expert_axis)
  exchange = exchange_for(mesh.devices.flat[0].platform, exchange)
  shard = functools.partial(_shard, axis=expert_axis, ep=mesh.shape[expert_axis],
                            num_experts=w_gate_up.shape[0], exchange=exchange)
  return jax.shard_map(shard, mesh=mesh, in_specs=(tokens, tokens, tokens, experts, experts),
                       out_specs=tokens)(x, topk_ids.astype(jnp.int32),
                                         topk_weights.astype(jnp.float32), w_gate_up, w_down)


def _exclusive_cumsum(v, axis=0):
  return jnp.cumsum(v, axis=axis) - v


def _shard(x, topk_ids, topk_weights, w_gate_up, w_down, *, axis, ep, num_experts, exchange):
  num_tokens, top_k = topk_ids.shape
  hidden = x.shape[1]
  local_experts = num_experts // ep
  me = jax.lax.axis_index(axis)

  # 1. Sort this device's routed slots by global expert: destination ranks become contiguous.
  flat_ids = topk_ids.reshape(-1)
  order = jnp.argsort(flat_ids, stable=True)
  x_sorted = x[order // top_k]
  sizes = jnp.bincount(flat_ids, length=num_experts).astype(jnp.int32)  # per global expert

  # 2. Everyone's per-expert counts: who sends how much to whom, and where it lands.
  all_sizes = jax.lax.all_gather(sizes, axis)                         # [sender, E]
  sizes_to = all_sizes.reshape(ep, ep, local_experts)                 # [sender, receiver, e]
  pair = sizes_to.sum(axis=2)                                         # [sender, receiver]
  send_sizes = pair[me]
  input_offsets = _exclusive_cumsum(send_sizes)
  recv_sizes = pair[:, me]
  recv_offsets = _exclusive_cumsum(recv_sizes)                        # in my receive buffer
  output_offsets = _exclusive_cumsum(pair, axis=0)[me]                # in each receiver's buffer
  capacity = ep * num_tokens * top_k                                  # dropless worst case

  recv = _ragged_exchange(x_sorted, jnp.zeros((capacity, hidden), x.dtype), input_offsets,
                          send_sizes, output_offsets, recv_sizes, recv_offsets, axis=axis, ep=ep,
                          exchange=exchange, block=num_tokens * top_k)

  # 3. Regroup what arrived ([source][local expert] blocks) by local expert; padding last.
  counts = sizes_to[:, me, :]                                         # [source, local expert]
  ends = jnp.cumsum(counts.reshape(-1))
  segment = jnp.searchsorted(ends, jnp.arange(capacity), side="right")
  local_id = jnp.where(segment < ep * local_experts, segment % local_experts, local_experts)
  regroup = jnp.argsort(local_id, stable=True)
  group_sizes = counts.sum(axis=0)

  # 4. SwiGLU experts with ragged_dot (fp32 accumulation), rows of padding produce zeros.
  rows = recv[regroup]
  ffn = w_down.shape[1]
  gate_up = jax.lax.ragged_dot(rows, w_gate_up, group_sizes, preferred_element_type=jnp.float32)
  act = (jax.nn.silu(gate_up[:, :ffn]) * gate_up[:, ffn:]).astype(x.dtype)
  out = jax.lax.ragged_dot(act, w_down, group_sizes, preferred_element_type=jnp.float32)
  out = out.astype(x.dtype)
  out = jnp.zeros_like(out).at[regroup].set(out)                      # back to arrival order

  # 5. Results back to their sources (the exchange reversed), unsort, weighted top-k sum.
  back = _ragged_exchange(out, jnp.zeros((num_tokens * top_k, hidden), x.dtype), recv_offsets,
                          recv_sizes, _exclusive_cumsum(pair, axis=1)[:, me], send_sizes,
                          input_offsets, axis=axis, ep=ep, exchange=exchange,
                          block=num_tokens * top_k)
  slot_out = jnp.zeros_like(back).at[order].set(back).reshape(num_tokens, top_k, hidden)
  y = jnp.einsum("tkh,tk->th", slot_out.astype(jnp.float32), topk_weights)
  return y.astype(x.dtype)


def _ragged_exchange(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                     recv_offsets, *, axis, ep, exchange, block):
  """jax.lax.ragged_all_to_all, or its emulation over a padded all_to_all (exchange="padded").

  recv_offsets (where each source's rows start in `output`) is what the receiver computes for
  itself; ragged_all_to_all gets the same information from the senders' output_offsets.
  `block` bounds the rows one peer can send (the emulation's per-peer padding).
  """
  if exchange == "ragged":
    return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                                     recv_sizes, axis_name=axis)
  del output_offsets
  hidden = operand.shape[1]
  padded = jnp.concatenate([operand, jnp.zeros((block, hidden), operand.dtype)])
  row = jnp.arange(block)
  send = jnp.stack([
      jnp.where((row < send_sizes[p])[:, None],
                jax.lax.dynamic_slice_in_dim(padded, input_offsets[p], block), 0)
      for p in range(ep)])                                           # [peer, block, H]
  got = jax.lax.all_to_all(send, axis, 0, 0)                         # [source, block, H]
  dest = jnp.where(row[None, :] < recv_sizes[:, None], recv_offsets[:, None] + row[None, :],
                   output.shape[0])                                  # out of range: dropped
  return output.at[dest.reshape(-1)].set(got.reshape(-1, hidden), mode="drop")

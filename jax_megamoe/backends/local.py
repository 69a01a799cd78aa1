"""The MoE layer with every expert on this device, from any grouped expert MLP: sort the routed
slots by expert, run the MLP over the expert-contiguous rows, reduce the top-k slots in a fixed
order. Backends "reference" and "cuda" use it without a mesh. Both permutations differentiate
to gathers (token_layout.token_rows, slot_order), not to XLA scatters."""

from __future__ import annotations

import functools

from jax_megamoe import token_layout
from jax_megamoe.parallel import GroupedMlp


def local_moe(x, topk_ids, topk_weights, w_gate_up, w_down, *, mlp: GroupedMlp,
              weight_blocks=None):
  """y [T, H] for x [T, H], topk_ids / topk_weights [T, k] (int32 / float32), all E experts
  here; `mlp` (x_sorted, group_sizes, w_gate_up, w_down) -> y_sorted with its recipe bound;
  weight_blocks (the weights already quantised: jax_megamoe.weight_blocks) go to it as
  blocks=."""
  if weight_blocks is not None:
    mlp = functools.partial(mlp, blocks=weight_blocks)
  num_tokens, top_k = topk_ids.shape
  num_experts = w_gate_up.shape[0]
  slots = token_layout.sort_by_expert(topk_ids.reshape(-1), num_experts)
  out = mlp(token_layout.token_rows(x, slots, top_k), slots.group_sizes, w_gate_up, w_down)
  slot_out = token_layout.slot_order(out, slots).reshape(num_tokens, top_k, x.shape[1])
  weights = token_layout.masked_weights(topk_ids, topk_weights, num_experts)
  return token_layout.combine_slots(slot_out, weights, x.dtype)

"""Stand-ins for tracing and lowering backend "fused" on a CPU (no GPU, no symmetric workspace):
a workspace that has only an id and a rank count, small all-ones layer inputs, and a config."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jax_megamoe.backends import cuda_ep, fused
from jax_megamoe.validation import check_layer_args

T, H, E, K = 64, 256, 8, 2


@dataclasses.dataclass(frozen=True, eq=False)
class TracedWorkspace:
  """Stands in for a symmetric workspace: tracing needs its id and rank count only."""
  num_ranks: int = 1
  virtual: bool = False
  id: int = 7
  closed: bool = False

  def fits(self, **_) -> bool:
    return True


def layer_inputs(ffn, lead=()):
  """(x, ids, w, w_gate_up, w_down), all ones but the ids (two distinct experts per token);
  lead: a stacked rank axis (virtual ranks), the experts split over it."""
  ids = np.stack([np.arange(T) % E, (np.arange(T) + 1) % E], 1).astype(np.int32)
  x = jnp.ones((*lead, T, H), jnp.bfloat16)
  ids = jnp.broadcast_to(jnp.asarray(ids), (*lead, T, K))
  w = jnp.ones((*lead, T, K), jnp.float32)
  el = E // (lead[0] if lead else 1)
  wgu = jnp.ones((*lead, el, H, 2 * ffn), jnp.bfloat16)
  wd = jnp.ones((*lead, el, ffn, H), jnp.bfloat16)
  return x, ids, w, wgu, wd


def traced_config(ffn, recipe=None, num_ranks=1):
  """A FusedConfig on a TracedWorkspace of num_ranks (virtual when several)."""
  x, ids, w, wgu, wd = layer_inputs(ffn)
  shape = check_layer_args(x, ids, w, wgu.reshape(E, H, 2 * ffn), wd.reshape(E, ffn, H))
  plan = cuda_ep.LayerPlan.of(shape, fused.cuda_mlp(recipe))
  ws = TracedWorkspace(num_ranks=num_ranks, virtual=num_ranks > 1)
  return fused.FusedConfig(ws, E, plan, 0, recipe=recipe)

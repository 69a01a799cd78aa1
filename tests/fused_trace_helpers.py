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


def random_problem(seed, ffn, w_down_scale, tokens=96, experts=8, top_k=2, hidden=256):
  """(x, ids, w, w_gate_up, w_down, dy) at one rank: random values, 20% of the slots masked;
  w_down drawn N(0, 1) / w_down_scale."""
  rng = np.random.default_rng(seed)
  ids = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k].astype(np.int32)
  ids[rng.random(ids.shape) < 0.2] = -1  # masked slots
  ids = jnp.asarray(ids)
  x = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.bfloat16)
  w = jnp.asarray(rng.random((tokens, top_k)), jnp.float32)
  wgu = jnp.asarray(rng.standard_normal((experts, hidden, 2 * ffn)) / 16, jnp.bfloat16)
  wd = jnp.asarray(rng.standard_normal((experts, ffn, hidden)) / w_down_scale, jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.float32)
  return x, ids, w, wgu, wd, dy


def config_for(x, ids, w, wgu, wd, recipe=None):
  """A one-rank FusedConfig on a TracedWorkspace for these layer arguments."""
  shape = check_layer_args(x, ids, w, wgu, wd)
  plan = cuda_ep.LayerPlan.of(shape, fused.cuda_mlp(recipe))
  return fused.FusedConfig(TracedWorkspace(), shape.num_experts, plan, 0, recipe=recipe)


def errors_against(layer, reference, x, ids, w, wgu, wd, dy) -> dict:
  """Relative errors of y and the gradients of <y, dy> in x, w, w_gate_up, w_down: `layer`
  against `reference` (both called as (x, ids, w, w_gate_up, w_down))."""
  import jax

  def grads(fn):
    def loss(x, w, a, b):
      y = fn(x, ids, w, a, b)
      return jnp.sum(y.astype(jnp.float32) * dy), y
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(x, w, wgu, wd)
  (_, y), g = grads(layer)
  (_, y_ref), g_ref = grads(reference)
  rel = lambda a, b: float(np.linalg.norm(np.asarray(a, np.float32) - np.asarray(b, np.float32))
                           / max(np.linalg.norm(np.asarray(b, np.float32)), 1e-30))
  return {n: rel(a, b) for n, a, b in zip(("y", "dx", "dw", "dwgu", "dwd"), (y, *g),
                                          (y_ref, *g_ref))}

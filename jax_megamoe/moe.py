"""The public functional op jax_megamoe.moe: validates once, picks the backend, runs its layer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jax_megamoe import backends, eager, fp8
from jax_megamoe.validation import COMPUTE_DTYPES, check_layer_args
from jax_megamoe.weight_blocks import check_weight_blocks

BACKENDS = backends.NAMES
RECIPES = (None, *fp8.RECIPES)
__all__ = ["BACKENDS", "COMPUTE_DTYPES", "RECIPES", "moe"]


def moe(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, w_gate_up: jax.Array,
        w_down: jax.Array, *, mesh: Mesh | None = None, expert_axis: str = "expert",
        backend: str = "auto", recipe: str | None = None, weight_blocks=None) -> jax.Array:
  """Mixture-of-experts SwiGLU layer: y[t] = sum_j w[t,j] * Expert_{id[t,j]}(x[t]).

  Args:
    x: [T, H] tokens, float32 / bfloat16 / float16.
    topk_ids: [T, k] integer expert ids in [0, E); -1 masks a slot (it contributes nothing).
      Other out-of-range ids raise when the values are concrete, and are masked under tracing.
      A token's ids must be distinct (route() gives them so): a repeated id raises when the
      values are concrete; under tracing the EP kernels count it once (and report it in their
      stats), the reference once per slot.
    topk_weights: [T, k] routing weights (computed in float32).
    w_gate_up: [E, H, 2F] in x's dtype; gate = [..., :F], up = [..., F:].
    w_down: [E, F, H] in x's dtype.
    mesh: optional device mesh. Tokens are sharded over ALL its axes (T must divide evenly over
      its devices), experts over `expert_axis` (E must divide by that axis' size). Inputs may
      arrive with any sharding.
    expert_axis: the mesh axis that shards experts.
    backend: "auto" (best available: "cuda", else "reference"), "reference" (pure JAX),
      "cuda" (FFI kernels), "fused" (the forward as one overlapping kernel, recipes None,
      "fp8" and "fp8_pow2"; "auto" does not pick it: a training step with it measures no
      faster on an H200).
    recipe: None (matmuls in x's dtype, fp32 accumulation), "fp8" / "fp8_pow2" (blockwise FP8,
      Hopper) or "mxfp8" (MXFP8, Blackwell).
    weight_blocks: recipes "fp8" / "fp8_pow2": w_gate_up and w_down already quantised,
      jax_megamoe.quantize_expert_weights(w_gate_up, w_down, recipe, mesh=mesh), so that
      several calls with the same weights quantise them once (jax_megamoe/weight_blocks.py).
      The result is the same as without them; gradients still go to w_gate_up and w_down.

  Returns:
    y [T, H] in x's dtype. Differentiable w.r.t. x, topk_weights, w_gate_up and w_down.
  """
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  if recipe not in RECIPES:
    raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
  shape = check_layer_args(x, topk_ids, topk_weights, w_gate_up, w_down, mesh, expert_axis)
  if weight_blocks is not None:
    check_weight_blocks(weight_blocks, shape, recipe)
  if mesh is not None and eager.is_eager(x, topk_ids, topk_weights, w_gate_up, w_down):
    return eager.call(_moe_with_blocks, x, topk_ids, topk_weights, w_gate_up, w_down,
                      weight_blocks, mesh=mesh, expert_axis=expert_axis, backend=backend,
                      recipe=recipe)
  impl = backends.resolve(backend, recipe, shape=shape, mesh=mesh, expert_axis=expert_axis)
  return impl.moe(x, topk_ids.astype(jnp.int32), topk_weights.astype(jnp.float32), w_gate_up,
                  w_down, mesh=mesh, expert_axis=expert_axis, recipe=recipe, shape=shape,
                  weight_blocks=weight_blocks)


def _moe_with_blocks(x, topk_ids, topk_weights, w_gate_up, w_down, weight_blocks, **options):
  """moe with weight_blocks positional: eager.call keeps keyword options static, and the blocks
  are arrays."""
  return moe(x, topk_ids, topk_weights, w_gate_up, w_down, weight_blocks=weight_blocks,
             **options)

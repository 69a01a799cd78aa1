"""Backend "reference": the pure-JAX layer, the oracle for every kernel.

Runs on any platform. The expert MLP uses lax.ragged_dot over contiguous expert groups; recipes
are emulated (jax_megamoe.fp8), so fp8 kernels are compared with exactly the rounding they should
apply. Under a mesh the rows travel through XLA collectives (jax_megamoe.parallel).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_megamoe import fp8, parallel
from jax_megamoe.backends.local import local_moe

NAME = "reference"


def unavailable_reason(recipe: str | None = None) -> str | None:
  del recipe  # every recipe is emulated
  return None


def _stored(a: jax.Array, dtype) -> jax.Array:
  """a rounded to `dtype`, as a kernel stores it. The barrier keeps the rounding: XLA:GPU
  (xla_allow_excess_precision, on by default) deletes a convert to bf16 and back to f32 inside
  a fusion (seen on an H200: the EP fp8 test's reference kept gate_up in fp32)."""
  return jax.lax.optimization_barrier(a.astype(dtype))


def grouped_mlp(x_sorted: jax.Array, group_sizes: jax.Array, w_gate_up: jax.Array,
                w_down: jax.Array, *, recipe: str | None = None, blocks=None) -> jax.Array:
  """SwiGLU expert MLP over rows grouped by expert.

  Args:
    x_sorted: [N, H] rows, those of expert e contiguous and in expert order.
    group_sizes: [E] int32 rows per expert; sum <= N, rows past the sum are padding.
    w_gate_up: [E, H, 2F] (gate = [..., :F], up = [..., F:]).
    w_down: [E, F, H].
    recipe: None, "fp8" or "mxfp8" (emulated).
    blocks: recipes "fp8" / "fp8_pow2": the weights already quantised
      (jax_megamoe.weight_blocks); their values replace the weights' rounding, which they equal
      when they were quantised from these weights. w_gate_up / w_down then only take gradients.

  Returns:
    [N, H] in x_sorted's dtype: (silu(x Wg) * (x Wu)) Wd per row, fp32 accumulation; the first
    GEMM's output and the hidden activation are rounded to the compute dtype (as the kernels
    store them; their gradients are rounded likewise), the SwiGLU runs in fp32; padding rows
    are zero.
  """
  dtype = x_sorted.dtype
  ffn = w_down.shape[1]
  spec = fp8.get_recipe(recipe)
  if spec is None:
    def product(a, b, b_rounded=None):
      del b_rounded  # (None: blocks need an FP8 recipe, moe's validation)
      return jax.lax.ragged_dot(a, b, group_sizes, precision=jax.lax.Precision.HIGHEST,
                                preferred_element_type=jnp.float32)
  else:  # every GEMM in FP8, forward and backward, operands rounded as the kernels round them
    def product(a, b, b_rounded=None):
      return fp8.ragged_dot(a, b, group_sizes, spec, b_rounded)
  rounded = (None, None) if blocks is None else (
      fp8.dequantize_weight_blocks(*blocks.w_gate_up), fp8.dequantize_weight_blocks(*blocks.w_down))
  gate_up = _stored(product(x_sorted, w_gate_up, rounded[0]), dtype).astype(jnp.float32)
  hidden = _stored(jax.nn.silu(gate_up[:, :ffn]) * gate_up[:, ffn:], dtype)
  out = product(hidden, w_down, rounded[1])
  valid_rows = jnp.arange(x_sorted.shape[0]) < jnp.sum(group_sizes)
  return jnp.where(valid_rows[:, None], out, 0.0).astype(dtype)


def moe(x, topk_ids, topk_weights, w_gate_up, w_down, *, mesh, expert_axis, recipe, shape,
        weight_blocks=None):
  """The layer (backend protocol: jax_megamoe.backends)."""
  mlp = functools.partial(grouped_mlp, recipe=recipe)
  if mesh is None:
    return local_moe(x, topk_ids, topk_weights, w_gate_up, w_down, mlp=mlp,
                     weight_blocks=weight_blocks)
  return parallel.expert_parallel_moe(x, topk_ids, topk_weights, w_gate_up, w_down, mesh=mesh,
                                      expert_axis=expert_axis, mlp=mlp, shape=shape,
                                      weight_blocks=weight_blocks)

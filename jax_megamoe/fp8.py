"""FP8 recipes and their pure-JAX emulation (quantise -> dequantise), the numerical oracle.

Recipes (DESIGN.md §5):
  None     matmuls in the inputs' dtype with fp32 accumulation.
  "fp8"    DeepSeek-V3 blockwise FP8 for Hopper: e4m3 values with fp32 scales; activations in
           1 x 128 blocks along the contraction (K) axis, weights in 128 x 128 blocks.
  "mxfp8"  OCP MXFP8 for Blackwell: e4m3 values in 1 x 32 blocks along K with E8M0
           (power-of-two) scales, for activations and weights alike.

The emulation rounds each GEMM operand to exactly the values the kernel multiplies; products and
sums then run in fp32. Gradients pass straight through the rounding (straight-through
estimator): the backward GEMMs of the emulation run on unquantised operands.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

E4M3_MAX = 448.0
E4M3_EMAX = 8  # exponent of the largest power of two below E4M3_MAX (2^8 = 256)


@dataclasses.dataclass(frozen=True)
class Recipe:
  name: str
  act_block: int           # activations: 1 x act_block along K
  weight_block: tuple[int, int]  # weights: (K, N) block
  power_of_two_scales: bool


RECIPES = {
    "fp8": Recipe("fp8", 128, (128, 128), power_of_two_scales=False),
    "mxfp8": Recipe("mxfp8", 32, (32, 1), power_of_two_scales=True),
}


def get_recipe(name: str | None) -> Recipe | None:
  if name is None:
    return None
  if name not in RECIPES:
    raise ValueError(f"recipe must be one of {[None, *RECIPES]}, got {name!r}")
  return RECIPES[name]


def _block_scale(amax: jax.Array, power_of_two: bool) -> jax.Array:
  amax = jnp.maximum(amax, jnp.finfo(jnp.float32).tiny)
  if power_of_two:
    # OCP MX: shared exponent floor(log2(amax)) - emax(e4m3); values above 448 saturate.
    return jnp.exp2(jnp.floor(jnp.log2(amax)) - E4M3_EMAX)
  return amax / E4M3_MAX


def quantize_dequantize(x: jax.Array, block: tuple[int, ...], *, power_of_two: bool = False
                        ) -> jax.Array:
  """Rounds x to e4m3 with one fp32 scale per block of the trailing len(block) axes.

  Axes not a multiple of their block are zero-padded to one (padding never changes a block's
  amax). Returns float32 values of the same shape as x: exactly what an FP8 GEMM multiplies.
  """
  nb = len(block)
  x32 = x.astype(jnp.float32)
  lead, tail = x.shape[:-nb], x.shape[-nb:]
  padded = [math.ceil(n / b) * b for n, b in zip(tail, block)]
  x32 = jnp.pad(x32, [(0, 0)] * len(lead) + [(0, p - n) for p, n in zip(padded, tail)])
  blocked_shape = list(lead)
  for p, b in zip(padded, block):
    blocked_shape += [p // b, b]
  xb = x32.reshape(blocked_shape)
  block_axes = tuple(len(lead) + 2 * i + 1 for i in range(nb))
  amax = jnp.max(jnp.abs(xb), axis=block_axes, keepdims=True)
  scale = _block_scale(amax, power_of_two)
  q = jnp.clip(xb / scale, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
  deq = (q.astype(jnp.float32) * scale).reshape(x32.shape)
  return deq[tuple(slice(0, n) for n in x.shape)]


def _straight_through(fn):
  @jax.custom_vjp
  def wrapped(x):
    return fn(x)
  wrapped.defvjp(lambda x: (fn(x), None), lambda _, g: (g,))
  return wrapped


def emulate_activation(x: jax.Array, recipe: Recipe) -> jax.Array:
  """[..., K] activation operand rounded in 1 x act_block blocks along K (float32 out)."""
  return _straight_through(
      lambda v: quantize_dequantize(v, (recipe.act_block,),
                                    power_of_two=recipe.power_of_two_scales))(x)


def emulate_weight(w: jax.Array, recipe: Recipe) -> jax.Array:
  """[..., K, N] weight operand rounded in weight_block blocks over (K, N) (float32 out)."""
  return _straight_through(
      lambda v: quantize_dequantize(v, recipe.weight_block,
                                    power_of_two=recipe.power_of_two_scales))(w)

"""FP8 recipes and their pure-JAX emulation (quantise -> dequantise), the numerical oracle.

Recipes (DESIGN.md §5):
  None     matmuls in the inputs' dtype with fp32 accumulation.
  "fp8"    DeepSeek-V3 blockwise FP8 for Hopper: e4m3 values with fp32 scales; activations in
           1 x 128 blocks along the contraction (K) axis, weights in 128 x 128 blocks; scale =
           amax * fp32(1/448) per block.
  "fp8_pow2"  the same with each scale rounded up to a power of two (2^ceil(log2(amax / 448)),
           exact through frexp; never saturates), as DeepSeek-V3 does for its wgrad operands.
  "mxfp8"  OCP MXFP8 for Blackwell: e4m3 values in 1 x 32 blocks along K with E8M0
           (power-of-two) scales, for activations and weights alike.

The emulation rounds each GEMM operand to exactly the values the kernel multiplies (the CUDA
quantisation kernels match it bit for bit: same fp32 division, round-to-nearest-even, saturation
at +-448); products and sums then run in fp32. Gradients pass straight through the rounding
(straight-through estimator) and the backward GEMMs run on the UNquantised operands: use
`ragged_dot` below for a GEMM with exactly these semantics (dx = dy W^T, dW = x^T dy with the
original x, W), which is what the CUDA "fp8" backward computes (bf16 kernels).
"""

from __future__ import annotations

import dataclasses
import functools
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
    "fp8_pow2": Recipe("fp8_pow2", 128, (128, 128), power_of_two_scales=True),
    "mxfp8": Recipe("mxfp8", 32, (32, 1), power_of_two_scales=True),
}


def get_recipe(name: str | None) -> Recipe | None:
  if name is None:
    return None
  if name not in RECIPES:
    raise ValueError(f"recipe must be one of {[None, *RECIPES]}, got {name!r}")
  return RECIPES[name]


def _block_scale(amax: jax.Array, power_of_two: bool, rule: str = "ocp") -> jax.Array:
  tiny = jnp.finfo(jnp.float32).tiny
  if power_of_two and rule == "ocp":
    # OCP MX: shared exponent floor(log2(amax)) - emax(e4m3); values above 448 saturate.
    return jnp.exp2(jnp.floor(jnp.log2(jnp.maximum(amax, tiny))) - E4M3_EMAX)
  # amax * fp32(1/448), not amax / 448: XLA may rewrite a division by a constant into this
  # product, so the product is the one rule that the kernels and every backend compute alike.
  # Floored at the smallest normal float AFTER the product: a denormal scale (an all-zero
  # block) is flushed to 0 where denormals are (XLA:CPU), and 0 / 0 would be NaN.
  scale = jnp.maximum(amax * jnp.float32(1.0 / E4M3_MAX), tiny)
  if power_of_two:  # "ceil": the smallest power of two >= amax / 448, exactly (no log2 rounding)
    mant, expo = jnp.frexp(scale)
    scale = jnp.ldexp(jnp.ones_like(scale), jnp.where(mant == 0.5, expo - 1, expo))
  return scale


def quantize_dequantize(x: jax.Array, block: tuple[int, ...], *, power_of_two: bool = False,
                        rule: str = "ocp") -> jax.Array:
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
  scale = _block_scale(amax, power_of_two, rule)
  q = jnp.clip(xb / scale, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
  # XLA:GPU (xla_allow_excess_precision, on by default) deletes convert(convert(x, f8), f32)
  # pairs inside a fusion, which would silently skip the rounding under jit on a GPU (seen on
  # an H200: the jitted emulation matched the unquantised product); the barrier keeps it.
  q = jax.lax.optimization_barrier(q)
  deq = (q.astype(jnp.float32) * scale).reshape(x32.shape)
  return deq[tuple(slice(0, n) for n in x.shape)]


def _rule(recipe: Recipe) -> str:
  return "ocp" if recipe.name == "mxfp8" else "ceil"


def quantize_activation(x: jax.Array, recipe: Recipe) -> jax.Array:
  """[..., K] rounded in 1 x act_block blocks along K (float32 out; no custom gradient)."""
  return quantize_dequantize(x, (recipe.act_block,), power_of_two=recipe.power_of_two_scales,
                             rule=_rule(recipe))


def quantize_weight(w: jax.Array, recipe: Recipe) -> jax.Array:
  """[..., K, N] rounded in weight_block blocks over (K, N) (float32 out; no custom gradient)."""
  return quantize_dequantize(w, recipe.weight_block, power_of_two=recipe.power_of_two_scales,
                             rule=_rule(recipe))


def ragged_dot(x: jax.Array, w: jax.Array, group_sizes: jax.Array, recipe: Recipe) -> jax.Array:
  """Grouped x [N, K] @ w [E, K, P] -> float32 [N, P] with both operands quantised for the
  product (x in 1 x act_block blocks, w in weight_block blocks) and a straight-through backward
  on the UNquantised operands: dx = dy @ w^T, dw = x^T @ dy (fp32 accumulation)."""
  return _ragged_dot(x, w, group_sizes, recipe)


def _product(a, b, group_sizes):
  return jax.lax.ragged_dot(a, b, group_sizes, precision=jax.lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32)


# group_sizes is an argument, not a closure: a custom_vjp must not close over tracers (jax 0.11.2
# raises UnexpectedTracerError for that under shard_map + grad on a GPU).
@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ragged_dot(x, w, group_sizes, recipe):
  return _product(quantize_activation(x, recipe), quantize_weight(w, recipe), group_sizes)


def _ragged_dot_fwd(x, w, group_sizes, recipe):
  return _ragged_dot(x, w, group_sizes, recipe), (x, w, group_sizes)


def _ragged_dot_bwd(recipe, res, dy):
  del recipe
  x, w, group_sizes = res
  _, vjp = jax.vjp(lambda a, b: _product(a.astype(jnp.float32), b.astype(jnp.float32),
                                         group_sizes), x, w)
  dx, dw = vjp(dy)
  return dx.astype(x.dtype), dw.astype(w.dtype), None


_ragged_dot.defvjp(_ragged_dot_fwd, _ragged_dot_bwd)

"""FP8 recipes and their pure-JAX emulation (quantise -> dequantise), the numerical oracle.

Recipes (DESIGN.md §5):
  None     matmuls in the inputs' dtype with fp32 accumulation.
  "fp8"    DeepSeek-V3 blockwise FP8 for Hopper: e4m3 values with fp32 scales; activations in
           1 x 128 blocks along the contraction (K) axis, weights in 128 x 128 blocks, the
           weight-gradient operands in 128 x 1 blocks (along the rows); scale =
           max(amax * fp32(1/448), FLT_MIN) per block.
  "fp8_pow2"  the same with each scale rounded up to a power of two (2^ceil(log2(amax / 448)),
           exact through frexp; never saturates), as DeepSeek-V3 does for its wgrad operands.
  "mxfp8"  OCP MXFP8 for Blackwell: e4m3 values in 1 x 32 blocks along K with E8M0
           (power-of-two) scales, for activations and weights alike (32 x 1 for the
           weight-gradient operands); the scale exponent is floored at -126 (a normal float).

The emulation rounds each GEMM operand to exactly the values the kernel multiplies (the CUDA
quantisation kernels match it bit for bit: same fp32 division, round-to-nearest-even, saturation
at +-448); products and sums then run in fp32. Gradients pass straight through the rounding
(straight-through estimator) and every backward GEMM runs in FP8 too, on operands quantised
for it (`ragged_dot` below is a GEMM with exactly these semantics, the CUDA kernels compute it):
  forward  y  = Q_act(x) Q_w(W)                 x in 1 x act_block along K, W in weight_block
  dgrad    dx = Q_act(dy) Q_w(W^T)              dy in 1 x act_block along P (dgrad's K); W^T
                                                in weight_block (for 128 x 128: the same values)
  wgrad    dW = Q_grad(x)^T Q_grad(dy)          x and dy in grad_block x 1 blocks along the
                                                rows (wgrad's K), each block inside one group
                                                (a group's blocks start at its first row)
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
  grad_block: int          # weight-gradient operands: grad_block x 1 along the rows


RECIPES = {
    "fp8": Recipe("fp8", 128, (128, 128), power_of_two_scales=False, grad_block=128),
    "fp8_pow2": Recipe("fp8_pow2", 128, (128, 128), power_of_two_scales=True, grad_block=128),
    "mxfp8": Recipe("mxfp8", 32, (32, 1), power_of_two_scales=True, grad_block=32),
}


# The name (jax.ad_checkpoint.checkpoint_name) of a layer's quantised expert weights: a
# jax.checkpoint policy that saves it keeps them from the first forward, so a rematerialised
# step quantises each weight once (backends.cuda_fp8; the models' remat "full" saves it).
QUANTIZED_WEIGHTS_NAME = "megamoe_fp8_weights"


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
    # Exactly, through frexp (amax = m 2^e, m in [0.5, 1): floor(log2 amax) = e - 1); exp2 and
    # log2 are approximations on some backends (XLA:CPU's exp2 is not exact on integers).
    # The exponent is floored at -126 so that the scale is a normal float (E8M0 reaches 2^-127,
    # but a denormal scale is flushed to 0 where denormals are, and 0 / 0 would be NaN for an
    # all-zero block); blocks that small (amax < 2^-118) round to zeros either way.
    _, expo = jnp.frexp(jnp.maximum(amax, tiny))
    return jnp.ldexp(jnp.ones_like(amax), jnp.maximum(expo - 1 - E4M3_EMAX, -126))
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


def quantize_grouped_rows(a: jax.Array, group_sizes: jax.Array, recipe: Recipe) -> jax.Array:
  """[N, C] rounded in grad_block x 1 blocks along N, per column, each block inside one group:
  group g's rows [o_g, o_g + n_g) form blocks [o_g + b * grad_block, ...) clipped to the group
  (the weight-gradient operands, whose contraction runs over each group's rows). Rows past
  sum(group_sizes) are returned unrounded (no GEMM reads them). float32 out."""
  n = a.shape[0]
  e = group_sizes.shape[0]
  blk = recipe.grad_block
  sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  ends = jnp.cumsum(sizes)
  starts = ends - sizes
  row = jnp.arange(n, dtype=jnp.int32)
  group = jnp.searchsorted(ends, row, side="right").astype(jnp.int32)  # e for padding rows
  in_group = group < e
  g = jnp.minimum(group, e - 1)
  blocks = (sizes + blk - 1) // blk
  first_block = jnp.cumsum(blocks) - blocks
  num_segments = n // blk + e + 1  # sum of ceil(n_g / blk) <= n / blk + e; the last: padding
  segment = jnp.where(in_group, first_block[g] + (row - starts[g]) // blk, num_segments - 1)
  a32 = a.astype(jnp.float32)
  amax = jax.ops.segment_max(jnp.abs(a32), segment, num_segments=num_segments)
  scale = _block_scale(jnp.maximum(amax, 0.0), recipe.power_of_two_scales, _rule(recipe))
  scale = scale[segment]
  q = jnp.clip(a32 / scale, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
  q = jax.lax.optimization_barrier(q)  # see quantize_dequantize
  return jnp.where(in_group[:, None], q.astype(jnp.float32) * scale, a32)


def dequantize_weight_blocks(q: jax.Array, scale: jax.Array) -> jax.Array:
  """The values of weights quantised in 128 x 128 blocks, in the kernels' layout (the B operand
  of rows @ w: q [E, P, K] e4m3, K-major; scale [E, K / 128, P / 128] float32), as w [E, K, P]
  float32: Q_w(w) of recipes "fp8" / "fp8_pow2" for the w they were quantised from."""
  e, p, k = q.shape
  kb, pb = scale.shape[1], scale.shape[2]
  values = q.astype(jnp.float32).reshape(e, pb, p // pb, kb, k // kb)
  values = values * jnp.transpose(scale, (0, 2, 1))[:, :, None, :, None]
  return jnp.swapaxes(values.reshape(e, p, k), 1, 2)


def ragged_dot(x: jax.Array, w: jax.Array, group_sizes: jax.Array, recipe: Recipe,
               w_rounded: jax.Array | None = None) -> jax.Array:
  """Grouped x [N, K] @ w [E, K, P] -> float32 [N, P], every GEMM in FP8 (module docstring):
  forward Q_act(x) Q_w(w); backward dx = Q_act(dy) Q_w(w^T), dw = Q_grad(x)^T Q_grad(dy) per
  group, fp32 accumulation; the gradients pass straight through the rounding.

  w_rounded: Q_w(w) when the caller has it (weights quantised once for several calls,
  dequantize_weight_blocks); 128 x 128 blocks only, whose Q_w(w^T) is Q_w(w)^T. w then only
  takes the gradient."""
  if w_rounded is None:
    return _ragged_dot(x, w, group_sizes, recipe)
  if recipe.weight_block != (128, 128):
    raise ValueError(f"w_rounded needs 128 x 128 weight blocks, recipe {recipe.name!r} has "
                     f"{recipe.weight_block}")
  return _ragged_dot_rounded(x, w, w_rounded, group_sizes, recipe)


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
  x, w, group_sizes = res
  w_t = quantize_weight(jnp.swapaxes(w, 1, 2), recipe)  # [E, P, K]: dgrad's (K, N) blocks
  dx = _product(quantize_activation(dy, recipe), w_t, group_sizes)
  return dx.astype(x.dtype), _wgrad(x, dy, w, group_sizes, recipe), None


_ragged_dot.defvjp(_ragged_dot_fwd, _ragged_dot_bwd)


def _wgrad(x, dy, w, group_sizes, recipe):
  """dw = Q_grad(x)^T Q_grad(dy) per group, in w's dtype."""
  x_g = quantize_grouped_rows(x, group_sizes, recipe)
  dy_g = quantize_grouped_rows(dy, group_sizes, recipe)
  _, wgrad = jax.vjp(lambda b: _product(x_g, b, group_sizes), w.astype(jnp.float32))
  (dw,) = wgrad(dy_g)
  return dw.astype(w.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ragged_dot_rounded(x, w, w_rounded, group_sizes, recipe):
  """_ragged_dot with Q_w(w) given: w takes the gradient, w_rounded none."""
  del w
  return _product(quantize_activation(x, recipe), w_rounded, group_sizes)


def _ragged_dot_rounded_fwd(x, w, w_rounded, group_sizes, recipe):
  y = _ragged_dot_rounded(x, w, w_rounded, group_sizes, recipe)
  return y, (x, w, w_rounded, group_sizes)


def _ragged_dot_rounded_bwd(recipe, res, dy):
  x, w, w_rounded, group_sizes = res
  dx = _product(quantize_activation(dy, recipe), jnp.swapaxes(w_rounded, 1, 2), group_sizes)
  return (dx.astype(x.dtype), _wgrad(x, dy, w, group_sizes, recipe),
          jnp.zeros_like(w_rounded), None)


_ragged_dot_rounded.defvjp(_ragged_dot_rounded_fwd, _ragged_dot_rounded_bwd)

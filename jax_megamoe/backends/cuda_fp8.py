"""Recipe "fp8" / "fp8_pow2" on the CUDA kernels: blockwise-FP8 quantisers, the grouped GEMMs on
quantised operands, and the expert MLP built from them, forward and backward
(jax_megamoe.fp8 defines the numerics: every GEMM in FP8, gradients straight through).

Quantising is separate from the GEMMs so that each operand is quantised once where it is
produced: token rows before they are dispatched (they travel in FP8, backends.cuda_ep), weights
once per forward (the backward reads the same blocks transposed), the SwiGLU output (and its
gradient) fused with the SwiGLU kernels.

Weights under rematerialisation: the layer quantises them outside its custom VJPs and names the
blocks (jax_megamoe.fp8.QUANTIZED_WEIGHTS_NAME, quantize_expert_weights), so a jax.checkpoint
policy that saves that name (the models' remat "full" does) keeps them from the first forward:
the recomputed forward and the backward reuse them, and a rematerialised step quantises each
weight once, not twice.

  quantize_rows(x)            x [N, K] bf16 -> QuantizedRows(q [N, K] e4m3, scale [N, K/128] f32)
  quantize_weights(w)         w [E, K, P] bf16 -> QuantizedWeights(q [E, P, K] e4m3 (transposed,
                              K-major as FP8 wgmma needs), scale [E, K/128, P/128] f32): the
                              operand of x @ w; with dgrad=True the operand of dy @ w^T
                              (q [E, K, P] as w, scale [E, P/128, K/128]), same block values
  dgrad_operand(blocks)       the dgrad operand from the forward's blocks: a transpose, not a
                              second quantisation (square 128x128 blocks, one scale each)
  quantize_wgrad_operand(x, group_sizes) -> WgradOperand: rows in 128 x 1 blocks inside each
                              group, stored transposed and group-padded (the K-grouped wgrad's
                              K-major operand); with_rows: also x's 1x128 rows, same read;
                              source=: x's rows gathered by index; x a QuantizedRows: its rows
                              dequantised; neither stored in bf16
  swiglu_quantize(gate_up, group_sizes) -> (h bf16, h as QuantizedRows): the SwiGLU fused with
                              the quantisation of its output, over the rows in use only
  swiglu_wgrad_operand(gate_up, group_sizes) -> h's WgradOperand, h never stored
  swiglu_backward_quantize(dh, gate_up, group_sizes) -> dgate_up as (QuantizedRows,
                              WgradOperand), never stored in bf16
  grouped_gemm_quantized(a, group_sizes, b) -> [N, P] bf16; rows of group g times b[g], fp32
                              accumulation promoted every 128 of K, rows past sum(group_sizes) 0;
                              a.q may have a row stride (dispatched rows are read in place)
  grouped_wgrad_quantized(a, group_sizes, b) -> [E, Ca, Cb] bf16: a_g^T b_g over group g's rows
                              (two WgradOperands), fp32 promoted per 128 rows; empty groups 0
  grouped_mlp_from_blocks(x_sorted, group_sizes, w_gate_up, w_down, blocks) the FP8 MLP on weight
                              blocks quantised by the caller (no second quantisation)
Every op also has a CPU handler with the same contract (plain loops, ffi/handlers/fp8_cpu.cc):
on a CPU the whole module runs, slowly, and CI checks it against jax_megamoe.fp8.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax.ad_checkpoint import checkpoint_name

from jax_megamoe import _ffi, fp8, varying

GEMM_TARGET = "megamoe_grouped_gemm_fp8"
QUANTIZE_ROWS_TARGET = "megamoe_fp8_quantize_rows"
QUANTIZE_WEIGHTS_TARGET = "megamoe_fp8_quantize_weights"
SWIGLU_QUANTIZE_TARGET = "megamoe_fp8_swiglu_quantize"
SWIGLU_BACKWARD_QUANTIZE_TARGET = "megamoe_fp8_swiglu_backward_quantize"
QUANTIZE_WGRAD_OPERAND_TARGET = "megamoe_fp8_quantize_wgrad_operand"
WGRAD_TARGET = "megamoe_grouped_wgrad_fp8"
TARGETS = (GEMM_TARGET, QUANTIZE_ROWS_TARGET, QUANTIZE_WEIGHTS_TARGET, SWIGLU_QUANTIZE_TARGET,
           SWIGLU_BACKWARD_QUANTIZE_TARGET, QUANTIZE_WGRAD_OPERAND_TARGET, WGRAD_TARGET)
BLOCK = 128
RECIPES = ("fp8", "fp8_pow2")  # the recipes these kernels implement (pow2: "fp8_pow2")


class QuantizedRows(NamedTuple):
  """q [N, L] float8_e4m3fn, L >= K: row r's K values are its first K bytes (L > K when the rows
  carry more, e.g. their scales as dispatched); scale [N, K / 128] float32."""
  q: jax.Array
  scale: jax.Array

  @property
  def k(self) -> int:
    return self.scale.shape[1] * BLOCK


class QuantizedWeights(NamedTuple):
  """The B operand of rows [N, K] @ B[g] [K, P]: q [E, P, K] float8_e4m3fn (K-major),
  scale [E, K / 128, P / 128] float32."""
  q: jax.Array
  scale: jax.Array


def padded_length(rows: int, num_groups: int) -> int:
  """Columns of a WgradOperand: every group padded to a multiple of 128 rows fits in it."""
  return -(-rows // BLOCK) * BLOCK + BLOCK * num_groups


class WgradOperand(NamedTuple):
  """Rows x [N, C] quantised in 128 x 1 blocks along N, each block inside one group, stored
  transposed and group-padded: q [C, L] float8_e4m3fn (L = padded_length(N, E)); group g's rows
  [o_g, o_g + n_g) are columns [p_g, p_g + n_g) with p_g = sum over g' < g of
  round_up(n_g', 128), zero up to p_g + round_up(n_g, 128), columns past p_E unspecified;
  scale [L / 128, C] float32: scale[p_g / 128 + b, c] is that of rows o_g + 128 b ... (up to
  128, clipped to the group) of column c."""
  q: jax.Array
  scale: jax.Array


def _require_group_sizes(group_sizes: jax.Array):
  if group_sizes.ndim != 1 or group_sizes.dtype != jnp.int32 or group_sizes.shape[0] < 1:
    raise ValueError(f"group_sizes must be [E] int32 with E >= 1, got "
                     f"{group_sizes.dtype}{list(group_sizes.shape)}")


def _require_bf16(name: str, a: jax.Array, ndim: int, blocked_axes: tuple[int, ...]):
  if a.ndim != ndim or a.dtype != jnp.bfloat16:
    raise ValueError(f"{name} must be a {ndim}-D bfloat16 array, got {a.dtype}{list(a.shape)}")
  for axis in blocked_axes:
    if a.shape[axis] % BLOCK:
      raise ValueError(f"{name} axis {axis} must be a multiple of {BLOCK} for FP8, got shape "
                       f"{a.shape}")


def quantize_rows(x: jax.Array, *, pow2: bool = False) -> QuantizedRows:
  """x [N, K] bf16 in 1x128 blocks along K (activations)."""
  _require_bf16("x", x, 2, (1,))
  n, k = x.shape
  out = (jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn),
         jax.ShapeDtypeStruct((n, k // BLOCK), jnp.float32))
  rows = QuantizedRows(*jax.ffi.ffi_call(QUANTIZE_ROWS_TARGET, out)(x, pow2=np.int64(pow2)))
  return varying.match_varying_each(rows, x)


def quantize_weights(w: jax.Array, *, pow2: bool = False, dgrad: bool = False
                     ) -> QuantizedWeights:
  """w [E, K, P] bf16 in 128x128 blocks: the operand of rows @ w (q transposed to [E, P, K]);
  dgrad=True: of rows @ w^T (q [E, K, P] as w is, scale [E, P/128, K/128])."""
  _require_bf16("w", w, 3, (1, 2))
  e, k, p = w.shape
  if dgrad:
    k, p = p, k
  out = (jax.ShapeDtypeStruct((e, p, k), jnp.float8_e4m3fn),
         jax.ShapeDtypeStruct((e, k // BLOCK, p // BLOCK), jnp.float32))
  call = jax.ffi.ffi_call(QUANTIZE_WEIGHTS_TARGET, out)
  blocks = QuantizedWeights(*call(w, pow2=np.int64(pow2), dgrad=np.int64(dgrad)))
  return varying.match_varying_each(blocks, w)


def dgrad_operand(blocks: QuantizedWeights) -> QuantizedWeights:
  """quantize_weights(w, dgrad=True) from quantize_weights(w): the same 128x128 blocks (each
  block's scale is its own amax's, whichever way it is read), transposed; bit for bit the same,
  for a byte transpose instead of reading w again."""
  return QuantizedWeights(jnp.swapaxes(blocks.q, 1, 2), jnp.swapaxes(blocks.scale, 1, 2))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["w_gate_up", "w_down"],
                   meta_fields=["pow2"])
@dataclasses.dataclass(frozen=True)
class ExpertWeightBlocks:
  """Both expert weights of a layer in 128x128 blocks (quantize_weights), as the forward's GEMMs
  read them. pow2 (static): the scales are recipe "fp8_pow2"'s (powers of two), else "fp8"'s.
  Public as jax_megamoe.ExpertWeightBlocks (jax_megamoe/weight_blocks.py)."""
  w_gate_up: QuantizedWeights
  w_down: QuantizedWeights
  pow2: bool = False


def quantize_expert_weights(w_gate_up, w_down, *, pow2: bool = False) -> ExpertWeightBlocks:
  """The layer's weight blocks, named fp8.QUANTIZED_WEIGHTS_NAME for remat policies (see the
  module doc). Not differentiated: the MLP's VJP gives the weights' gradients (stop_gradient
  here, so the blocks carry none)."""
  blocks = ExpertWeightBlocks(
      quantize_weights(jax.lax.stop_gradient(w_gate_up), pow2=pow2),
      quantize_weights(jax.lax.stop_gradient(w_down), pow2=pow2), bool(pow2))
  return jax.tree.map(_named, blocks)


def _named(a: jax.Array) -> jax.Array:
  """a named fp8.QUANTIZED_WEIGHTS_NAME. e4m3 values go through as their bytes: remat wraps a
  saved float residual in reduce_precision to its own format, which for float8_e4m3fn (no
  infinities; 448 at the top exponent) turns every value >= 256 into NaN (measured: JAX 0.10.2,
  XLA:CPU)."""
  if a.dtype != jnp.float8_e4m3fn:
    return checkpoint_name(a, fp8.QUANTIZED_WEIGHTS_NAME)
  named = checkpoint_name(jax.lax.bitcast_convert_type(a, jnp.uint8), fp8.QUANTIZED_WEIGHTS_NAME)
  return jax.lax.bitcast_convert_type(named, a.dtype)


def zero_cotangent(blocks: ExpertWeightBlocks) -> ExpertWeightBlocks:
  """The blocks' cotangent in a VJP (they are not differentiated: quantize_expert_weights)."""
  return jax.tree.map(jnp.zeros_like, blocks)


class MlpResiduals(NamedTuple):
  """What the FP8 MLP's backward needs from its forward: the bf16 gate_up [N, 2F] and hidden
  [N, F] (or hidden's WgradOperand, all the backward reads of it: swiglu_wgrad_operand), and
  the weights as the forward quantised them (its dgrad GEMMs read them transposed:
  dgrad_operand), so the backward neither holds the bf16 weights nor quantises them again."""
  gate_up: jax.Array
  hidden: jax.Array
  blocks: ExpertWeightBlocks


def quantize_wgrad_operand(x, group_sizes: jax.Array, *, pow2: bool = False,
                           with_rows: bool = False, source: jax.Array | None = None):
  """x [N, C] bf16 (rows grouped as group_sizes) -> WgradOperand (128 x 1 blocks in groups);
  with_rows: (QuantizedRows of x (1x128, as quantize_rows; rows past the sum unspecified),
  WgradOperand), both from one read of x. The rows may be read where they are, never stored in
  bf16 (the same bytes as of the rows stored):
  - source [N] int32: x's rows gathered, x [T, C], row r = x[source[r]] (zeros where
    source[r] < 0; every entry < T);
  - x a QuantizedRows [N, C] (q may have a row stride, e.g. rows as dispatched): its rows
    dequantised, as dequantize_rows(x)."""
  _require_group_sizes(group_sizes)
  if isinstance(x, QuantizedRows):
    if source is not None:
      raise ValueError("source gathers bf16 rows; x is a QuantizedRows")
    return _wgrad_operand_call(x.q, group_sizes, x.q.shape[0], x.k, x_scale=x.scale, pow2=pow2,
                               with_rows=with_rows)
  _require_bf16("x", x, 2, (1,))
  if source is not None and (source.ndim != 1 or source.dtype != jnp.int32):
    raise ValueError(f"source must be [N] int32, got {source.shape} {source.dtype}")
  n = x.shape[0] if source is None else source.shape[0]
  return _wgrad_operand_call(x, group_sizes, n, x.shape[1], source=source, pow2=pow2,
                             with_rows=with_rows)


def swiglu_wgrad_operand(gate_up: jax.Array, group_sizes: jax.Array, *, pow2: bool = False):
  """gate_up [N, 2F] bf16 -> the WgradOperand of h = bf16(silu(gate) * up) (swiglu_quantize's
  h, the same bytes as quantize_wgrad_operand(h)), from one read of gate_up: h is never stored
  (dW_down's operand where the forward kept gate_up but not h)."""
  _require_bf16("gate_up", gate_up, 2, ())
  _require_group_sizes(group_sizes)
  n, f2 = gate_up.shape
  if f2 % (2 * BLOCK):
    raise ValueError(f"gate_up must be [N, 2F] with F a multiple of {BLOCK}, got {gate_up.shape}")
  return _wgrad_operand_call(gate_up, group_sizes, n, f2 // 2, pow2=pow2, with_rows=False,
                             swiglu=True)


def _wgrad_operand_call(x, group_sizes, n: int, c: int, *, x_scale=None, source=None,
                        pow2: bool, with_rows: bool, swiglu: bool = False):
  """The quantize_wgrad_operand custom call (ffi/handlers/fp8_ops.h) of an operand of N rows of
  C columns; x_scale (e4m3 x) and source (rows gathered) are empty where not given."""
  e = group_sizes.shape[0]
  operands = (x, jnp.zeros((0,), jnp.float32) if x_scale is None else x_scale,
              jnp.zeros((0,), jnp.int32) if source is None else source, group_sizes)
  length = padded_length(n, e)
  rows = n if with_rows else 0
  out = (jax.ShapeDtypeStruct((c, length), jnp.float8_e4m3fn),
         jax.ShapeDtypeStruct((length // BLOCK, c), jnp.float32),
         jax.ShapeDtypeStruct((rows, c), jnp.float8_e4m3fn),
         jax.ShapeDtypeStruct((rows, c // BLOCK), jnp.float32),
         jax.ShapeDtypeStruct((8 * (e + 1),), jnp.uint8))
  q, scale, q_rows, scale_rows, _ = jax.ffi.ffi_call(QUANTIZE_WGRAD_OPERAND_TARGET, out)(
      *operands, pow2=np.int64(pow2), rows=np.int64(with_rows), swiglu=np.int64(swiglu))
  operand = varying.match_varying_each(WgradOperand(q, scale), *operands)
  if not with_rows:
    return operand
  return varying.match_varying_each(QuantizedRows(q_rows, scale_rows), *operands), operand


def grouped_wgrad_quantized(a: WgradOperand, group_sizes: jax.Array, b: WgradOperand
                            ) -> jax.Array:
  """[E, Ca, Cb] bf16: for each group g, a_g^T b_g over its rows (the K-grouped weight gradient,
  fp32 accumulation promoted every 128 rows); a group with no rows gets zeros."""
  _require_group_sizes(group_sizes)
  e = group_sizes.shape[0]
  ca, cb = a.q.shape[0], b.q.shape[0]
  out = (jax.ShapeDtypeStruct((e, ca, cb), jnp.bfloat16),
         jax.ShapeDtypeStruct((_ffi.gemm_scratch_bytes(e),), jnp.uint8))
  d, _ = jax.ffi.ffi_call(WGRAD_TARGET, out)(a.q, a.scale, group_sizes, b.q, b.scale)
  return varying.match_varying_each((d,), *a, group_sizes, *b)[0]


def dequantize_rows(rows: QuantizedRows, dtype=jnp.bfloat16) -> jax.Array:
  """q * scale per 1x128 block, in `dtype` (pure JAX)."""
  scale = jnp.repeat(rows.scale, BLOCK, axis=1)
  return (rows.q[:, :rows.k].astype(jnp.float32) * scale).astype(dtype)


def grouped_gemm_quantized(a: QuantizedRows, group_sizes: jax.Array,
                           b: QuantizedWeights) -> jax.Array:
  """[N, P] bf16 = rows of group g of a times b[g] (dequantised on the fly)."""
  n = a.q.shape[0]
  e, p, _ = b.q.shape
  out = (jax.ShapeDtypeStruct((n, p), jnp.bfloat16),
         jax.ShapeDtypeStruct((_ffi.gemm_scratch_bytes(e),), jnp.uint8))
  d, _ = jax.ffi.ffi_call(GEMM_TARGET, out)(a.q, a.scale, group_sizes, b.q, b.scale)
  return varying.match_varying_each((d,), *a, group_sizes, *b)[0]


def grouped_gemm_fp8(a: jax.Array, group_sizes: jax.Array, b: jax.Array, *, pow2: bool = False,
                     return_quantized: bool = False):
  """Quantise a [N, K] bf16 (1x128) and b [E, K, P] bf16 (128x128), then the grouped GEMM ->
  [N, P] bf16. With return_quantized, also (a_q, a_scale, b_q, b_scale) as in QuantizedRows and
  QuantizedWeights."""
  a_rows = quantize_rows(a, pow2=pow2)
  b_blocks = quantize_weights(b, pow2=pow2)
  d = grouped_gemm_quantized(a_rows, group_sizes, b_blocks)
  return (d, (*a_rows, *b_blocks)) if return_quantized else d


def swiglu_quantize(gate_up: jax.Array, group_sizes: jax.Array, *, pow2: bool = False
                    ) -> tuple[jax.Array, QuantizedRows]:
  """gate_up [N, 2F] bf16 -> (h [N, F] bf16 = silu(gate) * up, zero past sum(group_sizes);
  h quantised in 1x128 blocks, rows past the sum unspecified): one pass over the rows in use."""
  _require_bf16("gate_up", gate_up, 2, ())
  n, f2 = gate_up.shape
  if f2 % (2 * BLOCK):
    raise ValueError(f"gate_up must be [N, 2F] with F a multiple of {BLOCK}, got {gate_up.shape}")
  f = f2 // 2
  out = (jax.ShapeDtypeStruct((n, f), jnp.bfloat16),
         jax.ShapeDtypeStruct((n, f), jnp.float8_e4m3fn),
         jax.ShapeDtypeStruct((n, f // BLOCK), jnp.float32),
         jax.ShapeDtypeStruct((4 * (group_sizes.shape[0] + 1),), jnp.uint8))
  h, q, scale, _ = jax.ffi.ffi_call(SWIGLU_QUANTIZE_TARGET, out)(gate_up, group_sizes,
                                                                 pow2=np.int64(pow2))
  h, q, scale = varying.match_varying_each((h, q, scale), gate_up, group_sizes)
  return h, QuantizedRows(q, scale)


def swiglu_backward_quantize(dh: jax.Array, gate_up: jax.Array, group_sizes: jax.Array, *,
                             pow2: bool = False) -> tuple[QuantizedRows, WgradOperand]:
  """dh [N, F], gate_up [N, 2F] bf16 -> dgate_up [N, 2F] (the SwiGLU backward in fp32, rounded
  to bf16, never stored) quantised in 1x128 blocks (the dx GEMM's rows; rows past
  sum(group_sizes) unspecified) and as a WgradOperand (dW_gate_up's), in one pass."""
  _require_bf16("dh", dh, 2, (1,))
  _require_bf16("gate_up", gate_up, 2, ())
  _require_group_sizes(group_sizes)
  n, f = dh.shape
  if gate_up.shape != (n, 2 * f):
    raise ValueError(f"gate_up must be [N={n}, 2F={2 * f}], got {gate_up.shape}")
  e = group_sizes.shape[0]
  length = padded_length(n, e)
  out = (jax.ShapeDtypeStruct((n, 2 * f), jnp.float8_e4m3fn),
         jax.ShapeDtypeStruct((n, 2 * f // BLOCK), jnp.float32),
         jax.ShapeDtypeStruct((2 * f, length), jnp.float8_e4m3fn),
         jax.ShapeDtypeStruct((length // BLOCK, 2 * f), jnp.float32),
         jax.ShapeDtypeStruct((8 * (e + 1),), jnp.uint8))
  q_rows, scale_rows, q, scale, _ = jax.ffi.ffi_call(SWIGLU_BACKWARD_QUANTIZE_TARGET, out)(
      dh, gate_up, group_sizes, pow2=np.int64(pow2))
  like = (dh, gate_up, group_sizes)
  return (varying.match_varying_each(QuantizedRows(q_rows, scale_rows), *like),
          varying.match_varying_each(WgradOperand(q, scale), *like))


def mlp_forward(x_rows: QuantizedRows, group_sizes, blocks: ExpertWeightBlocks, pow2: bool
                ) -> tuple[jax.Array, MlpResiduals]:
  """FP8 forward of the SwiGLU MLP from quantised rows and weight blocks
  (quantize_expert_weights): (y bf16, MlpResiduals); the backward reuses the blocks."""
  gate_up = grouped_gemm_quantized(x_rows, group_sizes, blocks.w_gate_up)
  hidden, hidden_rows = swiglu_quantize(gate_up, group_sizes, pow2=pow2)
  y = grouped_gemm_quantized(hidden_rows, group_sizes, blocks.w_down)
  return y, MlpResiduals(gate_up, hidden, blocks)


def mlp_backward(dy, x, group_sizes, res: MlpResiduals, pow2: bool):
  """FP8 backward of the SwiGLU MLP (fp8.ragged_dot's definition) from the forward's residuals:
  (dx [N, H], dw_gate_up [E, H, 2F], dw_down [E, F, H]), all bf16. Each activation operand is
  quantised once, both ways where it feeds a dgrad and a wgrad GEMM (dy, dgate_up); the weights
  are the forward's blocks, transposed. x: the forward's bf16 rows [N, H], their FP8 rows
  (QuantizedRows: dW_gate_up from the rows dequantised, as they reached an expert rank), or
  their WgradOperand (all the backward reads of them)."""
  wgrad_operand = functools.partial(quantize_wgrad_operand, group_sizes=group_sizes, pow2=pow2)
  as_operand = lambda a: a if isinstance(a, WgradOperand) else wgrad_operand(a)
  dy_rows, dy_op = wgrad_operand(dy.astype(jnp.bfloat16), with_rows=True)
  dh = grouped_gemm_quantized(dy_rows, group_sizes, dgrad_operand(res.blocks.w_down))
  dgate_up_rows, dgate_up_op = swiglu_backward_quantize(dh, res.gate_up, group_sizes, pow2=pow2)
  dx = grouped_gemm_quantized(dgate_up_rows, group_sizes, dgrad_operand(res.blocks.w_gate_up))
  dw_down = grouped_wgrad_quantized(as_operand(res.hidden), group_sizes, dy_op)
  dw_gate_up = grouped_wgrad_quantized(as_operand(x), group_sizes, dgate_up_op)
  return dx, dw_gate_up, dw_down


def grouped_mlp(x_sorted, group_sizes, w_gate_up, w_down, pow2: bool = False):
  """The expert MLP, recipe "fp8" (pow2: "fp8_pow2"): every GEMM in FP8, forward and backward.
  The weights are quantised here, outside its VJP (quantize_expert_weights)."""
  x_sorted, group_sizes, w_gate_up, w_down = varying.align_varying(x_sorted, group_sizes,
                                                                  w_gate_up, w_down)
  blocks = quantize_expert_weights(w_gate_up, w_down, pow2=bool(pow2))
  return _grouped_mlp(x_sorted, group_sizes, w_gate_up, w_down, blocks, bool(pow2))


def grouped_mlp_from_blocks(x_sorted, group_sizes, w_gate_up, w_down, blocks: ExpertWeightBlocks,
                            pow2: bool = False):
  """grouped_mlp with the weights already quantised (quantize_expert_weights of w_gate_up and
  w_down, e.g. by a layer that quantised them once for another kernel: backends.fused);
  w_gate_up / w_down only take the gradients."""
  x_sorted, group_sizes, w_gate_up, w_down = varying.align_varying(x_sorted, group_sizes,
                                                                  w_gate_up, w_down)
  return _grouped_mlp(x_sorted, group_sizes, w_gate_up, w_down, blocks, bool(pow2))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _grouped_mlp(x_sorted, group_sizes, w_gate_up, w_down, blocks, pow2):
  """w_gate_up / w_down take the weights' gradients; the GEMMs read `blocks`."""
  return _grouped_mlp_fwd(x_sorted, group_sizes, w_gate_up, w_down, blocks, pow2)[0]


def _grouped_mlp_fwd(x_sorted, group_sizes, w_gate_up, w_down, blocks, pow2):
  del w_gate_up, w_down  # their values are in blocks
  y, res = mlp_forward(quantize_rows(x_sorted, pow2=pow2), group_sizes, blocks, pow2)
  return y, (x_sorted, group_sizes, res)


def _grouped_mlp_bwd(pow2, res, dy):
  x, group_sizes, mlp_res = res
  dx, dw_gate_up, dw_down = mlp_backward(dy, x, group_sizes, mlp_res, pow2)
  return dx, None, dw_gate_up, dw_down, zero_cotangent(mlp_res.blocks)


_grouped_mlp.defvjp(_grouped_mlp_fwd, _grouped_mlp_bwd)


@dataclasses.dataclass(frozen=True)
class RowsMlp:
  """The FP8 expert MLP as a parallel.GroupedMlp (bf16 rows in, quantised here) that can also
  start from rows quantised elsewhere: the NVLink exchange (backends.cuda_ep) then moves the
  rows in FP8, quantised once on the sender."""
  pow2: bool = False

  def __call__(self, x_sorted, group_sizes, w_gate_up, w_down, blocks=None):
    """blocks: the weights already quantised (quantize_expert_weights), or None."""
    if blocks is None:
      return grouped_mlp(x_sorted, group_sizes, w_gate_up, w_down, self.pow2)
    return grouped_mlp_from_blocks(x_sorted, group_sizes, w_gate_up, w_down, blocks, self.pow2)

  def quantize_weights(self, w_gate_up, w_down) -> ExpertWeightBlocks:
    return quantize_expert_weights(w_gate_up, w_down, pow2=self.pow2)

  def forward(self, x_rows: QuantizedRows, group_sizes, blocks: ExpertWeightBlocks
              ) -> tuple[jax.Array, MlpResiduals]:
    return mlp_forward(x_rows, group_sizes, blocks, self.pow2)

  def backward(self, dy, x_sorted, group_sizes, res: MlpResiduals):
    return mlp_backward(dy, x_sorted, group_sizes, res, self.pow2)


# --- FP8 rows as the bytes of a bf16 row (what the EP dispatch kernels move) -------------------


def packed_width(hidden: int) -> int:
  """bf16 elements of one packed row: hidden e4m3 bytes + hidden/128 fp32 scales, padded to 16
  bytes (the transfer granule)."""
  row_bytes = hidden + hidden // BLOCK * 4
  return (row_bytes + 15) // 16 * 16 // 2


def pack_rows(rows: QuantizedRows) -> jax.Array:
  """QuantizedRows [T, H] -> bf16 [T, packed_width(H)] carrying their bytes (q, then scales)."""
  t, h = rows.q.shape
  q = jax.lax.bitcast_convert_type(rows.q, jnp.uint8)
  s = jax.lax.bitcast_convert_type(rows.scale, jnp.uint8).reshape(t, h // BLOCK * 4)
  width = packed_width(h)
  raw = jnp.concatenate([q, s], axis=1)
  raw = jnp.pad(raw, ((0, 0), (0, 2 * width - raw.shape[1])))
  return jax.lax.bitcast_convert_type(raw.reshape(t, width, 2), jnp.bfloat16)


def unpack_rows(packed: jax.Array, hidden: int) -> QuantizedRows:
  """Inverse of pack_rows, bit for bit. q is the packed rows themselves viewed as e4m3
  ([N, 2 * packed_width], the values first): the GEMM reads them in place; only the scales are
  copied out."""
  n = packed.shape[0]
  raw = jax.lax.bitcast_convert_type(packed, jnp.uint8).reshape(n, -1)
  q = jax.lax.bitcast_convert_type(raw, jnp.float8_e4m3fn)
  s = raw[:, hidden:hidden + hidden // BLOCK * 4].reshape(n, hidden // BLOCK, 4)
  return QuantizedRows(q, jax.lax.bitcast_convert_type(s, jnp.float32))

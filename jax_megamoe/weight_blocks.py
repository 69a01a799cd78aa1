"""Expert weights quantised once and read by many layer calls (recipes "fp8" / "fp8_pow2").

Every FP8 layer call quantises its expert weights into 128 x 128 blocks before its GEMMs (0.57 ms
per call at the 30B shape on an H200, 2.4 ms at 235B: a read of every weight). Within a training
step the weights do not change, so one quantisation can serve every call that reads them:

  blocks = jax_megamoe.quantize_expert_weights(w_gate_up, w_down, recipe="fp8", mesh=mesh)
  def micro_step(carry, batch):                  # e.g. the body of a rolled lax.scan over the
    y = jax_megamoe.moe(x, ids, w, w_gate_up, w_down, recipe="fp8", mesh=mesh,
                        weight_blocks=blocks)    # micro-batches of a gradient accumulation
    ...

`moe` then reads the blocks instead of quantising; gradients still reach w_gate_up and w_down
(straight through, as without blocks: no FP8 weight gradient reads the weights' values). The
result is bit for bit the same as without `weight_blocks`. The contract: `blocks` must be
quantize_expert_weights of the w_gate_up and w_down passed with them, for the same recipe
(checked: shapes, dtypes and recipe; not checked: that the values come from these weights).

Where this is not needed: a jit without a loop around the layer quantises each weight once per
step already (also under remat, and across micro-batches of an unrolled loop; README "Recipes").
A rolled lax.scan on XLA:GPU quantises inside every iteration; this is the way out.
"""

from __future__ import annotations

from jax.sharding import Mesh

from jax_megamoe import parallel
from jax_megamoe.backends import cuda_fp8
from jax_megamoe.backends.cuda_fp8 import ExpertWeightBlocks
from jax_megamoe.validation import LayerShape

FP8_RECIPES = cuda_fp8.RECIPES
__all__ = ["ExpertWeightBlocks", "check_weight_blocks", "quantize_expert_weights"]


def _check_weights(w_gate_up, w_down, recipe) -> None:
  if recipe not in FP8_RECIPES:
    raise ValueError(f"weight blocks exist for recipes {FP8_RECIPES}, got recipe {recipe!r}")
  # Here, before any shard_map, and with the arguments' names (the quantiser checks "w").
  for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
    cuda_fp8._require_bf16(name, w, 3, (1, 2))  # noqa: SLF001 (the FP8 operands' one check)


def quantize_expert_weights(w_gate_up, w_down, recipe: str = "fp8", *, mesh: Mesh | None = None,
                            expert_axis: str = "expert") -> ExpertWeightBlocks:
  """The expert weights in 128 x 128 blocks (e4m3 + fp32 scales), as every backend's FP8 layer
  quantises them, for `moe(..., weight_blocks=)`.

  w_gate_up [E, H, 2F] and w_down [E, F, H] bfloat16, H and F multiples of 128; recipe "fp8" or
  "fp8_pow2"; mesh / expert_axis: as for moe (each device quantises its own experts; without a
  mesh the whole arrays on one device). Runs on the extension's kernels (its CPU handlers on a
  CPU). The blocks are not differentiated (moe gives the weights their gradients)."""
  _check_weights(w_gate_up, w_down, recipe)
  pow2 = recipe == "fp8_pow2"

  def quantize(a, b):
    return cuda_fp8.quantize_expert_weights(a, b, pow2=pow2)

  if mesh is None:
    return quantize(w_gate_up, w_down)
  if expert_axis not in mesh.axis_names:
    raise ValueError(f"expert_axis {expert_axis!r} is not an axis of the mesh "
                     f"{tuple(mesh.axis_names)}")
  return parallel.shard_over_experts(quantize, mesh, expert_axis, (w_gate_up, w_down))


def check_weight_blocks(blocks, shape: LayerShape, recipe: str | None) -> None:
  """Validates moe's `weight_blocks` against the layer (ValueError naming what is wrong)."""
  if not isinstance(blocks, ExpertWeightBlocks):
    raise ValueError(f"weight_blocks must be what jax_megamoe.quantize_expert_weights returns, "
                     f"got {type(blocks).__name__}")
  if recipe not in FP8_RECIPES:
    raise ValueError(f"weight_blocks needs recipe 'fp8' or 'fp8_pow2', got recipe {recipe!r}")
  if blocks.pow2 != (recipe == "fp8_pow2"):
    made = "fp8_pow2" if blocks.pow2 else "fp8"
    raise ValueError(f"weight_blocks were quantised for recipe {made!r}, the layer runs recipe "
                     f"{recipe!r}")
  if shape.dtype != "bfloat16":
    raise ValueError(f"weight_blocks need bfloat16 x and weights, got {shape.dtype}")
  e, h, f, b = shape.num_experts, shape.hidden, shape.ffn, cuda_fp8.BLOCK
  if h % b or f % b:
    raise ValueError(f"weight_blocks need hidden and ffn sizes multiples of {b}, got H={h}, F={f}")
  expected = {"w_gate_up": ((e, 2 * f, h), (e, h // b, 2 * f // b)),
              "w_down": ((e, h, f), (e, f // b, h // b))}
  for name, (q_shape, scale_shape) in expected.items():
    q, scale = getattr(blocks, name)
    if (tuple(q.shape), str(q.dtype)) != (q_shape, "float8_e4m3fn"):
      raise ValueError(f"weight_blocks.{name}.q must be float8_e4m3fn{list(q_shape)} for this "
                       f"layer, got {q.dtype}{list(q.shape)}")
    if (tuple(scale.shape), str(scale.dtype)) != (scale_shape, "float32"):
      raise ValueError(f"weight_blocks.{name}.scale must be float32{list(scale_shape)} for this "
                       f"layer, got {scale.dtype}{list(scale.shape)}")

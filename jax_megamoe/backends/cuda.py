"""Backend "cuda": the layer from separate FFI kernels. The front door: whether it can run, and
which expert MLP and which exchange serve a layer.

Expert MLP (per layer, from its dtype, sizes and recipe):
  bfloat16 on an sm_90 GPU   the CUTLASS grouped SwiGLU GEMMs (backends.cuda_bf16).
  recipe "fp8" / "fp8_pow2"  the blockwise-FP8 kernels (backends.cuda_fp8: activations 1x128,
                             weights 128x128, e4m3 + fp32 scales, fp32 accumulation promoted
                             every 128 of K; backward in FP8 too: dgrad gradients 1x128, wgrad
                             operands 128x1 inside each expert's rows; gradients straight
                             through the rounding, as jax_megamoe.fp8 defines). Needs bfloat16
                             and H, F multiples of 128.
  anything else              (float32, odd sizes) the pure-JAX reference MLP, which computes the
                             same function.
  recipe "mxfp8"             sm_100 only; no Blackwell GPU here: `unavailable_reason` says so
                             and "auto" picks the reference backend, which emulates the recipe.
Exchange (under a mesh): the NVLink dispatch/combine kernels (backends.cuda_ep) where they can
serve the mesh (every device a GPU, one EP group per NVLink domain), else the XLA collectives of
jax_megamoe.parallel. With the FP8 MLP the rows travel in FP8.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from jax_megamoe import _ffi, parallel
from jax_megamoe.backends import cuda_bf16, cuda_ep, cuda_fp8, reference
from jax_megamoe.backends.local import local_moe
from jax_megamoe.validation import LayerShape

NAME = "cuda"
FP8_RECIPES = cuda_fp8.RECIPES


@functools.cache
def unavailable_reason(recipe: str | None = None) -> str | None:
  """Why this backend cannot run `recipe` here, or None when it can."""
  reason = _ffi.cuda_unavailable_reason()
  if reason is not None:
    return reason
  if not _ffi.has_target(cuda_bf16.FWD_TARGET, "CUDA"):
    return f"the extension has no CUDA target {cuda_bf16.FWD_TARGET!r} (rebuild the package)"
  if recipe is not None and recipe not in FP8_RECIPES:
    return (f"recipe {recipe!r} has no CUDA kernel for this GPU (MXFP8 is sm_100 only); backend "
            "'reference' emulates it")
  missing = [t for t in cuda_fp8.TARGETS if not _ffi.has_target(t, "CUDA")]
  if recipe is not None and missing:
    return f"the extension has no CUDA target {missing[0]!r} (rebuild the package)"
  return None


def expert_mlp(recipe: str | None, dtype, hidden: int, ffn: int) -> parallel.GroupedMlp:
  """The expert MLP that serves a layer of this dtype and size (see the module doc)."""
  if recipe is not None:
    if recipe not in FP8_RECIPES:
      raise NotImplementedError(unavailable_reason(recipe) or f"recipe {recipe!r}")
    if dtype != jnp.bfloat16 or hidden % cuda_fp8.BLOCK or ffn % cuda_fp8.BLOCK:
      return functools.partial(reference.grouped_mlp, recipe=recipe)
    return cuda_fp8.RowsMlp(pow2=recipe == "fp8_pow2")
  if not cuda_bf16.kernel_supports(dtype, hidden, ffn):
    return reference.grouped_mlp
  return cuda_bf16.grouped_mlp


def grouped_mlp(x_sorted, group_sizes, w_gate_up, w_down, *, recipe: str | None = None):
  """SwiGLU expert MLP over rows grouped by expert (contract: reference.grouped_mlp), on the
  kernels that serve it (expert_mlp)."""
  mlp = expert_mlp(recipe, x_sorted.dtype, x_sorted.shape[1], w_down.shape[1])
  return mlp(x_sorted, group_sizes, w_gate_up, w_down)


def moe(x, topk_ids, topk_weights, w_gate_up, w_down, *, mesh, expert_axis, recipe,
        shape: LayerShape, weight_blocks=None):
  """The layer (backend protocol: jax_megamoe.backends)."""
  mlp = expert_mlp(recipe, shape.dtype, shape.hidden, shape.ffn)
  args = (x, topk_ids, topk_weights, w_gate_up, w_down)
  if mesh is None:
    return local_moe(*args, mlp=mlp, weight_blocks=weight_blocks)
  if cuda_ep.unavailable_reason(mesh, expert_axis, shape) is None:
    return cuda_ep.expert_parallel_moe(*args, mesh=mesh, expert_axis=expert_axis, mlp=mlp,
                                       shape=shape, weight_blocks=weight_blocks)
  return parallel.expert_parallel_moe(*args, mesh=mesh, expert_axis=expert_axis, mlp=mlp,
                                      shape=shape, weight_blocks=weight_blocks)

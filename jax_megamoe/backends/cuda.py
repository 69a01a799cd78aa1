"""Backend "cuda": the expert MLP through the grouped-GEMM FFI kernels of jax_megamoe._megamoe.

Forward: L1 = x @ W_gate_up per expert (CUTLASS sm90 grouped GEMM, TMA + wgmma, bf16 in, fp32
accumulation), SwiGLU in fp32 (h stored as bf16), L2 = h @ W_down. Backward: dh = dy @ W_down^T,
SwiGLU backward, dx = dgate_up @ W_gate_up^T, and the K-grouped weight gradients
dW_down = h^T dy, dW_gate_up = x^T dgate_up (fp32 accumulation over each expert's rows, stored in
the weights' dtype; an expert with no rows gets a written zero). Group sizes stay on the device.

What runs where:
  bfloat16 on an sm_90 GPU   the CUDA kernels.
  bfloat16 / float32 on CPU  `grouped_mlp_ffi` reaches the CPU FFI handler (plain loops, the
                             same contract) so CI exercises the binding.
  float32 on a GPU           the pure-JAX reference (the CUDA kernels are bf16 only).
  recipe "fp8" / "fp8_pow2"  forward on the blockwise-FP8 kernels (backends.cuda_fp8:
                             activations 1x128, weights 128x128, e4m3 + fp32 scales, fp32
                             accumulation promoted every 128 of K); backward in FP8 too
                             (dgrad: gradients 1x128, weights 128x128; wgrad: both operands
                             128x1 inside each expert's rows), gradients straight through the
                             rounding (jax_megamoe.fp8 defines it).
                             Needs H and F multiples of 128 (else the reference emulation runs).
  recipe "mxfp8"             sm_100 only; no Blackwell GPU here: `unavailable_reason` says so and
                             "auto" picks the reference backend, which emulates the recipe.
Under a mesh, `expert_parallel_moe` puts this grouped MLP between the NVLink dispatch/combine
kernels (backends.cuda_ep) where they serve the mesh, else between parallel's collectives.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from jax_megamoe import _ffi, varying
from jax_megamoe.backends import cuda_fp8, reference

NAME = "cuda"
FWD_TARGET = "megamoe_grouped_mlp_fwd"
BWD_TARGET = "megamoe_grouped_mlp_bwd"
GEMM_TARGET = "megamoe_grouped_gemm"
GEMM_KINDS = {"fprop": 0, "dgrad": 1, "wgrad": 2}
FP8_RECIPES = ("fp8", "fp8_pow2")


def unavailable_reason(recipe: str | None = None) -> str | None:
  """Why this backend cannot run `recipe` here, or None when it can."""
  reason = _ffi.cuda_unavailable_reason()
  if reason is not None:
    return reason
  if not _ffi.has_target(FWD_TARGET, "CUDA"):
    return f"the extension has no CUDA target {FWD_TARGET!r} (rebuild the package)"
  if recipe is not None and recipe not in FP8_RECIPES:
    return (f"recipe {recipe!r} has no CUDA kernel for this GPU (MXFP8 is sm_100 only); backend "
            "'reference' emulates it")
  missing = [t for t in cuda_fp8.TARGETS if not _ffi.has_target(t, "CUDA")]
  if recipe is not None and missing:
    return f"the extension has no CUDA target {missing[0]!r} (rebuild the package)"
  return None


def workspace_bytes(num_groups: int) -> int:
  """Device scratch the handlers need (group offsets + one grouped GEMM's argument arrays and
  CUTLASS workspace), as C++ computes it: the most any of the targets sized with it needs; the
  handler checks it and names the shortfall."""
  targets = (FWD_TARGET, BWD_TARGET, GEMM_TARGET, cuda_fp8.GEMM_TARGET, cuda_fp8.WGRAD_TARGET)
  return max(_ffi.scratch_bytes(t, num_groups) for t in targets
             if _ffi.has_target(t, "cpu") or _ffi.has_target(t, "CUDA"))


def _check(x_sorted, group_sizes, w_gate_up, w_down) -> tuple[int, int, int, int]:
  if x_sorted.ndim != 2:
    raise ValueError(f"x_sorted must be [N, H], got shape {x_sorted.shape}")
  n, h = x_sorted.shape
  if group_sizes.ndim != 1 or group_sizes.dtype != jnp.int32:
    raise ValueError(f"group_sizes must be [E] int32, got {group_sizes.dtype}{list(group_sizes.shape)}")
  e = group_sizes.shape[0]
  if w_gate_up.ndim != 3 or w_gate_up.shape[:2] != (e, h) or w_gate_up.shape[2] % 2:
    raise ValueError(f"w_gate_up must be [E={e}, H={h}, 2F], got {w_gate_up.shape}")
  f = w_gate_up.shape[2] // 2
  if w_down.shape != (e, f, h):
    raise ValueError(f"w_down must be [E={e}, F={f}, H={h}], got {w_down.shape}")
  for name, a in (("w_gate_up", w_gate_up), ("w_down", w_down)):
    if a.dtype != x_sorted.dtype:
      raise ValueError(f"{name} has dtype {a.dtype}, x_sorted has {x_sorted.dtype}")
  if x_sorted.dtype not in (jnp.bfloat16, jnp.float32):
    raise ValueError(f"x_sorted must be bfloat16 or float32, got {x_sorted.dtype}")
  return n, h, f, e


_match_varying = varying.match_varying


def _fwd_call(x, group_sizes, w_gate_up, w_down):
  n, h, f, e = _check(x, group_sizes, w_gate_up, w_down)
  dt = x.dtype
  call = jax.ffi.ffi_call(
      FWD_TARGET,
      (jax.ShapeDtypeStruct((n, h), dt), jax.ShapeDtypeStruct((n, 2 * f), dt),
       jax.ShapeDtypeStruct((n, f), dt), jax.ShapeDtypeStruct((workspace_bytes(e),), jnp.uint8)))
  y, gate_up, hidden, _ = call(x, group_sizes, w_gate_up, w_down)
  like = (x, group_sizes, w_gate_up, w_down)
  return tuple(_match_varying(a, *like) for a in (y, gate_up, hidden))


def _bwd_call(dy, x, group_sizes, w_gate_up, w_down, gate_up, hidden):
  n, h, f, e = _check(x, group_sizes, w_gate_up, w_down)
  dt = x.dtype
  call = jax.ffi.ffi_call(
      BWD_TARGET,
      (jax.ShapeDtypeStruct((n, h), dt), jax.ShapeDtypeStruct((e, h, 2 * f), dt),
       jax.ShapeDtypeStruct((e, f, h), dt), jax.ShapeDtypeStruct((n, 2 * f), dt),
       jax.ShapeDtypeStruct((n, f), dt), jax.ShapeDtypeStruct((workspace_bytes(e),), jnp.uint8)))
  dx, dw_gate_up, dw_down, _, _, _ = call(dy.astype(dt), x, group_sizes, w_gate_up, w_down,
                                          gate_up, hidden)
  return (_match_varying(dx, x), _match_varying(dw_gate_up, w_gate_up),
          _match_varying(dw_down, w_down))


def _align_varying(*arrays):
  """Inside shard_map, casts every operand to vary over the union of their varying axes, so the
  custom_vjp sees one type and autodiff of the cast sums an invariant weight's gradient."""
  return tuple(_match_varying(a, *arrays) for a in arrays)


def grouped_mlp_ffi(x_sorted, group_sizes, w_gate_up, w_down):
  """The grouped SwiGLU MLP through the FFI handlers, on whatever platform runs it (CUDA: bf16;
  CPU: bf16 or float32). Same contract as reference.grouped_mlp with recipe=None."""
  return _grouped_mlp_ffi(*_align_varying(x_sorted, group_sizes, w_gate_up, w_down))


@jax.custom_vjp
def _grouped_mlp_ffi(x_sorted, group_sizes, w_gate_up, w_down):
  return _fwd_call(x_sorted, group_sizes, w_gate_up, w_down)[0]


def _vjp_fwd(x_sorted, group_sizes, w_gate_up, w_down):
  y, gate_up, hidden = _fwd_call(x_sorted, group_sizes, w_gate_up, w_down)
  return y, (x_sorted, group_sizes, w_gate_up, w_down, gate_up, hidden)


def _vjp_bwd(res, dy):
  x, group_sizes, w_gate_up, w_down, gate_up, hidden = res
  dx, dw_gate_up, dw_down = _bwd_call(dy, x, group_sizes, w_gate_up, w_down, gate_up, hidden)
  return dx, None, dw_gate_up, dw_down


_grouped_mlp_ffi.defvjp(_vjp_fwd, _vjp_bwd)


def _kernel_supports(x_sorted, w_down) -> bool:
  h = x_sorted.shape[1]
  f = w_down.shape[1]
  return x_sorted.dtype == jnp.bfloat16 and h % 8 == 0 and f % 8 == 0


def grouped_mlp(x_sorted: jax.Array, group_sizes: jax.Array, w_gate_up: jax.Array,
                w_down: jax.Array, *, recipe: str | None = None) -> jax.Array:
  """SwiGLU expert MLP over rows grouped by expert (contract: reference.grouped_mlp).

  bf16 with H and F multiples of 8 runs the CUDA kernels; anything else (float32, odd sizes)
  runs the pure-JAX reference, which computes the same function.
  """
  _check(x_sorted, group_sizes, w_gate_up, w_down)
  if recipe is not None:
    if recipe not in FP8_RECIPES:
      raise NotImplementedError(unavailable_reason(recipe) or f"recipe {recipe!r}")
    h, f = x_sorted.shape[1], w_down.shape[1]
    if x_sorted.dtype != jnp.bfloat16 or h % 128 or f % 128:
      return reference.grouped_mlp(x_sorted, group_sizes, w_gate_up, w_down, recipe=recipe)
    return cuda_fp8.grouped_mlp(x_sorted, group_sizes, w_gate_up, w_down, recipe == "fp8_pow2")
  if not _kernel_supports(x_sorted, w_down):
    return reference.grouped_mlp(x_sorted, group_sizes, w_gate_up, w_down)
  return grouped_mlp_ffi(x_sorted, group_sizes, w_gate_up, w_down)


def expert_parallel_moe(x, topk_ids, topk_weights, w_gate_up, w_down, *, mesh, expert_axis,
                        recipe=None):
  """moe() under a mesh with backend "cuda": the NVLink dispatch/combine kernels
  (backends.cuda_ep) around this module's grouped MLP where they can serve the mesh, else the
  collective exchange of jax_megamoe.parallel around it."""
  from jax_megamoe import parallel
  try:
    from jax_megamoe.backends import cuda_ep
  except ImportError:
    cuda_ep = None
  if cuda_ep is not None and cuda_ep.unavailable_reason(mesh, expert_axis) is None:
    return cuda_ep.expert_parallel_moe(x, topk_ids, topk_weights, w_gate_up, w_down, mesh=mesh,
                                       expert_axis=expert_axis, recipe=recipe)
  return parallel.expert_parallel_moe(x, topk_ids, topk_weights, w_gate_up, w_down, mesh=mesh,
                                      expert_axis=expert_axis, grouped_mlp=grouped_mlp,
                                      recipe=recipe)


def grouped_gemm(a: jax.Array, group_sizes: jax.Array, b: jax.Array, *, kind: int | str
                 ) -> jax.Array:
  """One grouped GEMM on the CUDA kernels (bf16 in and out, fp32 accumulation):

    fprop (0): a [N, K], b [E, K, P] -> [N, P]   rows of group g times b[g]; padding rows 0
    dgrad (1): a [N, K], b [E, P, K] -> [N, P]   rows of group g times b[g]^T; padding rows 0
    wgrad (2): a [N, M], b [N, P]    -> [E, M, P] a_g^T b_g over group g's rows; empty groups 0
  """
  kind = GEMM_KINDS.get(kind, kind) if isinstance(kind, str) else int(kind)
  if kind not in (0, 1, 2):
    raise ValueError(f"kind must be one of {GEMM_KINDS} or 0/1/2, got {kind!r}")
  e = group_sizes.shape[0]
  if kind == 2:
    out = jax.ShapeDtypeStruct((e, a.shape[1], b.shape[1]), a.dtype)
  else:
    out = jax.ShapeDtypeStruct((a.shape[0], b.shape[2] if kind == 0 else b.shape[1]), a.dtype)
  call = jax.ffi.ffi_call(
      GEMM_TARGET, (out, jax.ShapeDtypeStruct((workspace_bytes(e),), jnp.uint8)))
  return _match_varying(call(a, group_sizes, b, kind=np.int64(kind))[0], a, group_sizes, b)

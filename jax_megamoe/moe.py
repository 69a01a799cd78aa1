"""The public functional op jax_megamoe.moe: validation, backend choice, local or
expert-parallel execution."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jax_megamoe import backends, eager, fp8, parallel, token_layout

BACKENDS = backends.NAMES
RECIPES = (None, *fp8.RECIPES)
COMPUTE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)  # the dtypes x may have


def moe(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, w_gate_up: jax.Array,
        w_down: jax.Array, *, mesh: Mesh | None = None, expert_axis: str = "expert",
        backend: str = "auto", recipe: str | None = None) -> jax.Array:
  """Mixture-of-experts SwiGLU layer: y[t] = sum_j w[t,j] * Expert_{id[t,j]}(x[t]).

  Args:
    x: [T, H] tokens, float32 / bfloat16 / float16.
    topk_ids: [T, k] integer expert ids in [0, E); -1 masks a slot (it contributes nothing).
      Other out-of-range ids raise when the values are concrete, and are masked under tracing.
    topk_weights: [T, k] routing weights (computed in float32).
    w_gate_up: [E, H, 2F] in x's dtype; gate = [..., :F], up = [..., F:].
    w_down: [E, F, H] in x's dtype.
    mesh: optional device mesh. Tokens are sharded over ALL its axes (T must divide evenly over
      its devices), experts over `expert_axis` (E must divide by that axis' size). Inputs may
      arrive with any sharding.
    expert_axis: the mesh axis that shards experts.
    backend: "auto" (best available), "reference" (pure JAX), "cuda" (FFI kernels),
      "fused" (one overlapping kernel per direction).
    recipe: None (matmuls in x's dtype, fp32 accumulation), "fp8" (blockwise FP8, Hopper) or
      "mxfp8" (MXFP8, Blackwell).

  Returns:
    y [T, H] in x's dtype. Differentiable w.r.t. x, topk_weights, w_gate_up and w_down.
  """
  _validate(x, topk_ids, topk_weights, w_gate_up, w_down, mesh, expert_axis, backend, recipe)
  if mesh is not None and eager.is_eager(x, topk_ids, topk_weights, w_gate_up, w_down):
    return eager.call(moe, x, topk_ids, topk_weights, w_gate_up, w_down, mesh=mesh,
                      expert_axis=expert_axis, backend=backend, recipe=recipe)
  impl = backends.resolve(backend, recipe)
  topk_ids = topk_ids.astype(jnp.int32)
  topk_weights = topk_weights.astype(jnp.float32)
  if mesh is not None and hasattr(impl, "expert_parallel_moe"):
    return impl.expert_parallel_moe(x, topk_ids, topk_weights, w_gate_up, w_down, mesh=mesh,
                                    expert_axis=expert_axis, recipe=recipe)
  if mesh is not None:
    return parallel.expert_parallel_moe(x, topk_ids, topk_weights, w_gate_up, w_down,
                                        mesh=mesh, expert_axis=expert_axis,
                                        grouped_mlp=impl.grouped_mlp, recipe=recipe)
  return local_moe(x, topk_ids, topk_weights, w_gate_up, w_down,
                   grouped_mlp=impl.grouped_mlp, recipe=recipe)


def local_moe(x, topk_ids, topk_weights, w_gate_up, w_down, *, grouped_mlp, recipe):
  """moe() with every expert on this device: sort slots by expert, grouped MLP, combine."""
  num_tokens, top_k = topk_ids.shape
  num_experts = w_gate_up.shape[0]
  slots = token_layout.sort_by_expert(topk_ids.reshape(-1), num_experts)
  out = grouped_mlp(x[slots.order // top_k], slots.group_sizes, w_gate_up, w_down,
                    recipe=recipe)
  slot_out = out[slots.inverse].reshape(num_tokens, top_k, x.shape[1])
  weights = token_layout.masked_weights(topk_ids, topk_weights, num_experts)
  return token_layout.combine_slots(slot_out, weights, x.dtype)


def _validate(x, topk_ids, topk_weights, w_gate_up, w_down, mesh, expert_axis, backend,
              recipe):
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  if recipe not in RECIPES:
    raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
  for name, value in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights),
                      ("w_gate_up", w_gate_up), ("w_down", w_down)):
    if not isinstance(value, (jax.Array, np.ndarray)):
      raise ValueError(f"{name} must be a jax.Array or numpy array, got {type(value).__name__}")
  if x.ndim != 2:
    raise ValueError(f"x must be [tokens, hidden], got shape {x.shape}")
  if x.dtype not in COMPUTE_DTYPES:
    raise ValueError(f"x must be float32, bfloat16 or float16, got dtype {x.dtype}")
  num_tokens, hidden = x.shape
  if topk_ids.ndim != 2 or topk_ids.shape[0] != num_tokens:
    raise ValueError(f"topk_ids must be [tokens={num_tokens}, k], got shape {topk_ids.shape}")
  if topk_ids.shape[1] < 1:
    raise ValueError(f"topk_ids must have at least one slot per token (k >= 1), got shape "
                     f"{topk_ids.shape}")
  if not jnp.issubdtype(topk_ids.dtype, jnp.integer):
    raise ValueError(f"topk_ids must be an integer array (int32), got dtype {topk_ids.dtype}")
  if topk_weights.shape != topk_ids.shape:
    raise ValueError(f"topk_weights must have topk_ids' shape {topk_ids.shape}, "
                     f"got {topk_weights.shape}")
  if not jnp.issubdtype(topk_weights.dtype, jnp.floating):
    raise ValueError(f"topk_weights must be floating point, got dtype {topk_weights.dtype}")
  if w_gate_up.ndim != 3 or w_gate_up.shape[1] != hidden or w_gate_up.shape[2] % 2:
    raise ValueError(f"w_gate_up must be [experts, hidden={hidden}, 2 * ffn], got shape "
                     f"{w_gate_up.shape}")
  num_experts, _, two_ffn = w_gate_up.shape
  if num_experts < 1:
    raise ValueError(f"w_gate_up must hold at least one expert, got shape {w_gate_up.shape}")
  if w_down.shape != (num_experts, two_ffn // 2, hidden):
    raise ValueError(f"w_down must be [experts={num_experts}, ffn={two_ffn // 2}, "
                     f"hidden={hidden}], got shape {w_down.shape}")
  for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
    if w.dtype != x.dtype:
      raise ValueError(f"{name} must have x's dtype {x.dtype}, got {w.dtype}")
  top_k = topk_ids.shape[1]
  if top_k > num_experts:
    raise ValueError(f"top_k (topk_ids.shape[1]) must be <= the number of experts "
                     f"{num_experts}, got {top_k}")
  _validate_ids_if_concrete(topk_ids, num_experts)
  if mesh is None:
    return
  if expert_axis not in mesh.axis_names:
    raise ValueError(f"expert_axis {expert_axis!r} is not an axis of the mesh "
                     f"(axes {tuple(mesh.axis_names)})")
  ep_size = mesh.shape[expert_axis]
  if num_experts % ep_size:
    raise ValueError(f"the number of experts {num_experts} must divide evenly over "
                     f"expert_axis {expert_axis!r} of size {ep_size}")
  num_devices = math.prod(mesh.shape.values())
  if num_tokens % num_devices:
    raise ValueError(f"the number of tokens {num_tokens} must divide evenly over the mesh's "
                     f"{num_devices} devices")


def _validate_ids_if_concrete(topk_ids, num_experts):
  if isinstance(topk_ids, jax.core.Tracer):
    return
  ids = np.asarray(topk_ids)
  bad = (ids < -1) | (ids >= num_experts)
  if bad.any():
    raise ValueError(f"topk_ids must be in [0, {num_experts}) or -1 (masked), got "
                     f"{ids[bad].ravel()[:5].tolist()}")

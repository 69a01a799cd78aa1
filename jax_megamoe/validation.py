"""The one check of a MoE layer's arguments: jax_megamoe.moe runs it once per call and hands the
resulting LayerShape to the backend, which trusts it (no backend re-validates)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

COMPUTE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)  # the dtypes x may have


@dataclasses.dataclass(frozen=True)
class LayerShape:
  """Sizes of one validated layer call (static: hashable, usable as a nondiff argument)."""
  tokens: int              # T over all devices
  hidden: int              # H
  ffn: int                 # F
  num_experts: int         # E
  top_k: int               # k
  dtype: jnp.dtype         # x's (and the expert weights') dtype
  ep_size: int = 1         # ranks along the expert axis (1 without a mesh)
  num_devices: int = 1     # devices of the mesh (1 without one)

  @property
  def tokens_per_device(self) -> int:
    return self.tokens // self.num_devices

  @property
  def experts_per_rank(self) -> int:
    return self.num_experts // self.ep_size


def check_layer_args(x, topk_ids, topk_weights, w_gate_up, w_down, mesh: Mesh | None = None,
                     expert_axis: str = "expert") -> LayerShape:
  """Validates the arguments of jax_megamoe.moe (see its docstring); raises ValueError naming
  the parameter and the value. Returns the layer's sizes."""
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
  _check_ids_if_concrete(topk_ids, num_experts)
  shape = LayerShape(tokens=num_tokens, hidden=hidden, ffn=two_ffn // 2,
                     num_experts=num_experts, top_k=top_k, dtype=jnp.dtype(x.dtype))
  if mesh is None:
    return shape
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
  return dataclasses.replace(shape, ep_size=ep_size, num_devices=num_devices)


def _check_ids_if_concrete(topk_ids, num_experts):
  if isinstance(topk_ids, jax.core.Tracer):
    return
  ids = np.asarray(topk_ids)
  bad = (ids < -1) | (ids >= num_experts)
  if bad.any():
    raise ValueError(f"topk_ids must be in [0, {num_experts}) or -1 (masked), got "
                     f"{ids[bad].ravel()[:5].tolist()}")
  if ids.shape[1] > 1:
    ordered = np.sort(ids, axis=1)
    repeats = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    if repeats.any():
      token = int(np.nonzero(repeats.any(axis=1))[0][0])
      raise ValueError(f"topk_ids must hold distinct experts per token (-1 may repeat); token "
                       f"{token} has {ids[token].tolist()}")

"""Flax NNX module jax_megamoe.MoE: router + SwiGLU experts, parameters with sharding."""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jax_megamoe.moe import BACKENDS, COMPUTE_DTYPES, RECIPES, moe
from jax_megamoe.router import SELECTION_NORMS, RouterAux, route

# Qwen3's initializer_range: every linear weight ~ N(0, 0.02^2).
QWEN3_INIT_STD = 0.02


class SelectionBias(nnx.Param):
  """A router's per-expert selection bias [E] (MoE(selection_bias=True)): added to the logits
  only to pick the top k (DeepSeek-V3's auxiliary-loss-free balancing), never to the weights.

  It is an nnx.Param so that it lives with the parameters (nnx.split(model, nnx.Param),
  checkpoints, shardings) but it is not trained by gradient: none reaches it (the top-k choice
  is not differentiable), so AdamW leaves it where it is (weight decay aside: mask vectors off,
  as examples/train_qwen3_moe.py does). It starts at zero, so a model loaded from a checkpoint
  routes exactly as without it, and moves only through router.update_selection_bias, once per
  training step, from the step's expert loads."""


class SelectionStats(nnx.Param):
  """Stored estimates [E] of one of the per-expert statistics a router's selection_norm
  computes on each batch (MoE(selection_norm=...) other than "none": selection_mean,
  selection_std, selection_offset; RouterAux.selection_stats rows 0, 1, 2). The module routes
  with them, instead of the batch's, when use_running_average is True (`model.eval()`), as
  batch norm does at inference.

  Measured, not learned: models.calibrate_selection_stats sets them to their mean over a few
  batches at the current parameters (the example does before each checkpoint). They start at
  (0, 1, 0), the plain logits' ranking. Like SelectionBias, an nnx.Param that no gradient
  reaches (keep it out of weight decay: the example's mask skips vectors)."""


class MoE(nnx.Module):
  """Mixture-of-experts feed-forward block (Qwen3-MoE style).

  Parameters (N(0, init_std^2), by default 0.02 as Qwen3 initialises them; w_down
  N(0, down_init_std^2), default init_std; stored in `param_dtype`):
    router     [H, E]       router logits = x @ router, computed in float32
    w_gate_up  [E, H, 2F]   gate = [..., :F], up = [..., F:]; sharded over `expert_axis`
    w_down     [E, F, H]    sharded over `expert_axis`

  Call: `y = moe(x)` or `y, aux = moe(x, return_aux=True)` with x [..., H] (any leading dims),
  y in `dtype`; aux is a RouterAux (load-balancing loss, z-loss, per-expert load).

  With `mesh`, the expert weights are created sharded over `expert_axis` (replicated over the
  other axes) and tokens are sharded over every mesh axis inside the op; the leading token count
  must divide evenly over the mesh's devices. Parameters also carry `out_sharding` metadata,
  so nnx.get_partition_spec gives their PartitionSpecs.

  selection_norm: what the router picks the top k from (jax_megamoe.route; "none", Qwen3's
  routing, by default). Any other norm also gives the module SelectionStats parameters
  (selection_mean, selection_std, selection_offset), used in place of the batch's statistics
  when use_running_average is True (set by `model.eval()`, cleared by `model.train()`).
  """

  def __init__(self, hidden_size: int, ffn_size: int, num_experts: int, top_k: int, *,
               rngs: nnx.Rngs, norm_topk_prob: bool = True, dtype: Any = jnp.bfloat16,
               param_dtype: Any = jnp.float32, backend: str = "auto",
               recipe: str | None = None, mesh: Mesh | None = None,
               expert_axis: str = "expert", init_std: float = QWEN3_INIT_STD,
               down_init_std: float | None = None, selection_bias: bool = False,
               selection_norm: str = "none"):
    down_init_std = init_std if down_init_std is None else down_init_std
    for name, value in (("init_std", init_std), ("down_init_std", down_init_std)):
      if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    for name, value in (("hidden_size", hidden_size), ("ffn_size", ffn_size),
                        ("num_experts", num_experts)):
      if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not _is_int(top_k) or not 1 <= top_k <= num_experts:
      raise ValueError(f"top_k must be an int in [1, num_experts={num_experts}], got {top_k!r}")
    hidden_size, ffn_size, num_experts, top_k = map(int, (hidden_size, ffn_size, num_experts,
                                                          top_k))
    # Checked here rather than at the first call, which may come much later (inside jit).
    if _dtype_or_none(dtype) not in COMPUTE_DTYPES:
      raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    param_dtype_ = _dtype_or_none(param_dtype)
    if param_dtype_ is None or not jnp.issubdtype(param_dtype_, jnp.floating):
      raise ValueError(f"param_dtype must be a floating dtype, got {param_dtype!r}")
    if backend not in BACKENDS:
      raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if recipe not in RECIPES:
      raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    if mesh is not None:
      if expert_axis not in mesh.axis_names:
        raise ValueError(f"expert_axis {expert_axis!r} is not an axis of the mesh "
                         f"(axes {tuple(mesh.axis_names)})")
      if num_experts % mesh.shape[expert_axis]:
        raise ValueError(f"num_experts {num_experts} must divide evenly over expert_axis "
                         f"{expert_axis!r} of size {mesh.shape[expert_axis]}")
    self.hidden_size, self.ffn_size = hidden_size, ffn_size
    self.num_experts, self.top_k = num_experts, top_k
    self.norm_topk_prob = norm_topk_prob
    if selection_norm not in SELECTION_NORMS:
      raise ValueError(f"selection_norm must be one of {SELECTION_NORMS}, got {selection_norm!r}")
    self.selection_norm = selection_norm
    self.dtype, self.param_dtype = dtype, param_dtype
    self.backend, self.recipe = backend, recipe
    self.mesh, self.expert_axis = mesh, expert_axis

    init = nnx.initializers.normal(init_std)
    self.router = self._param(init(rngs.params(), (hidden_size, num_experts), param_dtype),
                              (None, None))
    expert_sharding = (expert_axis, None, None)
    self.w_gate_up = self._param(
        init(rngs.params(), (num_experts, hidden_size, 2 * ffn_size), param_dtype),
        expert_sharding)
    self.w_down = self._param(
        nnx.initializers.normal(down_init_std)(
            rngs.params(), (num_experts, ffn_size, hidden_size), param_dtype),
        expert_sharding)
    if selection_bias:
      self.selection_bias = self._param(jnp.zeros((num_experts,), jnp.float32), (None,),
                                        kind=SelectionBias)
    self.use_running_average = False
    if selection_norm != "none":
      for name, value in (("selection_mean", 0.0), ("selection_std", 1.0),
                          ("selection_offset", 0.0)):
        setattr(self, name, self._param(jnp.full((num_experts,), value, jnp.float32), (None,),
                                        kind=SelectionStats))

  def _param(self, value: jax.Array, sharding: tuple, kind: type = nnx.Param) -> nnx.Param:
    if self.mesh is None:
      return kind(value, out_sharding=sharding, eager_sharding=False)
    return kind(value, out_sharding=sharding, mesh=self.mesh)

  def __call__(self, x: jax.Array, *, return_aux: bool = False, weight_blocks=None
               ) -> jax.Array | tuple[jax.Array, RouterAux]:
    """y [..., H] for x [..., H] (with return_aux also the router's RouterAux). weight_blocks:
    recipes "fp8" / "fp8_pow2", this module's expert weights already quantised
    (jax_megamoe.quantize_expert_weights of w_gate_up and w_down in `dtype`; see moe)."""
    if not isinstance(x, (jax.Array, np.ndarray)):
      raise ValueError(f"x must be a jax.Array or numpy array, got {type(x).__name__}")
    if x.ndim == 0 or x.shape[-1] != self.hidden_size:
      raise ValueError(f"x's last axis must be hidden_size={self.hidden_size}, got shape "
                       f"{x.shape}")
    # Named scopes ("moe/router", "moe/experts") let step profiles attribute device time
    # (benchmarks/profile_step.py).
    with jax.named_scope("moe"):
      lead = x.shape[:-1]
      tokens = x.reshape(-1, self.hidden_size)
      with jax.named_scope("router"):
        logits = tokens.astype(jnp.float32) @ self.router[...].astype(jnp.float32)
        bias = getattr(self, "selection_bias", None)
        stats = None
        if self.use_running_average and self.selection_norm != "none":
          stats = (self.selection_mean[...], self.selection_std[...],
                   self.selection_offset[...])
        topk_weights, topk_ids, aux = route(logits, self.top_k,
                                            norm_topk_prob=self.norm_topk_prob,
                                            selection_bias=None if bias is None else bias[...],
                                            selection_norm=self.selection_norm,
                                            selection_stats=stats, mesh=self.mesh)
      with jax.named_scope("experts"):
        y = moe(tokens.astype(self.dtype), topk_ids, topk_weights,
                self.w_gate_up[...].astype(self.dtype), self.w_down[...].astype(self.dtype),
                mesh=self.mesh, expert_axis=self.expert_axis, backend=self.backend,
                recipe=self.recipe, weight_blocks=weight_blocks)
      y = y.reshape(*lead, self.hidden_size)
    return (y, aux) if return_aux else y


def _is_int(value: Any) -> bool:
  """Python and numpy integers; not bool (True is not a size)."""
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _dtype_or_none(dtype: Any) -> np.dtype | None:
  try:
    return jnp.dtype(dtype)
  except TypeError:
    return None

"""Qwen3-MoE decoder in Flax NNX on jax_megamoe.MoE (its Hugging Face import: hf_import).

Architecture (as transformers' Qwen3MoeForCausalLM): token embedding -> L x [RMSNorm ->
grouped-query attention with per-head RMSNorm on q and k and RoPE -> residual -> RMSNorm ->
MoE (or dense SwiGLU) -> residual] -> RMSNorm -> LM head (tied to the embedding or not).

  model = Qwen3Moe(get_config("tiny"), rngs=nnx.Rngs(0))
  logits = model(input_ids)                       # [B, S] int -> [B, S, V] float32
  logits, aux = model(input_ids, return_aux=True)  # aux: ModelAux, one row per MoE layer

Under `mesh` (axis types Auto or Explicit) the batch is sharded over every mesh axis (data and
expert alike, as jax_megamoe.moe expects) and the experts over `expert_axis`; the other
parameters carry no sharding of their own (the training script adds FSDP, models/sharding.py).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jax_megamoe import fp8
from jax_megamoe.module import MoE
from jax_megamoe.router import ROUTER_CHOICE_NAME, update_selection_bias
from jax_megamoe.weight_blocks import quantize_expert_weights
from jax_megamoe.models.config import CONFIGS, Qwen3MoeConfig, get_config
from jax_megamoe.models.embedding import embedding_lookup

__all__ = ["CONFIGS", "FLOAT32_PARAMS", "REMAT_POLICIES", "ModelAux", "Qwen3Moe",
           "Qwen3MoeConfig", "calibrate_selection_stats", "compute_copy", "get_config",
           "set_selection_stats", "update_selection_biases"]

# --remat names -> what each decoder layer keeps for the backward pass (None: no remat). Every
# policy also keeps the MoE layers' quantised FP8 weights (fp8.QUANTIZED_WEIGHTS_NAME: 1 byte
# per expert parameter plus scales, nothing in bf16), so the recomputed forward does not
# quantise them again, and their routers' top-k choice (router.ROUTER_CHOICE_NAME: int32
# [T, k]), so that it does not choose again (a selection_norm's offsets are solved once).
_NAMED = jax.checkpoint_policies.save_only_these_names(fp8.QUANTIZED_WEIGHTS_NAME,
                                                        ROUTER_CHOICE_NAME)
REMAT_POLICIES = {
    "none": None,
    "full": _NAMED,
    "dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.checkpoint_dots, _NAMED),
    "dots_no_batch": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims, _NAMED),
}


class ModelAux(NamedTuple):
  """Router statistics of every MoE layer, stacked (M = number of MoE layers).

  load_balancing_loss: [M] float32, 1.0 when balanced (jax_megamoe.RouterAux).
  z_loss: [M] float32.
  expert_load: [M, E] float32, fraction of routed slots per expert (rows sum to one).
  mean_logits: [M, E] float32, each expert's router logit averaged over the tokens.
  selection_stats: [M, 3, E] float32, the (mean, std, offset) each layer's top-k choice used
    (RouterAux.selection_stats; calibrate_selection_stats stores their mean over batches).
  """

  load_balancing_loss: jax.Array
  z_loss: jax.Array
  expert_load: jax.Array
  mean_logits: jax.Array
  selection_stats: jax.Array


class RMSNorm(nnx.Module):
  """x / rms(x) * scale over the last axis, in float32, rounded to x's dtype before the scale
  (as HF's Qwen3MoeRMSNorm)."""

  def __init__(self, dim: int, *, eps: float, param_dtype: Any):
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype))

  @jax.named_scope("rms_norm")
  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
    return self.scale[...].astype(x.dtype) * normed.astype(x.dtype)


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float
                 ) -> tuple[jax.Array, jax.Array]:
  """positions [..., S] -> cos, sin [..., S, D] float32 (HF layout: both halves repeat)."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq
  angles = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(angles), jnp.sin(angles)


@jax.named_scope("rope")
def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x [B, S, N, D]; cos, sin [B or 1, S, D]. Rotates the two halves of D (not interleaved)."""
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
  return x * cos + rotated * sin


def _linear(in_features: int, out_features: int, *, config: Qwen3MoeConfig, dtype: Any,
            param_dtype: Any, rngs: nnx.Rngs, std: float | None = None,
            **kwargs: Any) -> nnx.Linear:
  """A bias-free linear layer drawn from N(0, std^2) (default config.init_std)."""
  std = config.init_std if std is None else std
  return nnx.Linear(in_features, out_features, use_bias=False, dtype=dtype,
                    param_dtype=param_dtype, rngs=rngs,
                    kernel_init=nnx.initializers.normal(std), **kwargs)


class Attention(nnx.Module):
  """Causal grouped-query self-attention with Qwen3's per-head q/k RMSNorm and RoPE.

  Kernels: q_proj [H, N*D], k_proj / v_proj [H, K*D], o_proj [N*D, H]; q_norm, k_norm [D].
  """

  def __init__(self, config: Qwen3MoeConfig, *, dtype: Any, param_dtype: Any,
               rngs: nnx.Rngs, implementation: str | None = None):
    c = config
    self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
    self.implementation = implementation
    self.rope_theta = c.rope_theta
    kw = dict(config=c, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.q_proj = _linear(c.hidden_size, c.num_heads * c.head_dim, **kw)
    self.k_proj = _linear(c.hidden_size, c.num_kv_heads * c.head_dim, **kw)
    self.v_proj = _linear(c.hidden_size, c.num_kv_heads * c.head_dim, **kw)
    self.o_proj = _linear(c.num_heads * c.head_dim, c.hidden_size, std=c.output_init_std, **kw)
    self.q_norm = RMSNorm(c.head_dim, eps=c.rms_norm_eps, param_dtype=param_dtype)
    self.k_norm = RMSNorm(c.head_dim, eps=c.rms_norm_eps, param_dtype=param_dtype)

  @jax.named_scope("attention")
  def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    batch, seq, _ = x.shape
    with jax.named_scope("qkv_proj"):
      q = self.q_proj(x).reshape(batch, seq, self.num_heads, self.head_dim)
      k = self.k_proj(x).reshape(batch, seq, self.num_kv_heads, self.head_dim)
      v = self.v_proj(x).reshape(batch, seq, self.num_kv_heads, self.head_dim)
    q, k = self.q_norm(q), self.k_norm(k)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    # Handles GQA itself. "xla" materialises the [S, S] scores; "cudnn" is flash attention
    # (GPU, bf16/fp16 only).
    with jax.named_scope("core"):
      out = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                         implementation=self.implementation)
    with jax.named_scope("out_proj"):
      return self.o_proj(out.reshape(batch, seq, self.num_heads * self.head_dim))


class DenseMlp(nnx.Module):
  """SwiGLU MLP for the dense layers: down(silu(gate(x)) * up(x))."""

  def __init__(self, config: Qwen3MoeConfig, *, dtype: Any, param_dtype: Any,
               rngs: nnx.Rngs):
    kw = dict(config=config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    h, f = config.hidden_size, config.dense_ffn_size
    self.gate_proj = _linear(h, f, **kw)
    self.up_proj = _linear(h, f, **kw)
    self.down_proj = _linear(f, h, std=config.output_init_std, **kw)

  @jax.named_scope("dense_mlp")
  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
  """Pre-norm residual block: attention, then MoE (or DenseMlp)."""

  def __init__(self, config: Qwen3MoeConfig, layer: int, *, dtype: Any, param_dtype: Any,
               rngs: nnx.Rngs, moe_kwargs: dict[str, Any], attention: str | None = None):
    c = config
    self.input_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, param_dtype=param_dtype)
    self.attn = Attention(c, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                          implementation=attention)
    self.post_attn_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, param_dtype=param_dtype)
    self.is_moe = c.is_moe_layer(layer)
    if self.is_moe:
      self.mlp = MoE(c.hidden_size, c.moe_ffn_size, c.num_experts, c.top_k, rngs=rngs,
                     norm_topk_prob=c.norm_topk_prob, dtype=dtype, param_dtype=param_dtype,
                     init_std=c.init_std, down_init_std=c.output_init_std,
                     selection_bias=c.router_bias_update_rate > 0,
                     selection_norm=c.router_selection_norm, **moe_kwargs)
    else:
      self.mlp = DenseMlp(c, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, weight_blocks=None):
    """x [B, S, H] -> (x [B, S, H], RouterAux or None for a dense layer). weight_blocks: the
    MoE layer's FP8 expert weights already quantised (Qwen3Moe.quantize_moe_weights)."""
    x = x + self.attn(self.input_norm(x), cos, sin)
    h = self.post_attn_norm(x)
    if self.is_moe:
      y, aux = self.mlp(h, return_aux=True, weight_blocks=weight_blocks)
      return x + y, aux
    return x + self.mlp(h), None


class Qwen3Moe(nnx.Module):
  """Qwen3-MoE causal language model.

  Args:
    config: shapes (Qwen3MoeConfig; see get_config).
    rngs: parameter initialisation: weights N(0, config.init_std^2), the embedding
      N(0, config.embedding_init_std^2), the residual branches' last projections
      N(0, config.output_init_std^2), norms one.
    dtype: compute dtype (bfloat16 for training, float32 for exact comparisons).
    param_dtype: storage dtype of the parameters (float32 master weights).
    backend, recipe: passed to every jax_megamoe.MoE layer.
    mesh, expert_axis: device mesh; tokens sharded over all its axes, experts over expert_axis.
    remat: a REMAT_POLICIES name; every decoder layer is rematerialised with that policy.
    attention: jax.nn.dot_product_attention's implementation: None / "xla" (any platform) or
      "cudnn" (flash attention on NVIDIA GPUs, bf16).
  """

  def __init__(self, config: Qwen3MoeConfig, *, rngs: nnx.Rngs, dtype: Any = jnp.bfloat16,
               param_dtype: Any = jnp.float32, backend: str = "auto",
               recipe: str | None = None, mesh: Mesh | None = None,
               expert_axis: str = "expert", remat: str = "none",
               attention: str | None = None):
    if remat not in REMAT_POLICIES:
      raise ValueError(f"remat must be one of {sorted(REMAT_POLICIES)}, got {remat!r}")
    if attention not in (None, "xla", "cudnn"):
      raise ValueError(f"attention must be None, 'xla' or 'cudnn', got {attention!r}")
    self.config = config
    self.dtype = dtype
    self.mesh = mesh
    self.remat = remat
    c = config
    self.embed = nnx.Embed(c.vocab_size, c.hidden_size, dtype=dtype, param_dtype=param_dtype,
                           embedding_init=nnx.initializers.normal(c.embedding_init_std),
                           rngs=rngs)
    moe_kwargs = dict(backend=backend, recipe=recipe, mesh=mesh, expert_axis=expert_axis)
    self.layers = nnx.List([
        DecoderLayer(c, i, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                     moe_kwargs=moe_kwargs, attention=attention)
        for i in range(c.num_layers)])
    self.final_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, param_dtype=param_dtype)
    if not c.tie_word_embeddings:
      self.lm_head = _linear(c.hidden_size, c.vocab_size, config=c, dtype=dtype,
                             param_dtype=param_dtype, rngs=rngs)

  def __call__(self, input_ids: jax.Array, *, positions: jax.Array | None = None,
               return_aux: bool = False, return_hidden: bool = False,
               moe_weight_blocks=None) -> jax.Array | tuple[jax.Array, ModelAux]:
    """input_ids [B, S] int -> logits [B, S, V] float32 (and ModelAux with return_aux).

    positions: optional [B, S] or [S] RoPE positions (default 0..S-1).
    return_hidden: return the final normed hidden states [B, S, H] (compute dtype) instead of
      the logits, e.g. for models/losses.chunked_cross_entropy with `head()`.
    moe_weight_blocks: recipes "fp8" / "fp8_pow2", quantize_moe_weights() of these parameters,
      made once for several calls (e.g. the micro-batches of a rolled scan); the same model.
    """
    if input_ids.ndim != 2:
      raise ValueError(f"input_ids must be [batch, seq], got shape {input_ids.shape}")
    if moe_weight_blocks is None:
      moe_weight_blocks = (None,) * len(self.layers)
    if len(moe_weight_blocks) != len(self.layers):
      raise ValueError(f"moe_weight_blocks must have one entry per decoder layer "
                       f"({len(self.layers)}), got {len(moe_weight_blocks)}")
    seq = input_ids.shape[1]
    if positions is None:
      positions = jnp.arange(seq, dtype=jnp.int32)
    positions = jnp.broadcast_to(positions, (1, seq) if positions.ndim == 1 else positions.shape)
    with jax.named_scope("rope"):
      cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
    with jax.named_scope("embed"):  # nnx.Embed's lookup, with a gradient summed by id first
      table = self.embed.embedding[...].astype(self.dtype)
      x = self._shard_batch(embedding_lookup(table, input_ids))
    run_layer = _run_layer
    if self.remat != "none":
      run_layer = nnx.remat(_run_layer, policy=REMAT_POLICIES[self.remat])
    auxes = []
    for layer, blocks in zip(self.layers, moe_weight_blocks):
      x, aux = run_layer(layer, x, cos, sin, blocks)
      x = self._shard_batch(x)
      if aux is not None:
        auxes.append(aux)

    x = self.final_norm(x)
    if return_hidden:
      out = x
    else:
      with jax.named_scope("lm_head"):
        out = jnp.einsum("bsh,hv->bsv", x, self.head().astype(x.dtype),
                         preferred_element_type=jnp.float32)
    if not return_aux:
      return out
    if not auxes:  # a model without MoE layers: empty statistics, still well-typed
      e = self.config.num_experts
      return out, ModelAux(jnp.zeros((0,)), jnp.zeros((0,)), jnp.zeros((0, e)),
                           jnp.zeros((0, e)), jnp.zeros((0, 3, e)))
    return out, ModelAux(*(jnp.stack(field) for field in zip(*auxes)))

  def quantize_moe_weights(self) -> tuple:
    """Every MoE layer's expert weights in the compute dtype, quantised for the layers' FP8
    recipe (jax_megamoe.quantize_expert_weights; None for a dense layer): pass it as
    moe_weight_blocks to calls that share these parameters, so they quantise once."""
    blocks = []
    for layer in self.layers:
      if not layer.is_moe:
        blocks.append(None)
        continue
      moe = layer.mlp
      blocks.append(quantize_expert_weights(
          moe.w_gate_up[...].astype(moe.dtype), moe.w_down[...].astype(moe.dtype), moe.recipe,
          mesh=moe.mesh, expert_axis=moe.expert_axis))
    return tuple(blocks)

  def head(self) -> jax.Array:
    """The output projection [H, V] (param_dtype): lm_head, or the embedding when tied."""
    if self.config.tie_word_embeddings:
      return self.embed.embedding[...].T
    return self.lm_head.kernel[...]

  def _shard_batch(self, x: jax.Array) -> jax.Array:
    """Keeps activations sharded over the batch on every mesh axis (no-op without a mesh)."""
    if self.mesh is None:
      return x
    sharding = NamedSharding(self.mesh, P(tuple(self.mesh.axis_names)))
    if all(t == AxisType.Explicit for t in self.mesh.axis_types):
      return jax.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def _run_layer(layer: DecoderLayer, x: jax.Array, cos: jax.Array, sin: jax.Array,
               weight_blocks=None):
  return layer(x, cos, sin, weight_blocks)


def _in_layer_order(flat: list, name: str) -> list[int]:
  """Indices into `flat` (nnx.to_flat_state of a Qwen3Moe's Params, as a list) of every
  decoder layer's parameter called `name` (those of the layers that have one), in layer
  order."""
  return [i for _, i in sorted((path[1], i) for i, (path, _) in enumerate(flat)
                               if path[-1] == name)]


def update_selection_biases(params: nnx.State, expert_load: jax.Array, rate: float,
                            rule: str = "sign", mean_logits: jax.Array | None = None
                            ) -> nnx.State:
  """params with every MoE layer's selection bias moved one step of auxiliary-loss-free
  balancing (jax_megamoe.router.update_selection_bias with `rule`: the config's
  router_bias_update_rule) from that layer's row of `expert_load`
  (ModelAux.expert_load [M, E] of the step, rows in layer order; rule "center" also reads
  ModelAux.mean_logits [M, E] as `mean_logits`). params: the nnx.State of
  the model's Params (nnx.split(model, nnx.Param)); a model without selection biases (rate 0)
  is returned unchanged. Traceable: call it inside the jitted train step, after the update."""
  flat = list(nnx.to_flat_state(params))
  biased = _in_layer_order(flat, "selection_bias")
  if not biased:
    return params
  if expert_load.shape[0] != len(biased):
    raise ValueError(f"expert_load has {expert_load.shape[0]} rows, the model "
                     f"{len(biased)} MoE layers with a selection bias")
  for row, i in enumerate(biased):
    path, variable = flat[i]
    new = update_selection_bias(variable.get_value(), expert_load[row], rate, rule,
                                None if mean_logits is None else mean_logits[row])
    flat[i] = (path, variable.replace(new.astype(variable.get_value().dtype)))
  return nnx.from_flat_state(flat)


def set_selection_stats(params: nnx.State, selection_stats: jax.Array) -> nnx.State:
  """params with every MoE layer's stored selection statistics (jax_megamoe.module.
  SelectionStats: the layers of a model whose router_selection_norm is not "none") set to
  selection_stats [M, 3, E] (rows in layer order, as ModelAux.selection_stats), each kept on
  its parameter's sharding. A model without them is returned unchanged. Host-side, between
  steps (not traceable: it reads the parameters' shardings)."""
  flat = list(nnx.to_flat_state(params))
  columns = [_in_layer_order(flat, name) for name in SELECTION_STATS_PARAMS]
  layers = len(columns[0])
  if not layers:
    return params
  if selection_stats.shape[:2] != (layers, len(SELECTION_STATS_PARAMS)):
    raise ValueError(f"selection_stats must be [{layers} MoE layers, 3, E], got shape "
                     f"{selection_stats.shape}")
  for j, column in enumerate(columns):
    for row, i in enumerate(column):
      path, variable = flat[i]
      old = variable.get_value()
      new = selection_stats[row, j].astype(old.dtype)
      if new.shape != old.shape:
        raise ValueError(f"selection_stats rows must be [{old.shape[0]}] (experts), got "
                         f"{new.shape}")
      if isinstance(old, jax.Array):  # (a jitted step's in_shardings expect it there)
        new = jax.device_put(new, old.sharding)
      flat[i] = (path, variable.replace(new))
  return nnx.from_flat_state(flat)


@functools.partial(jax.jit, static_argnums=0)
def _batch_selection_stats(graphdef: nnx.GraphDef, params: nnx.State,
                           input_ids: jax.Array) -> jax.Array:
  model = nnx.merge(graphdef, params)
  model.train()  # the batch's statistics, whatever mode the graphdef was split in
  return model(input_ids, return_aux=True)[1].selection_stats


def calibrate_selection_stats(graphdef: nnx.GraphDef, params: nnx.State,
                              batches: Any) -> nnx.State:
  """params with every MoE layer's stored selection statistics (set_selection_stats) set to
  the mean, over `batches` (an iterable of input ids [B, S], at least one), of what the
  layer's router computes on a batch (ModelAux.selection_stats) at these parameters: what
  model.eval() routes with (jax_megamoe.module.SelectionStats). graphdef, params: from
  nnx.split(model, nnx.Param). A model without them is returned unchanged, and runs nothing.

  Measured on the final parameters rather than averaged over training steps: on the routing
  proxy a running average (momentum 0.1) lagged the logits' shared profile, which moves more
  per step than their spread, and routed held-out batches worse than the plain logits
  (benchmarks/ROUTING_COLLAPSE_NOTES.md, session 25)."""
  if not any(path[-1] in SELECTION_STATS_PARAMS for path, _ in nnx.to_flat_state(params)):
    return params
  total, count = None, 0
  for input_ids in batches:
    stats = _batch_selection_stats(graphdef, params, input_ids)
    total = stats if total is None else total + stats
    count += 1
  if not count:
    raise ValueError("calibrate_selection_stats needs at least one batch, got none")
  return set_selection_stats(params, total / count)


# Parameters the model reads in float32 whatever its compute dtype, by attribute name: the MoE
# router (jax_megamoe.MoE computes the logits in float32 from float32 weights), the selection
# biases (added to those logits; moved by update_selection_biases, never by gradient) and the
# stored selection statistics (applied to them; set by calibrate_selection_stats).
SELECTION_STATS_PARAMS = ("selection_mean", "selection_std", "selection_offset")
FLOAT32_PARAMS = ("router", "selection_bias") + SELECTION_STATS_PARAMS


def compute_copy(params: nnx.State, dtype: Any) -> nnx.State:
  """params as a Qwen3Moe of compute dtype `dtype` reads them: every parameter rounded to
  `dtype` (each module casts its weights, norm scales included, to the compute dtype before use)
  except FLOAT32_PARAMS, which keep their own dtype. The one place that decides it.

  A model merged from the copy computes the same function as one merged from params (its casts
  become no-ops; tests/test_compute_copy.py checks that the train step casts exactly these
  parameters) and its gradients come in the copy's dtypes: the same values, but the LM head's,
  which chunked_cross_entropy sums in float32, is rounded once to bf16. A training step keeps
  float32 master weights, differentiates the copy and writes the next copy from the updated
  master (examples/train_qwen3_moe.py, TrainState). Traceable; same tree structure as params."""
  dtype = jnp.dtype(dtype)

  def one(path, variable):
    value = variable.get_value()
    return variable.replace(value if path[-1] in FLOAT32_PARAMS else value.astype(dtype))

  return nnx.from_flat_state([(path, one(path, variable))
                              for path, variable in nnx.to_flat_state(params)])

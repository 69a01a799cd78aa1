"""Qwen3-MoE model configuration: the published shapes, a CPU-sized `tiny`, and the mapping from
a Hugging Face config.json."""

from __future__ import annotations

import dataclasses
from typing import Any

from jax_megamoe.router import SELECTION_BIAS_RULES, SELECTION_NORMS


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig:
  """Shapes and hyper-parameters of a Qwen3-MoE decoder (names follow the maths, HF names in
  brackets where they differ).

  vocab_size, hidden_size: V, H.
  num_layers [num_hidden_layers]: decoder layers.
  num_heads, num_kv_heads [num_attention_heads, num_key_value_heads]: grouped-query attention,
    num_heads % num_kv_heads == 0.
  head_dim: D; may differ from H / num_heads (it does in the published Qwen3 models).
  num_experts, top_k [num_experts, num_experts_per_tok], moe_ffn_size [moe_intermediate_size]:
    the sparse MoE blocks; each expert is a SwiGLU MLP H -> F -> H.
  dense_ffn_size [intermediate_size]: SwiGLU width of the dense MLP layers (mlp_only_layers, or
    the layers decoder_sparse_step skips).
  decoder_sparse_step, mlp_only_layers: layer i is MoE iff i not in mlp_only_layers and
    (i + 1) % decoder_sparse_step == 0 (HF's rule).
  norm_topk_prob: renormalise the top-k router weights to sum to one.
  rope_theta, rms_norm_eps, tie_word_embeddings: as in HF.
  router_aux_loss_coef: load-balancing loss coefficient used by training (HF's default 1e-3;
    the published configs below use 1e-1 for training from scratch, see there).
  router_bias_update_rate: auxiliary-loss-free balancing (DeepSeek-V3), off at 0 (the
    default). When positive every MoE layer gets a per-expert selection bias (a
    jax_megamoe.module.SelectionBias, starting at zero) added to the router logits only to
    pick the top k, and the training step moves it by this rate against the step's load
    (models.update_selection_biases; examples/train_qwen3_moe.py does). Not in HF's
    config.json: a loaded checkpoint has no bias and routes exactly as in transformers.
  router_bias_update_rule: how that step is sized (jax_megamoe.router.update_selection_bias):
    "sign" (DeepSeek-V3's fixed step, the default), "proportional" (the expert's relative
    deficit 1 - E * load times the rate) or "center" (moves the biased mean logits toward
    their mean over the experts by the rate: cancels the logit profile every token shares).
  router_selection_norm: what every MoE layer picks its top k from (jax_megamoe.route):
    "none" (Qwen3's routing, the field's default and a loaded checkpoint's), "center" or
    "standardize" (each expert's logit over the batch's tokens), or "balance" (standardised,
    plus a small fixed perturbation and per-expert offsets that even out the batch's expert
    loads; the published configs below, for training from scratch). Any norm but "none"
    also gives every MoE layer stored statistics that model.eval() routes with
    (models.calibrate_selection_stats). Not in HF's config.json:
    benchmarks/ROUTING_COLLAPSE_NOTES.md.
  init_std [initializer_range]: std of the weight matrices at initialisation, N(0, init_std^2),
    but for the two below.
  embed_init_std: std of the token embedding at initialisation. depth_scaled_init: the last
    projection of every residual branch (attention's o_proj, the experts' w_down, a dense
    MLP's down_proj) starts with std init_std / sqrt(2 * num_layers) (GPT-2's and
    Megatron-LM's scaled init). Neither is in HF's config.json: they only shape a model trained
    from scratch (a loaded checkpoint replaces every weight). Their defaults keep the routing
    at initialisation balanced: with the embedding at 0.02, each attention output (rms ~0.5,
    90% of it one vector shared by every token) swamps the token and every token picks the same
    experts (examples/README.md, "Routing at initialisation"). A tied embedding is also the LM
    head and keeps init_std.
  """

  vocab_size: int
  hidden_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  num_experts: int
  top_k: int
  moe_ffn_size: int
  dense_ffn_size: int = 0
  decoder_sparse_step: int = 1
  mlp_only_layers: tuple[int, ...] = ()
  norm_topk_prob: bool = True
  rope_theta: float = 1_000_000.0
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  router_aux_loss_coef: float = 1e-3
  router_bias_update_rate: float = 0.0
  router_bias_update_rule: str = "sign"
  router_selection_norm: str = "none"
  init_std: float = 0.02
  embed_init_std: float = 1.0
  depth_scaled_init: bool = True

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "num_experts", "top_k", "moe_ffn_size", "decoder_sparse_step"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"Qwen3MoeConfig.{name} must be a positive int, got {value!r}")
    for name in ("router_aux_loss_coef", "router_bias_update_rate"):
      value = getattr(self, name)
      if (isinstance(value, bool) or not isinstance(value, (int, float)) or value != value
          or not 0 <= value < float("inf")):
        raise ValueError(f"Qwen3MoeConfig.{name} must be a finite number >= 0, got {value!r}")
    if self.router_selection_norm not in SELECTION_NORMS:
      raise ValueError(f"Qwen3MoeConfig.router_selection_norm must be one of "
                       f"{SELECTION_NORMS}, got {self.router_selection_norm!r}")
    if self.router_bias_update_rule not in SELECTION_BIAS_RULES:
      raise ValueError(f"Qwen3MoeConfig.router_bias_update_rule must be one of "
                       f"{SELECTION_BIAS_RULES}, got {self.router_bias_update_rule!r}")
    for name in ("init_std", "embed_init_std"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"Qwen3MoeConfig.{name} must be a positive number, got {value!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"Qwen3MoeConfig.num_heads ({self.num_heads}) must be a multiple of "
                       f"num_kv_heads ({self.num_kv_heads})")
    if self.head_dim % 2:
      raise ValueError(f"Qwen3MoeConfig.head_dim must be even (RoPE), got {self.head_dim}")
    if self.top_k > self.num_experts:
      raise ValueError(f"Qwen3MoeConfig.top_k ({self.top_k}) must be <= num_experts "
                       f"({self.num_experts})")
    if any(not self.is_moe_layer(i) for i in range(self.num_layers)) and self.dense_ffn_size < 1:
      raise ValueError("Qwen3MoeConfig.dense_ffn_size must be positive when some layers are "
                       f"dense (mlp_only_layers={self.mlp_only_layers}, decoder_sparse_step="
                       f"{self.decoder_sparse_step}), got {self.dense_ffn_size}")

  def is_moe_layer(self, layer: int) -> bool:
    return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

  @property
  def num_moe_layers(self) -> int:
    return sum(self.is_moe_layer(i) for i in range(self.num_layers))

  @property
  def output_init_std(self) -> float:
    """std of the residual branches' last projections at initialisation (depth_scaled_init)."""
    if self.depth_scaled_init:
      return self.init_std / (2 * self.num_layers) ** 0.5
    return self.init_std

  @property
  def embedding_init_std(self) -> float:
    """std of the token embedding at initialisation (init_std when tied to the LM head)."""
    return self.init_std if self.tie_word_embeddings else self.embed_init_std

  def replace(self, **changes: Any) -> "Qwen3MoeConfig":
    return dataclasses.replace(self, **changes)

  def matmul_params_per_token(self) -> int:
    """Weights a token multiplies through in the forward pass (active experts only, router and
    LM head included, embedding lookup excluded): 2x this is its matmul FLOPs."""
    h, d = self.hidden_size, self.head_dim
    attention = h * d * (2 * self.num_heads + 2 * self.num_kv_heads)
    moe = self.top_k * 3 * h * self.moe_ffn_size + h * self.num_experts
    dense = 3 * h * self.dense_ffn_size
    per_layers = sum(attention + (moe if self.is_moe_layer(i) else dense)
                     for i in range(self.num_layers))
    return per_layers + h * self.vocab_size

  def train_flops_per_token(self, seq_len: int) -> float:
    """Forward + backward FLOPs per token (PaLM's estimate: 6 N + 12 L n_heads D S, with the
    causal mask's halving ignored, as is customary for MFU)."""
    attention = 12 * self.num_layers * self.num_heads * self.head_dim * seq_len
    return 6.0 * self.matmul_params_per_token() + attention

  @classmethod
  def from_hf(cls, hf: dict[str, Any]) -> "Qwen3MoeConfig":
    """From a transformers Qwen3MoeConfig dict (config.json), read as transformers reads it.

    Every field that changes the model's maths is read, in each spelling transformers accepts:
    RoPE under rope_parameters or the legacy rope_scaling (rope_type or type) and top-level
    rope_theta; num_experts or num_local_experts. The shape fields are required; the others
    default as in transformers. A setting this model does not compute (scaled RoPE, attention
    bias, sliding window, dropout, another activation, quantised weights) raises
    NotImplementedError naming the field: loading it would silently give another model. A
    missing or ill-typed field raises ValueError naming it. (pad_token_id is not read: HF only
    uses it to zero that embedding row's gradient.)
    """
    fields = _HfFields(hf)
    model_type = hf.get("model_type")
    if model_type != "qwen3_moe":
      raise ValueError(f"config.json model_type must be 'qwen3_moe', got {model_type!r}")
    unsupported = {
        "attention_bias": fields.boolean("attention_bias", False),
        "use_sliding_window": fields.boolean("use_sliding_window", False),
        "attention_dropout": fields.number("attention_dropout", 0.0, positive=False) != 0,
        "quantization_config": hf.get("quantization_config") is not None,
    }
    for name, present in unsupported.items():
      if present:
        raise NotImplementedError(f"config.json field {name}={hf[name]!r} is not supported "
                                  "(Qwen3-MoE as implemented here has none)")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):  # the same function in HF
      raise NotImplementedError(f"config.json field hidden_act must be 'silu', got "
                                f"{hf['hidden_act']!r}")
    heads = fields.integer("num_attention_heads")
    hidden = fields.integer("hidden_size")
    head_dim = hf.get("head_dim")  # absent or null: hidden / heads, as transformers
    num_experts = fields.experts()
    mlp_only = hf.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(_is_int(i) and i >= 0 for i in mlp_only):
      raise ValueError(f"config.json field mlp_only_layers must be a list of layer indices, "
                       f"got {mlp_only!r}")
    return cls(
        vocab_size=fields.integer("vocab_size"),
        hidden_size=hidden,
        num_layers=fields.integer("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=fields.integer("num_key_value_heads"),
        head_dim=hidden // heads if head_dim is None else fields.integer("head_dim"),
        num_experts=num_experts,
        top_k=fields.integer("num_experts_per_tok"),
        moe_ffn_size=fields.integer("moe_intermediate_size"),
        dense_ffn_size=fields.integer("intermediate_size", 0, minimum=0),
        decoder_sparse_step=fields.integer("decoder_sparse_step", 1),
        mlp_only_layers=tuple(mlp_only),
        norm_topk_prob=fields.boolean("norm_topk_prob", False),  # HF's default is False
        rope_theta=fields.rope_theta(),
        rms_norm_eps=fields.number("rms_norm_eps", 1e-6),
        tie_word_embeddings=fields.boolean("tie_word_embeddings", False),
        router_aux_loss_coef=fields.number("router_aux_loss_coef", 1e-3, positive=False),
        init_std=fields.number("initializer_range", 0.02),
    )


def _is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


class _HfFields:
  """Typed reads of config.json fields; errors name the field and the value."""

  _MISSING = object()

  def __init__(self, hf: dict[str, Any]):
    self.hf = hf

  def _get(self, name, default):
    value = self.hf.get(name, default)
    if value is self._MISSING:
      raise ValueError(f"config.json lacks the required field {name!r}")
    return value

  def integer(self, name: str, default: Any = _MISSING, *, minimum: int = 1) -> int:
    value = self._get(name, default)
    if not _is_int(value) or value < minimum:
      raise ValueError(f"config.json field {name} must be an integer >= {minimum}, got "
                       f"{value!r}")
    return value

  def number(self, name: str, default: float, *, positive: bool = True) -> float:
    value = self._get(name, default)
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or value != value
        or value < 0 or (positive and value == 0)):
      kind = "a positive number" if positive else "a number >= 0"
      raise ValueError(f"config.json field {name} must be {kind}, got {value!r}")
    return float(value)

  def boolean(self, name: str, default: bool) -> bool:
    value = self._get(name, default)
    if not isinstance(value, bool):
      raise ValueError(f"config.json field {name} must be true or false, got {value!r}")
    return value

  def experts(self) -> int:
    """num_experts (Qwen's spelling) or num_local_experts (what transformers 5 writes)."""
    given = {n: self.integer(n) for n in ("num_experts", "num_local_experts") if n in self.hf}
    if not given:
      raise ValueError("config.json lacks the required field 'num_experts' (or "
                       "'num_local_experts')")
    if len(set(given.values())) > 1:
      raise ValueError(f"config.json fields num_experts and num_local_experts disagree: {given}")
    return next(iter(given.values()))

  def rope_theta(self) -> float:
    """transformers takes RoPE settings from rope_scaling when it is set, else from
    rope_parameters; rope_type (legacy key: type) says which RoPE; rope_theta comes from that
    dict, else the top level, else 10,000."""
    dicts = {n: self.hf[n] for n in ("rope_scaling", "rope_parameters") if self.hf.get(n)}
    for name, rope in dicts.items():
      if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
        raise NotImplementedError(f"config.json field {name} must be one flat dict of RoPE "
                                  f"settings (per-layer RoPE is not supported), got {rope!r}")
      key = "rope_type" if "rope_type" in rope else "type"
      rope_type = rope.get(key, "default")
      if rope_type != "default":
        raise NotImplementedError(
            f"config.json field {name}: rope_type {rope_type!r} (key {key!r}) is not supported "
            f"(only 'default' RoPE is implemented; loading it would compute another model)")
    top = self.hf.get("rope_theta", 10_000.0)
    thetas = {n: d.get("rope_theta", top) for n, d in dicts.items()} or {"rope_theta": top}
    if len(set(thetas.values())) > 1:
      raise ValueError(f"config.json gives rope_scaling and rope_parameters that disagree on "
                       f"rope_theta: {thetas}")
    value = next(iter(thetas.values()))
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
      raise ValueError(f"config.json field rope_theta must be a positive number, got {value!r}")
    return float(value)


# The published models (config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B), but for
# router_aux_loss_coef: 1e-1, not config.json's 1e-3, for training from scratch (a checkpoint
# loaded with --init-from keeps its config.json's value). Trained from scratch on the example's
# byte corpus, 1e-3 (and 1e-2) let every token's normed hidden state become nearly one shared
# vector within 20-40 steps, whose router logits then put the same expert in every token's top
# 8 (imbalance 16 of 16); at CPU widths 1e-1 holds the routing where it was at initialisation
# (benchmarks/ROUTING_COLLAPSE_NOTES.md, tests/test_routing_balance.py). At the published width
# on an H200 it does not hold it through steps 20-50 (16 -> 14.4) but pulls it back by step 60
# (7.7, where 1e-3 stays at 16), at the same loss: better than 1e-3, not a fix.
ROUTER_AUX_LOSS_COEF_FROM_SCRATCH = 1e-1
# And router_selection_norm "balance", not Qwen3's "none", for the same reason: with aux 1e-1
# alone the published shapes still reach 16 on the byte corpus (6.75-16 over the first 50
# steps on an H200); with "balance" they stay at 1.31-2.39 (1.65 at step 50), at the same
# loss, for 1.3% more step time (benchmarks/RESULTS.md, session 24). Its stored statistics
# for inference are calibrated by the example before each checkpoint. A checkpoint loaded
# with --init-from keeps "none", so it routes exactly as in transformers.
ROUTER_SELECTION_NORM_FROM_SCRATCH = "balance"
CONFIGS: dict[str, Qwen3MoeConfig] = {
    # CPU-sized: trains visibly in a few minutes on two cores with the byte tokenizer. A
    # stronger load-balancing weight than Qwen3's 1e-3: at this size and learning rate the
    # router otherwise sends half of all slots to one expert within 50 steps.
    "tiny": Qwen3MoeConfig(
        vocab_size=320, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=32, num_experts=8, top_k=2, moe_ffn_size=64, dense_ffn_size=256,
        rope_theta=10_000.0, router_aux_loss_coef=1e-2),
    "qwen3-30b-a3b": Qwen3MoeConfig(
        vocab_size=151_936, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4,
        head_dim=128, num_experts=128, top_k=8, moe_ffn_size=768, dense_ffn_size=6144,
        router_aux_loss_coef=ROUTER_AUX_LOSS_COEF_FROM_SCRATCH,
        router_selection_norm=ROUTER_SELECTION_NORM_FROM_SCRATCH),
    "qwen3-235b-a22b": Qwen3MoeConfig(
        vocab_size=151_936, hidden_size=4096, num_layers=94, num_heads=64, num_kv_heads=4,
        head_dim=128, num_experts=128, top_k=8, moe_ffn_size=1536, dense_ffn_size=12288,
        router_aux_loss_coef=ROUTER_AUX_LOSS_COEF_FROM_SCRATCH,
        router_selection_norm=ROUTER_SELECTION_NORM_FROM_SCRATCH),
}


def get_config(name: str, **overrides: Any) -> Qwen3MoeConfig:
  """A named config (`tiny`, `qwen3-30b-a3b`, `qwen3-235b-a22b`) with fields overridden."""
  if name not in CONFIGS:
    raise ValueError(f"config must be one of {sorted(CONFIGS)}, got {name!r}")
  return CONFIGS[name].replace(**overrides)

"""Qwen3-MoE model configuration: the published shapes, a CPU-sized `tiny`, and the mapping from
a Hugging Face config.json."""

from __future__ import annotations

import dataclasses
from typing import Any


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
  router_aux_loss_coef: load-balancing loss coefficient used by training (HF's default 1e-3).
  init_std [initializer_range]: std of every weight at initialisation.
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
  init_std: float = 0.02

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "num_experts", "top_k", "moe_ffn_size", "decoder_sparse_step"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"Qwen3MoeConfig.{name} must be a positive int, got {value!r}")
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
    """From a transformers Qwen3MoeConfig dict (config.json). Raises on features this model
    does not implement (attention bias, sliding window, scaled RoPE)."""
    model_type = hf.get("model_type")
    if model_type != "qwen3_moe":
      raise ValueError(f"config.json model_type must be 'qwen3_moe', got {model_type!r}")
    if hf.get("attention_bias", False):
      raise NotImplementedError("attention_bias=True is not supported (Qwen3 has none)")
    if hf.get("use_sliding_window", False):
      raise NotImplementedError("use_sliding_window=True is not supported")
    if hf.get("hidden_act", "silu") != "silu":
      raise NotImplementedError(f"hidden_act must be 'silu', got {hf['hidden_act']!r}")
    # transformers >= 5 writes RoPE settings under rope_parameters; older files use top-level
    # rope_theta / rope_scaling.
    rope = hf.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", (hf.get("rope_scaling") or {}).get("rope_type", "default"))
    if rope_type != "default":
      raise NotImplementedError(f"rope_type {rope_type!r} is not supported (only 'default')")
    num_experts = hf.get("num_experts", hf.get("num_local_experts"))
    heads = hf["num_attention_heads"]
    return cls(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads", heads),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        num_experts=num_experts,
        top_k=hf["num_experts_per_tok"],
        moe_ffn_size=hf["moe_intermediate_size"],
        dense_ffn_size=hf.get("intermediate_size", 0),
        decoder_sparse_step=hf.get("decoder_sparse_step", 1),
        mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
        norm_topk_prob=hf.get("norm_topk_prob", False),  # HF's default is False
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0))),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        router_aux_loss_coef=hf.get("router_aux_loss_coef", 1e-3),
        init_std=hf.get("initializer_range", 0.02),
    )


# The published models (config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B).
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
        head_dim=128, num_experts=128, top_k=8, moe_ffn_size=768, dense_ffn_size=6144),
    "qwen3-235b-a22b": Qwen3MoeConfig(
        vocab_size=151_936, hidden_size=4096, num_layers=94, num_heads=64, num_kv_heads=4,
        head_dim=128, num_experts=128, top_k=8, moe_ffn_size=1536, dense_ffn_size=12288),
}


def get_config(name: str, **overrides: Any) -> Qwen3MoeConfig:
  """A named config (`tiny`, `qwen3-30b-a3b`, `qwen3-235b-a22b`) with fields overridden."""
  if name not in CONFIGS:
    raise ValueError(f"config must be one of {sorted(CONFIGS)}, got {name!r}")
  return CONFIGS[name].replace(**overrides)

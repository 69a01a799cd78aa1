"""jax_megamoe: fast expert-parallel mixture-of-experts layers for JAX.

Public API:
  route(logits, top_k, *, norm_topk_prob=True) -> (topk_weights, topk_ids, aux)
  moe(x, topk_ids, topk_weights, w_gate_up, w_down, *, mesh=None, expert_axis="expert",
      backend="auto", recipe=None, weight_blocks=None) -> y
  quantize_expert_weights(w_gate_up, w_down, recipe="fp8", *, mesh=None, expert_axis="expert")
      -> ExpertWeightBlocks   (FP8 weights quantised once for several moe calls)
  MoE(hidden_size, ffn_size, num_experts, top_k, *, rngs, ...)   Flax NNX module
  build_info(), cuda_available()
"""

from jax_megamoe._ffi import build_info, cuda_available
from jax_megamoe._ffi import register_targets as _register_targets
from jax_megamoe.router import RouterAux, route
from jax_megamoe.moe import BACKENDS, RECIPES, moe
from jax_megamoe.module import MoE
from jax_megamoe.weight_blocks import ExpertWeightBlocks, quantize_expert_weights

_register_targets()

__all__ = ["BACKENDS", "RECIPES", "ExpertWeightBlocks", "MoE", "RouterAux", "build_info",
           "cuda_available", "moe", "quantize_expert_weights", "route"]
__version__ = "0.1.0"

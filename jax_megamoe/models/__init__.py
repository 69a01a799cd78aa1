"""Models built on jax_megamoe.MoE: Qwen3-MoE (qwen3), its config (config), Hugging Face import
(hf_import), the FSDP + expert-parallel parameter layout used for training (sharding), and the
token-embedding lookup with an id-summed gradient (embedding)."""

from jax_megamoe.models.config import CONFIGS, Qwen3MoeConfig, get_config
from jax_megamoe.models.embedding import embedding_lookup
from jax_megamoe.models.qwen3 import (FLOAT32_PARAMS, REMAT_POLICIES, ModelAux, Qwen3Moe,
                                      calibrate_selection_stats, compute_copy,
                                      set_selection_stats, update_selection_biases)
from jax_megamoe.models.hf_import import load_hf_checkpoint

__all__ = ["CONFIGS", "FLOAT32_PARAMS", "REMAT_POLICIES", "ModelAux", "Qwen3Moe",
           "Qwen3MoeConfig", "calibrate_selection_stats", "compute_copy", "embedding_lookup",
           "get_config", "load_hf_checkpoint", "set_selection_stats", "update_selection_biases"]

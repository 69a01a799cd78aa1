"""Which backend "auto" picks for a layer (CPU: the rules, whatever this machine can run)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import jax
from jax_megamoe.backends import fused
from jax_megamoe.validation import check_layer_args


def _shape(dtype=jnp.bfloat16, hidden=256, ffn=128, experts=8, top_k=2):
  x = jnp.ones((16, hidden), dtype)
  ids = jnp.tile(jnp.arange(top_k, dtype=jnp.int32), (16, 1))
  w = jnp.ones((16, top_k), jnp.float32)
  return check_layer_args(x, ids, w, jnp.ones((experts, hidden, 2 * ffn), dtype),
                          jnp.ones((experts, ffn, hidden), dtype))


def test_fused_is_auto_only_for_layers_it_takes_on_one_gpu():
  assert fused.auto_reason(_shape(), None, "expert") is None
  assert "bfloat16" in fused.auto_reason(_shape(dtype=jnp.float32), None, "expert")
  assert "multiple of 256" in fused.auto_reason(_shape(hidden=128), None, "expert")
  mesh = Mesh(np.array(jax.devices()[:2]), ("expert",))
  across = dataclasses.replace(_shape(), ep_size=2, num_devices=2)
  assert "across GPUs" in fused.auto_reason(across, mesh, "expert")
  one_rank = dataclasses.replace(_shape(), ep_size=1, num_devices=2)
  assert fused.auto_reason(one_rank, mesh, "expert") is None

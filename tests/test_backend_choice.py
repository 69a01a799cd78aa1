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


def test_fused_is_auto_only_for_layers_it_takes_on_one_gpu(monkeypatch):
  """Once switched on: fused where it has run (one GPU, one process, a layer the kernel takes),
  cuda elsewhere."""
  monkeypatch.setattr(fused, "AUTO_PICKS_FUSED", True)
  assert fused.auto_reason(_shape(), None, "expert") is None
  assert "bfloat16" in fused.auto_reason(_shape(dtype=jnp.float32), None, "expert")
  assert "multiple of 256" in fused.auto_reason(_shape(hidden=128), None, "expert")
  mesh = Mesh(np.array(jax.devices()[:2]), ("expert",))
  across = dataclasses.replace(_shape(), ep_size=2, num_devices=2)
  assert "across GPUs" in fused.auto_reason(across, mesh, "expert")
  data_parallel = dataclasses.replace(_shape(), ep_size=1, num_devices=2)
  assert "a mesh of 2 devices" in fused.auto_reason(data_parallel, mesh, "expert")
  one_device = Mesh(np.array(jax.devices()[:1]), ("expert",))
  assert fused.auto_reason(_shape(), one_device, "expert") is None


def test_auto_leaves_fused_to_cuda_in_multi_process_jobs(monkeypatch):
  monkeypatch.setattr(fused, "AUTO_PICKS_FUSED", True)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  assert "multi-process" in fused.auto_reason(_shape(), None, "expert")


def test_auto_leaves_fused_to_explicit_requests_while_the_step_measures_no_faster():
  """Measured (RESULTS session 41): the example's step on an H200 is at parity with fused, so
  "auto" serves every layer with cuda."""
  assert not fused.AUTO_PICKS_FUSED
  assert "training step" in fused.auto_reason(_shape(), None, "expert")

"""The training example stops on a real timed-out expert-parallel kernel: a dispatch run on one
GPU of a 2-rank workspace waits for a peer that never sends (as in test_ep_dispatch_combine.py);
its output is poisoned with NaN (so the step's loss is not finite and the example's guard keeps
the state and stops before any save), and ep_workspace_errors() reports rank and stage, which
the example puts in its message. Run on a 2-GPU machine:
pytest -m multigpu tests/test_example_ep_errors.py"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jax_megamoe import parallel, symmetric
from jax_megamoe.backends import cuda_ep
import ep_helpers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import train_qwen3_moe as example  # noqa: E402

sys.path.pop(0)

pytestmark = pytest.mark.multigpu
TOKENS, HIDDEN, EXPERTS, TOP_K = 64, 128, 8, 4


def test_timed_out_dispatch_is_reported_by_the_example(monkeypatch):
  mesh = Mesh(np.array(jax.devices()[:2]), ("expert",))
  own = symmetric.create_workspace(mesh, "expert", max_tokens=TOKENS, hidden=HIDDEN, top_k=8,
                                   dtype=jnp.float32, comm_blocks=4, timeout_s=1.0)
  # Where the backends keep the workspaces they create (symmetric.workspace_for).
  monkeypatch.setitem(symmetric._cache, ("test_example_ep_errors",), own)
  assert example.ep_workspace_errors() == []
  single = Mesh(np.array(jax.devices()[:1]), ("expert",))
  rng = np.random.default_rng(0)
  ids, w = ep_helpers.routing(rng, TOKENS, EXPERTS, TOP_K, mask_fraction=0.0)
  x = jnp.asarray(rng.standard_normal((TOKENS, HIDDEN)), jnp.float32)

  def per_device(x, ids, w):
    return cuda_ep.dispatch(x, ids, w, workspace=own, num_experts=EXPERTS).x_sorted

  f = jax.jit(parallel.shard_map(per_device, single, (P("expert"),) * 3, P("expert"),
                                 check_vma=False))
  out = np.asarray(jax.block_until_ready(f(x, jnp.asarray(ids, jnp.int32), jnp.asarray(w))))
  assert np.isnan(out).all(), "a timed-out dispatch returned rows that look valid"
  errors = example.ep_workspace_errors()
  assert len(errors) == 1 and "rank 0 timed out" in errors[0] and "dispatch" in errors[0]

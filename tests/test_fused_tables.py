"""The expert side's slot tables of backend "fused" (fused.expert_rank_tables), on CPU: what each
expert rank's backward reads in place of cuda's dispatch (its slot_pos and recv_w), built from
every source's slot table. A hand-made case against tables written out by hand, and the
shard_map path (an all_gather over the expert axis, one rank per CPU device) against a virtual
group's stacked path. On the GPU, test_fused_moe.py checks them against cuda's dispatch."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jax_megamoe.backends import cuda_ep, fused

NR, DROP = cuda_ep.SLOT_NOT_ROUTED, cuda_ep.SLOT_DROPPED


def _config(num_ranks: int, num_experts: int, virtual: bool) -> fused.FusedConfig:
  # Only the workspace's rank count, expert axis and kind are read.
  workspace = types.SimpleNamespace(num_ranks=num_ranks, expert_axis="expert", virtual=virtual)
  return fused.FusedConfig(workspace, num_experts, plan=None, max_ctas=0)


def test_two_ranks_by_hand():
  """2 ranks x 2 tokens, top 2, 4 experts (rank 0: experts 0-1, rank 1: 2-3). Source 0: token 0
  -> experts 1 (pool row 5 of rank 0) and 2 (row 0 of rank 1); token 1 -> expert 3 twice (the
  repeat dropped: -1 in slot_dest). Source 1: token 0 -> expert 0 (row 3) and a masked slot;
  token 1 -> expert 2, dropped at capacity (-1), and expert 0 (row 4)."""
  dest = jnp.array([[[5, 0], [1, -1]], [[3, -1], [-1, 4]]], jnp.int32)
  ids = jnp.array([[[1, 2], [3, 3]], [[0, -1], [2, 0]]], jnp.int32)
  w = jnp.array([[[.1, .2], [.3, .4]], [[.5, .6], [.7, .8]]], jnp.float32)
  pos, recv_w = fused.expert_rank_tables(dest, ids, w, _config(2, 4, virtual=True))
  # rows: (source 0, token 0), (0, 1), (1, 0), (1, 1)
  want_pos = np.array([
      [[5, NR], [NR, NR], [3, NR], [NR, 4]],          # rank 0
      [[NR, 0], [1, DROP], [NR, NR], [DROP, NR]],     # rank 1
  ], np.int32)
  want_w = np.array([
      [[.1, 0], [0, 0], [.5, 0], [0, .8]],
      [[0, .2], [.3, 0], [0, 0], [0, 0]],
  ], np.float32)
  np.testing.assert_array_equal(np.asarray(pos), want_pos)
  np.testing.assert_array_equal(np.asarray(recv_w), want_w)
  assert recv_w.dtype == jnp.float32


def test_one_rank_keeps_its_own_table():
  """One rank (no gather): the kernel's slot_dest, with dropped slots of routed experts as
  SLOT_DROPPED and masked ones as SLOT_NOT_ROUTED."""
  dest = jnp.array([[2, -1], [0, 1]], jnp.int32)
  ids = jnp.array([[3, -1], [0, 0]], jnp.int32)
  w = jnp.array([[.25, .5], [.75, 1.0]], jnp.float32)
  pos, recv_w = fused.expert_rank_tables(dest, ids, w, _config(1, 4, virtual=False))
  np.testing.assert_array_equal(np.asarray(pos), [[2, NR], [0, 1]])
  np.testing.assert_array_equal(np.asarray(recv_w), [[.25, 0], [.75, 1.0]])
  ids = ids.at[1, 1].set(3)
  pos, _ = fused.expert_rank_tables(dest.at[1, 1].set(-1), ids, w, _config(1, 4, virtual=False))
  assert int(pos[1, 1]) == DROP


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_shard_map_gathers_what_a_virtual_group_stacks(num_ranks):
  """Inside shard_map (one rank per device, as backend "fused" runs across GPUs) each rank
  gathers every source's table over the expert axis: the same tables as the stacked path."""
  if len(jax.devices()) < num_ranks:
    pytest.skip(f"not run: needs {num_ranks} devices, has {len(jax.devices())}")
  tokens, top_k, experts = 37, 3, 8
  rng = np.random.default_rng(num_ranks)
  ids = rng.integers(-1, experts, (num_ranks, tokens, top_k)).astype(np.int32)
  dest = np.where((ids >= 0) & (rng.random(ids.shape) < 0.9),
                  rng.integers(0, 500, ids.shape), -1).astype(np.int32)
  w = rng.random(ids.shape).astype(np.float32)
  want = fused.expert_rank_tables(jnp.asarray(dest), jnp.asarray(ids), jnp.asarray(w),
                                  _config(num_ranks, experts, virtual=True))
  mesh = Mesh(np.array(jax.devices()[:num_ranks]), ("expert",))
  cfg = _config(num_ranks, experts, virtual=False)
  per_rank = lambda d, i, w: jax.tree.map(
      lambda a: a[None], fused.expert_rank_tables(d[0], i[0], w[0], cfg))
  got = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=P("expert"),
                              out_specs=P("expert")))(dest, ids, w)
  for g, want_a in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(want_a))

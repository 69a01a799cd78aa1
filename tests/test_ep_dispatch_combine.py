"""Expert-parallel dispatch/combine kernels on 2 GPUs driven by one process (JAX's default).

Parity with independent oracles (forward and gradients), skewed routing, a rank that receives
nothing, many consecutive calls, loops and scans of layers, bitwise reproducibility, overflow.
Run on a 2-GPU machine: pytest -m multigpu tests/test_ep_dispatch_combine.py
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jax_megamoe import parallel, symmetric
from jax_megamoe.backends import cuda_ep
import ep_helpers

pytestmark = pytest.mark.multigpu

T_PER_DEVICE, HIDDEN, FFN, EXPERTS, TOP_K = 64, 128, 64, 8, 4


@pytest.fixture(scope="module")
def mesh():
  return Mesh(np.array(jax.devices()[:2]), ("expert",))


@pytest.fixture(scope="module")
def ws(mesh):
  workspace = symmetric.create_workspace(mesh, "expert", max_tokens=T_PER_DEVICE, hidden=HIDDEN,
                                         top_k=8, dtype=jnp.float32, comm_blocks=16,
                                         timeout_s=20.0)
  yield workspace
  workspace.check()
  workspace.close()


def _poison(mesh):
  """Fill free device memory with NaN so that output rows a kernel forgets show up."""
  junk = [jax.device_put(jnp.full((1 << 22,), jnp.nan, jnp.float32), d) for d in mesh.devices.flat]
  jax.block_until_ready(junk)
  del junk


def _problem(seed, dtype=jnp.float32, mask_fraction=0.1, tokens=2 * T_PER_DEVICE, ids=None):
  rng = np.random.default_rng(seed)
  if ids is None:
    ids, w = ep_helpers.routing(rng, tokens, EXPERTS, TOP_K, mask_fraction=mask_fraction)
  else:
    w = rng.random(ids.shape).astype(np.float32)
  x = jnp.asarray(rng.standard_normal((tokens, HIDDEN)), dtype)
  wgu, wd = ep_helpers.weights_for(rng, EXPERTS, HIDDEN, FFN, dtype)
  return x, jnp.asarray(ids, jnp.int32), jnp.asarray(w), wgu, wd


def _layer(mesh, ws, **kw):
  return functools.partial(cuda_ep.expert_parallel_moe, mesh=mesh, workspace=ws,
                           mlp=ep_helpers.dense_grouped_mlp, **kw)


def _loss_fn(layer, probe):
  def loss(x, w, wgu, wd, ids):
    return jnp.sum(layer(x, ids, w, wgu, wd).astype(jnp.float32) * probe)
  return loss


TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def test_dispatch_layout(mesh, ws):
  """x_sorted holds, per local expert, the rows of its (source rank, token) slots in order."""
  x, ids, w, _, _ = _problem(1)
  n_cap = cuda_ep.dropless_capacity(2, T_PER_DEVICE, TOP_K, EXPERTS // 2)

  def per_device(x, ids, w):
    d = cuda_ep.dispatch(x, ids, w, workspace=ws, num_experts=EXPERTS, n_cap=n_cap)
    return d.x_sorted, d.group_sizes, d.slot_pos, d.recv_w, d.stats

  f = jax.jit(parallel.shard_map(per_device, mesh, (P("expert"),) * 3, (P("expert"),) * 5,
                                 check_vma=False))
  _poison(mesh)
  xs, gs, pos, rw, stats = (np.asarray(a) for a in f(x, ids, w))
  x, ids, w = np.asarray(x), np.asarray(ids), np.asarray(w)
  epr = EXPERTS // 2
  for rank in range(2):
    xs_r = xs[rank * n_cap:(rank + 1) * n_cap]
    gs_r = gs[rank * epr:(rank + 1) * epr]
    pos_r = pos[rank * 2 * T_PER_DEVICE:(rank + 1) * 2 * T_PER_DEVICE]
    rw_r = rw[rank * 2 * T_PER_DEVICE:(rank + 1) * 2 * T_PER_DEVICE]
    expected_rows, expected_sizes = [], []
    for e in range(epr):
      rows = [(t, j) for t in range(2 * T_PER_DEVICE) for j in range(TOP_K)
              if ids[t, j] == rank * epr + e]  # (source, token) order == global token order
      expected_sizes.append(len(rows))
      expected_rows += rows
    np.testing.assert_array_equal(gs_r, expected_sizes)
    total = len(expected_rows)
    np.testing.assert_array_equal(stats[rank * 4:rank * 4 + 4], [total, n_cap, 0, 0])
    np.testing.assert_array_equal(xs_r[:total], x[[t for t, _ in expected_rows]])
    np.testing.assert_array_equal(xs_r[total:], 0)
    for p, (t, j) in enumerate(expected_rows):
      assert pos_r[t, j] == p and rw_r[t, j] == w[t, j]
    routed_here = (ids // epr) == rank
    assert np.all(pos_r[~routed_here] == -1) and np.all(rw_r[~routed_here] == 0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("seed", [2, 3])
def test_forward_parity(mesh, ws, dtype, seed):
  x, ids, w, wgu, wd = _problem(seed, dtype)
  _poison(mesh)
  y = jax.jit(_layer(mesh, ws))(x, ids, w, wgu, wd)
  assert y.dtype == dtype and y.shape == x.shape
  expected = ep_helpers.dense_moe(x, ids, w, wgu, wd)
  assert ep_helpers.rel_err(y, expected) < TOL[dtype]


def test_forward_parity_with_reference_backend(mesh, ws):
  import jax_megamoe
  x, ids, w, wgu, wd = _problem(4)
  y = jax.jit(_layer(mesh, ws))(x, ids, w, wgu, wd)
  ref = jax.jit(functools.partial(jax_megamoe.moe, backend="reference", mesh=mesh))(
      x, ids, w, wgu, wd)
  assert ep_helpers.rel_err(y, ref) < 1e-5


def _check_grads(mesh, ws, x, ids, w, wgu, wd, tol):
  probe = jnp.asarray(np.random.default_rng(7).standard_normal(x.shape), jnp.float32)
  grad = jax.grad(_loss_fn(_layer(mesh, ws), probe), argnums=(0, 1, 2, 3))
  oracle = jax.grad(lambda x, w, wgu, wd, ids: jnp.sum(
      ep_helpers.dense_moe(x, ids, w, wgu, wd) * probe), argnums=(0, 1, 2, 3))
  _poison(mesh)
  got = jax.jit(grad)(x, w, wgu, wd, ids)
  want = oracle(x, w, wgu, wd, ids)
  for name, g, e in zip(("x", "topk_weights", "w_gate_up", "w_down"), got, want):
    assert np.all(np.isfinite(np.asarray(g, np.float32))), name
    assert ep_helpers.rel_err(g, e) < tol, (name, ep_helpers.rel_err(g, e))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gradients(mesh, ws, dtype):
  x, ids, w, wgu, wd = _problem(5, dtype)
  _check_grads(mesh, ws, x, ids, w, wgu, wd, 2e-5 if dtype == jnp.float32 else 2e-2)


def test_skewed_all_tokens_to_one_expert(mesh, ws):
  ids = np.full((2 * T_PER_DEVICE, TOP_K), -1, np.int32)
  ids[:, 0] = 0  # every token -> expert 0 on rank 0; rank 1 receives nothing
  x, ids, w, wgu, wd = _problem(6, ids=ids)
  y = jax.jit(_layer(mesh, ws))(x, ids, w, wgu, wd)
  assert ep_helpers.rel_err(y, ep_helpers.dense_moe(x, ids, w, wgu, wd)) < 1e-5
  _check_grads(mesh, ws, x, ids, w, wgu, wd, 2e-5)


@pytest.mark.parametrize("rank", [0, 1])
def test_one_rank_receives_nothing(mesh, ws, rank):
  epr = EXPERTS // 2
  other = 1 - rank
  rng = np.random.default_rng(8)
  ids = np.stack([rng.permutation(epr)[:TOP_K] + other * epr for _ in range(2 * T_PER_DEVICE)])
  x, ids, w, wgu, wd = _problem(8, ids=ids.astype(np.int32))
  y = jax.jit(_layer(mesh, ws))(x, ids, w, wgu, wd)
  assert ep_helpers.rel_err(y, ep_helpers.dense_moe(x, ids, w, wgu, wd)) < 1e-5
  _check_grads(mesh, ws, x, ids, w, wgu, wd, 2e-5)


def test_all_slots_masked(mesh, ws):
  x, ids, w, wgu, wd = _problem(9, ids=np.full((2 * T_PER_DEVICE, TOP_K), -1, np.int32))
  y = jax.jit(_layer(mesh, ws))(x, ids, w, wgu, wd)
  np.testing.assert_array_equal(np.asarray(y), 0)


def test_many_consecutive_calls(mesh, ws):
  """Alternating routings, 200 calls: each result bitwise equal to its first run."""
  f = jax.jit(_layer(mesh, ws))
  problems = [_problem(10), _problem(11, mask_fraction=0.5)]
  first = [np.asarray(f(*p)) for p in problems]
  outs = [f(*problems[i % 2]) for i in range(200)]
  for i, out in enumerate(outs):
    np.testing.assert_array_equal(np.asarray(out), first[i % 2])
  assert ep_helpers.rel_err(first[1], ep_helpers.dense_moe(*problems[1])) < 1e-5


def test_fori_loop_of_layers(mesh, ws):
  x, ids, w, wgu, wd = _problem(12)
  layer = _layer(mesh, ws)

  # A residual step keeps the map well conditioned: 30 chained layers must not amplify rounding.
  def body(_, h):
    return h + 0.05 * layer(h, ids, w, wgu, wd)

  looped = jax.jit(lambda h: jax.lax.fori_loop(0, 30, body, h))(x)
  h = x
  for _ in range(30):
    h = h + 0.05 * ep_helpers.dense_moe(h, ids, w, wgu, wd)
  assert ep_helpers.rel_err(looped, h) < 1e-5


def test_scan_of_layers_with_gradients(mesh, ws):
  rng = np.random.default_rng(13)
  layers = 4
  x, _, _, _, _ = _problem(13)
  routes = [ep_helpers.routing(rng, x.shape[0], EXPERTS, TOP_K) for _ in range(layers)]
  ids = jnp.asarray(np.stack([r[0] for r in routes]))
  w = jnp.asarray(np.stack([r[1] for r in routes]))
  wgu = jnp.asarray(rng.standard_normal((layers, EXPERTS, HIDDEN, 2 * FFN)) / np.sqrt(HIDDEN),
                    jnp.float32)
  wd = jnp.asarray(rng.standard_normal((layers, EXPERTS, FFN, HIDDEN)) / np.sqrt(FFN),
                   jnp.float32)

  def net(moe_fn, x, w, wgu, wd):
    def step(h, params):
      ids_l, w_l, wgu_l, wd_l = params
      return h + moe_fn(h, ids_l, w_l, wgu_l, wd_l), None
    h, _ = jax.lax.scan(step, x, (ids, w, wgu, wd))
    return jnp.sum(jnp.tanh(h))

  layer = _layer(mesh, ws)
  got = jax.jit(jax.value_and_grad(functools.partial(net, layer), argnums=(0, 1, 2, 3)))(
      x, w, wgu, wd)
  want = jax.value_and_grad(functools.partial(net, ep_helpers.dense_moe), argnums=(0, 1, 2, 3))(
      x, w, wgu, wd)
  assert ep_helpers.rel_err(got[0], want[0]) < 1e-5
  for g, e in zip(got[1], want[1]):
    assert ep_helpers.rel_err(g, e) < 5e-5


def test_bitwise_reproducible(mesh, ws):
  """y, dx and d topk_weights: everything the EP kernels produce or feed. (The test's grouped MLP
  scatters its weight gradients with float atomics, so the weight gradients are not compared.)"""
  x, ids, w, wgu, wd = _problem(14, jnp.bfloat16)
  probe = jnp.asarray(np.random.default_rng(15).standard_normal(x.shape), jnp.float32)
  f = jax.jit(jax.value_and_grad(_loss_fn(_layer(mesh, ws), probe), argnums=(0, 1)))
  a = jax.tree.map(np.asarray, f(x, w, wgu, wd, ids))
  _poison(mesh)
  b = jax.tree.map(np.asarray, f(x, w, wgu, wd, ids))
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert u.tobytes() == v.tobytes()


def test_workspace_has_no_error(ws):
  ws.check()


def test_overflow_raises_clear_error(mesh):
  """Capacity below what the routing needs: a clear error, not silent corruption. Own workspace
  (a failed host callback may leave the group out of step)."""
  own = symmetric.create_workspace(mesh, "expert", max_tokens=T_PER_DEVICE, hidden=HIDDEN,
                                   top_k=8, dtype=jnp.float32, comm_blocks=4, timeout_s=5.0)
  # Every token sends all 4 slots to rank 0: 512 rows there, capacity 128 rows.
  ids = np.tile(np.arange(TOP_K, dtype=np.int32), (2 * T_PER_DEVICE, 1))
  x, ids, w, wgu, wd = _problem(16, ids=ids)
  layer = _layer(mesh, own, capacity_factor=0.05)
  assert cuda_ep.capacity_rows(2, T_PER_DEVICE, TOP_K, EXPERTS // 2, 0.05) == 128
  with pytest.raises(Exception, match="overflow"):
    jax.block_until_ready(jax.jit(layer)(x, ids, w, wgu, wd))


def test_timeout_reports_rank_stage_counters(mesh):
  """A dispatch run on one GPU of a 2-rank workspace waits for a peer that never sends: the wait
  gives up after timeout_s, and the next call raises a report naming rank, stage and counters."""
  own = symmetric.create_workspace(mesh, "expert", max_tokens=T_PER_DEVICE, hidden=HIDDEN,
                                   top_k=8, dtype=jnp.float32, comm_blocks=4, timeout_s=1.0)
  single = Mesh(np.array(jax.devices()[:1]), ("expert",))
  x, ids, w, _, _ = _problem(17, tokens=T_PER_DEVICE)

  def per_device(x, ids, w):
    return cuda_ep.dispatch(x, ids, w, workspace=own, num_experts=EXPERTS).x_sorted

  f = jax.jit(parallel.shard_map(per_device, single, (P("expert"),) * 3, P("expert"),
                                 check_vma=False))
  jax.block_until_ready(f(x, ids, w))  # returns after the timeout, records the error
  with pytest.raises(RuntimeError, match=r"rank 0 timed out .* dispatch \(forward\), receive.*"
                                         r"peer rank 1: counter 0, expected >= 4"):
    own.check()
  with pytest.raises(Exception, match="rank 0 timed out"):
    jax.block_until_ready(f(x, ids, w))

"""Every EP kernel at R = 1..8 ranks on one GPU, through virtual ranks (jax_megamoe.virtual_ranks).

The virtual group's layer is the EP layer of R GPUs, so it must compute jax_megamoe.moe over the
R * T tokens (backend "reference", one device), forward and every gradient: float32 within
1e-5 (the EP kernels move and sum in float32; the reference MLP runs inside), bf16 with the
CUTLASS MLP within 1e-2, recipe "fp8" (rows on the wire in FP8) against the reference emulation.
Outputs land in device memory filled with NaN beforehand, so a row a kernel forgets shows up.
GPU only (one device is enough); skipped, and reported as not run, elsewhere.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_megamoe as jm
from jax_megamoe import fp8, virtual_ranks
from jax_megamoe.backends import cuda, cuda_fp8, reference
import ep_helpers
from ep_helpers import value_and_grads

pytestmark = pytest.mark.gpu

RANKS = (1, 2, 3, 4, 8)
TOKENS = 96        # per rank: not a multiple of 32 (the sort's chunk) nor of 128 (GEMM tiles)
EXPERTS = 24       # divides by every R above
TOP_K = 4
HIDDEN, FFN = 256, 128


def _poison():
  junk = [jnp.full((1 << 24,), jnp.nan, jnp.float32) for _ in range(4)]
  jax.block_until_ready(junk)
  del junk


@functools.cache
def _workspace(num_ranks: int, elem_bytes: int, timeout_s: float = 30.0):
  dtype = {4: jnp.float32, 2: jnp.bfloat16}[elem_bytes]
  return virtual_ranks.create_workspace(num_ranks, max_tokens=TOKENS, hidden=HIDDEN,
                                        top_k=TOP_K, dtype=dtype, timeout_s=timeout_s)


def _routing(rng, num_ranks, kind):
  """ids [R*T, k] of a routing kind, weights [R*T, k] float32."""
  n = num_ranks * TOKENS
  epr = EXPERTS // num_ranks
  if kind == "uniform":
    return ep_helpers.routing(rng, n, EXPERTS, TOP_K)
  if kind == "masked":
    return ep_helpers.routing(rng, n, EXPERTS, TOP_K, mask_fraction=0.3)
  if kind == "one_expert":  # every token's first slot on expert 0 (others distinct, elsewhere)
    ids, w = ep_helpers.routing(rng, n, EXPERTS - 1, TOP_K)
    ids = np.where(ids >= 0, ids + 1, ids)
    ids[:, 0] = 0
    return ids.astype(np.int32), w
  if kind == "one_rank":  # every slot on rank 0's experts (slots past them masked)
    k = min(TOP_K, epr)
    ids, w = ep_helpers.routing(rng, n, epr, k)
    ids = np.concatenate([ids, np.full((n, TOP_K - k), -1, np.int32)], axis=1)
    w = np.concatenate([w, np.zeros((n, TOP_K - k), np.float32)], axis=1)
    return ids, w
  if kind == "idle_rank":  # the last rank's experts receive nothing
    ids, w = ep_helpers.routing(rng, n, EXPERTS - epr, TOP_K)
    return ids, w
  raise ValueError(kind)


def _inputs(seed, num_ranks, kind, dtype):
  rng = np.random.default_rng(seed)
  ids, w = _routing(rng, num_ranks, kind)
  x = jnp.asarray(rng.standard_normal((num_ranks * TOKENS, HIDDEN)), dtype)
  wgu, wd = ep_helpers.weights_for(rng, EXPERTS, HIDDEN, FFN, dtype)
  dy = jnp.asarray(rng.standard_normal((num_ranks * TOKENS, HIDDEN)), jnp.float32)
  return x, jnp.asarray(ids), jnp.asarray(w), wgu, wd, dy


def _virtual_layer(num_ranks, ws, mlp, **kw):
  """The virtual group's layer on flat [R*T, ...] tokens (reshaped to [R, T, ...] and back)."""
  def layer(x, ids, w, wgu, wd):
    stack = lambda a: a.reshape(num_ranks, TOKENS, *a.shape[1:])
    y = virtual_ranks.expert_parallel_moe(stack(x), stack(ids), stack(w), wgu, wd,
                                          workspace=ws, mlp=mlp, **kw)
    return y.reshape(num_ranks * TOKENS, -1)
  return layer


def _reference_layer(recipe=None):
  return lambda x, ids, w, wgu, wd: jm.moe(x, ids, w, wgu, wd, backend="reference",
                                           recipe=recipe)


def _errors(got, want):
  f32 = lambda a: np.asarray(jnp.asarray(a, jnp.float32))
  names = ("y", "dx", "dtopk_weights", "dw_gate_up", "dw_down")
  (y, g), (y_ref, g_ref) = got, want
  return {n: ep_helpers.rel_err(f32(a), f32(b))
          for n, a, b in zip(names, (y, *g), (y_ref, *g_ref))}


@pytest.mark.parametrize("num_ranks", RANKS)
@pytest.mark.parametrize("kind", ["uniform", "masked", "one_expert", "one_rank", "idle_rank"])
def test_float32_matches_reference(num_ranks, kind):
  if kind == "idle_rank" and num_ranks == 1:
    pytest.skip("not run: one rank cannot be idle while the others work")
  args = _inputs(num_ranks * 10 + len(kind), num_ranks, kind, jnp.float32)
  want = value_and_grads(_reference_layer(), *args)
  _poison()
  got = value_and_grads(_virtual_layer(num_ranks, _workspace(num_ranks, 4),
                                       reference.grouped_mlp), *args)
  assert np.all(np.isfinite(np.asarray(got[0]))), "y has non-finite (unwritten) rows"
  errs = _errors(got, want)
  ep_helpers.assert_errors_below(errs, 1e-5)


@pytest.mark.parametrize("num_ranks", RANKS)
def test_bf16_cutlass_mlp_matches_reference(num_ranks):
  args = _inputs(num_ranks, num_ranks, "masked", jnp.bfloat16)
  want = value_and_grads(_reference_layer(), *args)
  mlp = cuda.expert_mlp(None, jnp.bfloat16, HIDDEN, FFN)
  _poison()
  got = value_and_grads(_virtual_layer(num_ranks, _workspace(num_ranks, 2), mlp), *args)
  errs = _errors(got, want)
  ep_helpers.assert_errors_below(errs, 1e-2)


@pytest.mark.parametrize("num_ranks", RANKS)
@pytest.mark.parametrize("recipe", ["fp8", "fp8_pow2"])
def test_fp8_rows_on_the_wire(num_ranks, recipe):
  """Rows quantised on the sender travel in FP8; the forward equals the bf16-rows path bit for
  bit (same blocks, quantised on the receiver), gradients agree with the reference emulation
  (dW_gate_up against the reference on x as the sender rounds it: the expert rank only sees it
  in FP8)."""
  x, ids, w, wgu, wd, dy = _inputs(100 + num_ranks, num_ranks, "one_expert", jnp.bfloat16)
  mlp = cuda.expert_mlp(recipe, jnp.bfloat16, HIDDEN, FFN)
  assert isinstance(mlp, cuda_fp8.RowsMlp)
  ws = _workspace(num_ranks, 2)
  _poison()
  y8, g8 = value_and_grads(_virtual_layer(num_ranks, ws, mlp, fp8_dispatch=True),
                           x, ids, w, wgu, wd, dy)
  y16, g16 = value_and_grads(_virtual_layer(num_ranks, ws, mlp, fp8_dispatch=False),
                             x, ids, w, wgu, wd, dy)
  np.testing.assert_array_equal(np.asarray(y8, np.float32), np.asarray(y16, np.float32))
  y_ref, g_ref = value_and_grads(_reference_layer(recipe), x, ids, w, wgu, wd, dy)
  spec = fp8.get_recipe(recipe)
  xq = fp8.quantize_activation(x, spec).astype(x.dtype)
  _, g_ref_xq = value_and_grads(_reference_layer(recipe), xq, ids, w, wgu, wd, dy)
  errs = _errors((y8, g8), (y_ref, (g_ref[0], g_ref[1], g_ref_xq[2], g_ref[3])))
  ep_helpers.assert_errors_below(errs, 2e-2)


@pytest.mark.parametrize("num_ranks", [3, 8])
def test_consecutive_calls_and_bitwise_reproducible(num_ranks):
  """Twenty calls in a row with fresh inputs each are each right (no stale signal from an
  earlier call); the same inputs twice give the same bits, gradients included."""
  ws = _workspace(num_ranks, 4)
  layer = _virtual_layer(num_ranks, ws, reference.grouped_mlp)
  fwd = jax.jit(layer)
  for seed in range(20):
    x, ids, w, wgu, wd, _ = _inputs(1000 + seed, num_ranks, "masked", jnp.float32)
    err = ep_helpers.rel_err(np.asarray(fwd(x, ids, w, wgu, wd)),
                             np.asarray(_reference_layer()(x, ids, w, wgu, wd)))
    assert err < 1e-5, (seed, err)
  args = _inputs(7, num_ranks, "uniform", jnp.float32)
  first = value_and_grads(layer, *args)
  _poison()
  second = value_and_grads(layer, *args)
  for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("num_ranks", [2, 8])
def test_capacity_overflow_raises(num_ranks):
  """Every slot on rank 0's experts with capacity for a fraction of them: a clear error."""
  args = _inputs(5, num_ranks, "one_rank", jnp.float32)[:5]
  layer = _virtual_layer(num_ranks, _workspace(num_ranks, 4), reference.grouped_mlp,
                         capacity_factor=0.05)
  with pytest.raises(Exception, match="overflow.*capacity is 128 rows"):
    jax.block_until_ready(jax.jit(layer)(*args))


@pytest.mark.parametrize("num_ranks", [2, 3, 8])
def test_absent_rank_times_out_reports_and_poisons(num_ranks):
  """One virtual rank never arrives: the others give up after the timeout, report rank, stage
  and counters, and their outputs are NaN (never a normal-looking result); later calls on the
  workspace raise; the process stays usable (a new workspace works)."""
  ws = virtual_ranks.create_workspace(num_ranks, max_tokens=TOKENS, hidden=HIDDEN, top_k=TOP_K,
                                      dtype=jnp.float32, timeout_s=0.5)
  x, ids, w, wgu, wd, _ = _inputs(9, num_ranks, "uniform", jnp.float32)
  layer = jax.jit(_virtual_layer(num_ranks, ws, reference.grouped_mlp))
  absent = num_ranks - 1
  virtual_ranks.set_absent_rank(ws, absent)
  y = np.asarray(layer(x, ids, w, wgu, wd)).reshape(num_ranks, TOKENS, HIDDEN)
  assert np.all(np.isnan(y[:absent])), "a timed-out rank returned finite values"
  with pytest.raises(RuntimeError, match=rf"rank \d timed out after .* on peer rank {absent}"):
    ws.check()
  # A later call either fails at launch (the handler sees the recorded error) or, replayed
  # from a CUDA graph without its handler, returns NaN again: never a normal-looking result.
  try:
    again = np.asarray(layer(x, ids, w, wgu, wd)).reshape(num_ranks, TOKENS, HIDDEN)
  except Exception as e:  # noqa: BLE001 (XLA's runtime error type differs across versions)
    assert "timed out" in str(e), e
  else:
    assert np.all(np.isnan(again[:absent]))
  ws.close()
  fresh = virtual_ranks.create_workspace(num_ranks, max_tokens=TOKENS, hidden=HIDDEN,
                                         top_k=TOP_K, dtype=jnp.float32)
  y_ok = _virtual_layer(num_ranks, fresh, reference.grouped_mlp)(x, ids, w, wgu, wd)
  err = ep_helpers.rel_err(np.asarray(y_ok), np.asarray(_reference_layer()(x, ids, w, wgu, wd)))
  assert err < 1e-5
  fresh.close()


def test_refusals_name_the_problem():
  ws = _workspace(2, 4)
  x, ids, w, wgu, wd, _ = _inputs(1, 2, "uniform", jnp.float32)
  with pytest.raises(ValueError, match="x must be \\[ranks=2"):
    virtual_ranks.expert_parallel_moe(x, ids, w, wgu, wd, workspace=ws,
                                      mlp=reference.grouped_mlp)
  with pytest.raises(ValueError, match="rank must be None or in \\[0, 2\\)"):
    virtual_ranks.set_absent_rank(ws, 2)
  with pytest.raises(ValueError, match="num_ranks must be"):
    virtual_ranks.create_workspace(9, max_tokens=8, hidden=64, top_k=2)

"""The LM head's cross-entropy kernel (megamoe_cross_entropy_grad, models/losses.CE_KERNEL)
against the JAX definition it replaces (losses._loss_and_d_logits_jax): its handlers directly
(the CPU twin here, the CUDA kernel on the device, every way the kernel splits a row), and
chunked_cross_entropy's kernel path end to end, loss and gradients, with and without a mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from jax_megamoe import _ffi
from jax_megamoe.models import losses

TARGET = losses.CE_KERNEL_TARGET


def _needs_handler(platform):
  if not _ffi.has_target(TARGET, platform):
    pytest.skip(f"not run: the extension has no {platform} handler of {TARGET}")


def _handler(logits, targets, count):
  out = (jax.ShapeDtypeStruct(logits.shape, jnp.bfloat16),
         jax.ShapeDtypeStruct(targets.shape, jnp.float32))
  return jax.ffi.ffi_call(TARGET, out)(logits, targets, count=np.int64(count))


def _definition(logits, targets, count):
  """Per row: (d_logits, lse - target logit) of the JAX path."""
  lse = losses._logsumexp(logits)
  target_logit = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
  return losses._d_logits(logits, lse, targets, count, jnp.bfloat16), lse - target_logit


def _problem(rows, vocab, seed, special=True):
  rng = np.random.default_rng(seed)
  x = (rng.standard_normal((rows, vocab)) * 4).astype(np.float32)
  t = rng.integers(0, vocab, rows).astype(np.int32)
  if special and rows >= 6:
    x[0, -1] = 80.0  # a row's maximum last, far above the rest
    t[1] = vocab - 1
    x[2, :] = -np.inf  # an all -inf row: lse -inf, loss and d_logits NaN
    x[3, vocab // 2] = np.inf  # a +inf logit: lse +inf
    x[4, 0] = np.nan  # NaN in, NaN lse
    x[5, :] = 0.0  # every logit the row's maximum
  return jnp.asarray(x), jnp.asarray(t)


def _check(got, want, count):
  d, loss = (np.asarray(a, np.float32) for a in got)
  d_want, loss_want = (np.asarray(a, np.float32) for a in want)
  # The exps differ in the last float32 bits: d_logits within a bf16 rounding step.
  np.testing.assert_allclose(d, d_want, rtol=2 ** -7, atol=1e-30 / count)
  np.testing.assert_allclose(loss, loss_want, rtol=1e-5, atol=2e-5)


def _poison():
  junk = [jnp.full((1 << 24,), jnp.nan, jnp.float32) for _ in range(4)]
  jax.block_until_ready(junk)
  del junk


@pytest.mark.parametrize("rows,vocab", [(7, 1001), (16, 320), (1, 5)])
def test_cpu_handler_matches_the_definition(rows, vocab):
  _needs_handler("cpu")
  logits, targets = _problem(rows, vocab, seed=rows)
  cpu = jax.devices("cpu")[0]
  logits, targets = jax.device_put((logits, targets), cpu)
  _check(jax.jit(_handler, static_argnums=2)(logits, targets, 96),
         _definition(logits, targets, 96), 96)


def test_a_target_outside_the_vocabulary_gives_a_nan_loss():
  _needs_handler("cpu")
  logits, _ = _problem(3, 50, seed=1, special=False)
  targets = jnp.asarray([-1, 50, 7], jnp.int32)
  d, loss = jax.jit(_handler, static_argnums=2)(logits, targets, 3)
  assert np.isnan(loss[0]) and np.isnan(loss[1]) and np.isfinite(loss[2])
  # No column gets the one-hot: the row's d_logits is the softmax alone.
  np.testing.assert_allclose(np.asarray(d[:2], np.float32),
                             np.asarray(jax.nn.softmax(logits[:2], axis=-1) / 3, np.float32),
                             rtol=2 ** -7)


@pytest.mark.parametrize("args,error", [
    ((jnp.zeros((2, 8), jnp.bfloat16), jnp.zeros((2,), jnp.int32), 4),
     "logits has dtype bfloat16, expected float32"),
    ((jnp.zeros((2, 8)), jnp.zeros((2,), jnp.float32), 4), "targets has dtype float32"),
    ((jnp.zeros((2, 8)), jnp.zeros((3,), jnp.int32), 4), "targets"),
    ((jnp.zeros((2, 0)), jnp.zeros((2,), jnp.int32), 4), r"logits must be \[N, V\] with V >= 1"),
    ((jnp.zeros((2, 8)), jnp.zeros((2,), jnp.int32), 0), "count must be >= 1, got 0"),
])
def test_handler_errors_name_the_argument(args, error):
  _needs_handler("cpu")
  with pytest.raises(Exception, match=error):
    jax.block_until_ready(jax.jit(_handler, static_argnums=2)(*args))


def _loss_and_grads(hidden, head, targets, chunk, mesh):
  def f(h, w):
    return losses.chunked_cross_entropy(h, w, targets, chunk=chunk, mesh=mesh)
  fn = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
  return fn(hidden, head), fn.lower(hidden, head).as_text()


def _bf16_problem(batch, seq, hidden, vocab, seed):
  rng = np.random.default_rng(seed)
  h = jnp.asarray(rng.standard_normal((batch, seq, hidden)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((hidden, vocab)) * 0.3, jnp.float32)
  t = jnp.asarray(rng.integers(0, vocab, (batch, seq)), jnp.int32)
  return h, w, t


def _compare_paths(monkeypatch, mesh, platforms, *, batch=8, expect_kernel=True):
  h, w, t = _bf16_problem(batch, 32, 64, 1003, seed=5)
  monkeypatch.setattr(losses, "CE_KERNEL_PLATFORMS", platforms)
  monkeypatch.setattr(losses, "CE_KERNEL", True)
  (loss, (dh, dw)), text = _loss_and_grads(h, w, t, 8, mesh)
  assert (TARGET in text) == expect_kernel
  monkeypatch.setattr(losses, "CE_KERNEL", False)
  (loss_j, (dh_j, dw_j)), text_j = _loss_and_grads(h, w, t, 8, mesh)
  assert TARGET not in text_j
  np.testing.assert_allclose(loss, loss_j, rtol=1e-5)
  for got, want in ((dh, dh_j), (dw, dw_j)):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_kernel_path_on_a_mesh_matches_the_jax_path(monkeypatch, axis_type):
  """Under a mesh of the 8 CPU devices (2 x 4, every axis sharding the batch; Auto axes as the
  example's, and Explicit) each device's rows go through the CPU handler: the loss and both
  gradients as the JAX path's."""
  _needs_handler("cpu")
  mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(axis_type,) * 2)
  _compare_paths(monkeypatch, mesh, ("cpu",))


def test_both_paths_give_nan_for_a_target_outside_the_vocabulary(monkeypatch):
  _needs_handler("cpu")
  h, w, t = _bf16_problem(1, 8, 16, 40, seed=2)
  monkeypatch.setattr(losses, "CE_KERNEL_PLATFORMS", ("cpu",))
  mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
  for kernel in (False, True):
    monkeypatch.setattr(losses, "CE_KERNEL", kernel)
    for bad in (-1, 40):
      loss = losses.chunked_cross_entropy(h, w, t.at[0, 3].set(bad), chunk=4, mesh=mesh)
      assert np.isnan(loss), (kernel, bad)


def test_no_kernel_on_several_devices_without_a_mesh(monkeypatch):
  """Without a mesh XLA would gather the custom call's operands onto every device: the JAX
  path is taken whenever JAX sees several devices (here 8 CPU devices)."""
  _needs_handler("cpu")
  assert jax.device_count() > 1
  _compare_paths(monkeypatch, None, ("cpu",), expect_kernel=False)


def test_mesh_must_divide_the_batch():
  h, w, t = _bf16_problem(6, 8, 16, 40, seed=0)
  mesh = jax.make_mesh((2, 4), ("data", "expert"))
  with pytest.raises(ValueError, match=r"the batch \(6\) must divide over the mesh's 8"):
    losses.chunked_cross_entropy(h, w, t, chunk=4, mesh=mesh)


# --- on the GPU -----------------------------------------------------------------------------

# Vocabularies for every split (ffi/heuristics/cross_entropy_split.h): Qwen3's (6 CTAs per
# row, segments in shared memory), small and odd ones (one CTA, 4-byte accesses), an odd one
# over a cluster (GPT-2's 50,257), one CTA per SM (300,000), segments read from memory
# (500,000; and odd, 409,603).
GPU_CASES = [(64, 151936), (7, 1001), (33, 320), (1, 5), (9, 32000), (5, 50257), (6, 300000),
             (6, 500000), (2, 409603)]


@pytest.mark.gpu
@pytest.mark.parametrize("rows,vocab", GPU_CASES)
def test_cuda_kernel_matches_the_definition_bitwise_run_to_run(rows, vocab):
  logits, targets = _problem(rows, vocab, seed=rows + vocab)
  count = 16384
  f = jax.jit(_handler, static_argnums=2)
  _poison()
  got = jax.block_until_ready(f(logits, targets, count))
  _check(got, _definition(logits, targets, count), count)
  _poison()
  again = f(logits, targets, count)
  for a, b in zip(got, again):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint16 if a.dtype == jnp.bfloat16
                                                     else np.uint32),
                                  np.asarray(b).view(np.uint16 if b.dtype == jnp.bfloat16
                                                     else np.uint32))


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [151936, 50257])
def test_cuda_kernel_gives_nan_for_a_target_outside_the_vocabulary(vocab):
  """Rank 0 of a row's cluster writes the NaN; no column gets the one-hot."""
  logits, _ = _problem(3, vocab, seed=2, special=False)
  targets = jnp.asarray([-1, vocab, 7], jnp.int32)
  d, loss = jax.jit(_handler, static_argnums=2)(logits, targets, 3)
  assert np.isnan(loss[0]) and np.isnan(loss[1]) and np.isfinite(loss[2])
  np.testing.assert_allclose(np.asarray(d[:2], np.float32),
                             np.asarray(jax.nn.softmax(logits[:2], axis=-1) / 3, np.float32),
                             rtol=2 ** -7, atol=1e-30)


@pytest.mark.gpu
def test_cuda_kernel_path_matches_the_jax_path(monkeypatch):
  """chunked_cross_entropy on a GPU takes the kernel (CE_KERNEL's default platforms): the
  loss and both gradients as the JAX path's; on one device without a mesh, and on a
  one-device mesh."""
  if jax.device_count() == 1:
    _compare_paths(monkeypatch, None, losses.CE_KERNEL_PLATFORMS)
  mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
  _compare_paths(monkeypatch, mesh, losses.CE_KERNEL_PLATFORMS)

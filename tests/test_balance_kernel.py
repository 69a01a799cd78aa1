"""balance's offsets by one kernel (megamoe_balance_offsets, router.BALANCE_KERNEL) against the
JAX loops it replaces (router._balancing_offsets): its handlers directly (the CPU twin here,
the CUDA kernel on the device: rows in shared memory or not, up to the most experts it takes),
and route's kernel path, with and without a mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from jax_megamoe import _ffi, router

TARGET = router.BALANCE_KERNEL_TARGET


def _needs_handler(platform):
  if not _ffi.has_target(TARGET, platform):
    pytest.skip(f"not run: the extension has no {platform} handler of {TARGET}")


def _handler(z, top_k, iterations=None, load_steps=None, temperature=None):
  """The op with route's settings (or the given ones)."""
  first, decay = router._load_step_sizes()
  e = z.shape[1]
  out = (jax.ShapeDtypeStruct((e,), jnp.float32),
         jax.ShapeDtypeStruct((_ffi.scratch_bytes(TARGET, e),), jnp.uint8))
  return jax.ffi.ffi_call(TARGET, out)(
      z, top_k=np.int64(top_k),
      temperature=np.float32(router.BALANCE_TEMPERATURE if temperature is None else temperature),
      sinkhorn_iterations=np.int64(router.BALANCE_SINKHORN_ITERATIONS if iterations is None
                                   else iterations),
      load_steps=np.int64(router.BALANCE_LOAD_STEPS if load_steps is None else load_steps),
      step_first=np.float32(first), step_decay=np.float32(decay))[0]


def _router_like(tokens, experts, seed):
  """Standardised, perturbed logits shaped like a collapsing router's: a shared profile, a
  rank-1 spread and token noise (as router.route hands the solve)."""
  rng = np.random.default_rng(seed)
  logits = (rng.standard_normal(experts) * 2 + np.outer(rng.standard_normal(tokens),
                                                        rng.standard_normal(experts))
            + rng.standard_normal((tokens, experts)))
  z = (logits - logits.mean(0)) / (logits.std(0) + 1e-6)
  return jnp.asarray(router._perturbed(jnp.asarray(z, jnp.float32)))


def _peak_load(z, offsets, top_k):
  _, ids = jax.lax.top_k(z + offsets, top_k)
  load = np.bincount(np.asarray(ids).ravel(), minlength=z.shape[1])
  return load.max() / load.mean(), np.asarray(ids)


def _check_against_the_loops(z, top_k, got):
  """Sinkhorn alone (no load steps) agrees to float32 rounding; the whole solve balances as
  well and makes nearly the same choice (a sum's order can flip a near tie, and a load step
  then moves its expert's offset by ~1e-4)."""
  want = router._balancing_offsets(z, top_k)
  peak, ids = _peak_load(z, got, top_k)
  peak_want, ids_want = _peak_load(z, want, top_k)
  assert peak <= peak_want * 1.02 + 1e-6, (peak, peak_want)
  assert np.mean(np.sort(ids, 1) == np.sort(ids_want, 1)) > 0.995
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=5e-3)


def _check_sinkhorn(z, top_k, got_sinkhorn_only, monkeypatch):
  monkeypatch.setattr(router, "BALANCE_LOAD_STEPS", 0)
  want = router._balancing_offsets(z, top_k)
  np.testing.assert_allclose(np.asarray(got_sinkhorn_only), np.asarray(want), rtol=1e-4,
                             atol=1e-4)


@pytest.mark.parametrize("tokens,experts,top_k", [(512, 16, 2), (1000, 64, 8), (37, 40, 5)])
def test_cpu_handler_matches_the_loops(tokens, experts, top_k, monkeypatch):
  _needs_handler("cpu")
  z = _router_like(tokens, experts, seed=tokens)
  _check_against_the_loops(z, top_k, jax.jit(_handler, static_argnums=1)(z, top_k))
  sinkhorn = jax.jit(lambda z: _handler(z, top_k, load_steps=0))(z)
  _check_sinkhorn(z, top_k, sinkhorn, monkeypatch)


@pytest.mark.parametrize("z_shape,kwargs,error", [
    ((8, 513), {}, r"z must be \[T, E\] with T >= 1 and 1 <= E <= 512, got \[8, 513\]"),
    ((0, 8), {}, r"z must be \[T, E\] with T >= 1"),
    ((8, 4), {"top_k": 5}, r"top_k must be in \[1, E=4\], got 5"),
    ((8, 4), {"temperature": 0.0}, "temperature must be positive and finite, got 0"),
    ((8, 4), {"iterations": -1}, "sinkhorn_iterations and load_steps must be in"),
])
def test_handler_errors_name_the_argument(z_shape, kwargs, error):
  _needs_handler("cpu")
  z = jnp.zeros(z_shape, jnp.float32)
  top_k = kwargs.pop("top_k", 2)
  with pytest.raises(Exception, match=error):
    jax.block_until_ready(jax.jit(lambda z: _handler(z, top_k, **kwargs))(z))


def test_the_expert_limit_is_the_handlers():
  """router.BALANCE_KERNEL_MAX_EXPERTS is the handler's kBalanceMaxExperts: it takes that many
  experts and refuses one more."""
  _needs_handler("cpu")
  e = router.BALANCE_KERNEL_MAX_EXPERTS
  z = _router_like(64, e, seed=0)
  assert np.all(np.isfinite(jax.jit(lambda z: _handler(z, 8, load_steps=2))(z)))
  with pytest.raises(Exception, match=f"1 <= E <= {e}, got"):
    jax.block_until_ready(jax.jit(lambda z: _handler(z, 8))(_router_like(64, e + 1, seed=0)))


def _route(logits, mesh):
  return jax.jit(lambda x: router.route(x, 4, selection_norm="balance", mesh=mesh))


def _compare_routes(monkeypatch, mesh, platforms, expect_kernel=True):
  logits = jnp.asarray(np.random.default_rng(3).standard_normal((256, 32)), jnp.float32)
  monkeypatch.setattr(router, "BALANCE_KERNEL_PLATFORMS", platforms)
  monkeypatch.setattr(router, "BALANCE_KERNEL", True)
  f = _route(logits, mesh)
  (_, ids, aux), text = f(logits), f.lower(logits).as_text()
  assert (TARGET in text) == expect_kernel
  monkeypatch.setattr(router, "BALANCE_KERNEL", False)
  g = _route(logits, mesh)
  (_, ids_want, aux_want), text_want = g(logits), g.lower(logits).as_text()
  assert TARGET not in text_want
  assert np.mean(np.sort(ids, 1) == np.sort(ids_want, 1)) > 0.99
  np.testing.assert_allclose(aux.selection_stats, aux_want.selection_stats, atol=5e-3)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_route_on_a_mesh_takes_the_kernel_per_device(monkeypatch, axis_type):
  """Under a 2 x 4 mesh of the CPU devices each device's offsets come from the CPU handler:
  nearly the JAX loops' choice and statistics."""
  _needs_handler("cpu")
  mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(axis_type,) * 2)
  _compare_routes(monkeypatch, mesh, ("cpu",))


def test_route_without_a_mesh_on_several_devices_keeps_the_loops(monkeypatch):
  _needs_handler("cpu")
  assert jax.device_count() > 1
  _compare_routes(monkeypatch, None, ("cpu",), expect_kernel=False)


def test_the_kernel_call_vmaps():
  """jax.vmap of the kernel's call (vmap_method="sequential"): each item as alone."""
  _needs_handler("cpu")
  zs = jnp.stack([_router_like(96, 16, seed=s) for s in range(3)])
  got = jax.jit(jax.vmap(lambda z: router._balancing_offsets_kernel(z, 2)))(zs)
  for z, offsets in zip(zs, got):
    np.testing.assert_array_equal(offsets, router._balancing_offsets_kernel(z, 2))


# --- on the GPU -----------------------------------------------------------------------------

# Rows in shared memory (up to ~46k rows at 128 experts on 132 SMs) or read from memory, one
# row, uneven rows per CTA, and the most experts.
GPU_CASES = [(16384, 128, 8), (4096, 64, 6), (1, 8, 2), (1000, 128, 8), (300, 512, 8),
             (60000, 128, 8)]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,experts,top_k", GPU_CASES)
def test_cuda_kernel_matches_the_loops_bitwise_run_to_run(tokens, experts, top_k, monkeypatch):
  z = _router_like(tokens, experts, seed=experts + tokens)
  f = jax.jit(_handler, static_argnums=1)
  got = f(z, top_k)
  _check_against_the_loops(z, top_k, got)
  np.testing.assert_array_equal(np.asarray(f(z, top_k)).view(np.uint32),
                                np.asarray(got).view(np.uint32))
  _check_sinkhorn(z, top_k, jax.jit(lambda z: _handler(z, top_k, load_steps=0))(z),
                  monkeypatch)


@pytest.mark.gpu
def test_cuda_route_takes_the_kernel_under_jit_and_grad(monkeypatch):
  """route with balance on one GPU (a one-device mesh, whatever the machine has) calls the
  kernel, gives nearly the loops' choice, and differentiates (no gradient flows into it)."""
  mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
  _compare_routes(monkeypatch, mesh, router.BALANCE_KERNEL_PLATFORMS)
  monkeypatch.setattr(router, "BALANCE_KERNEL", True)
  logits = jnp.asarray(np.random.default_rng(5).standard_normal((512, 64)), jnp.float32)

  def loss(x):
    w, _, aux = router.route(x, 8, selection_norm="balance", mesh=mesh)
    return jnp.sum(w * w) + aux.load_balancing_loss

  grad = jax.jit(jax.grad(loss))(logits)
  assert np.all(np.isfinite(np.asarray(grad)))


"""moe(..., weight_blocks=): FP8 expert weights quantised once (jax_megamoe.weight_blocks) give
the same layer, forward and gradients, bit for bit, in every backend and process layout; a
rolled scan over micro-batches then quantises each weight once; bad blocks are refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import jax_megamoe as jm
from jax_megamoe import _ffi
from jax_megamoe.backends import cuda_fp8
from jaxpr_helpers import hlo_computations_holding

_PLATFORM = "cpu" if jax.default_backend() == "cpu" else "CUDA"
needs_fp8_handlers = pytest.mark.skipif(
    not all(_ffi.has_target(t, _PLATFORM) for t in cuda_fp8.TARGETS),
    reason="not run: the native extension (with the FP8 handlers of the default device) is not "
           "built")

E, H, F, K = 4, 256, 128, 2


def _layer(tokens: int, seed: int):
  """bf16 operands with a masked slot and an expert no token picks (expert 3)."""
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((tokens, H)), jnp.bfloat16)
  ids = np.stack([rng.permutation(3)[:K] for _ in range(tokens)]).astype(np.int32)
  ids[0, 1] = -1
  w = jnp.asarray(rng.uniform(0.1, 1.0, (tokens, K)), jnp.float32)
  wgu = jnp.asarray(rng.standard_normal((E, H, 2 * F)) / 16, jnp.bfloat16)
  wd = jnp.asarray(rng.standard_normal((E, F, H)) / 11, jnp.bfloat16)
  return x, jnp.asarray(ids), w, wgu, wd


def _value_and_grads(layer, x, w, wgu, wd):
  def loss(x, w, a, b):
    y = layer(x, w, a, b)
    return jnp.sum(y.astype(jnp.float32) * jnp.cos(jnp.arange(y.size).reshape(y.shape))), y
  (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(x, w, wgu, wd)
  return [y, *grads]


def _assert_same_layer(make_layer, tokens=48, seed=0):
  """make_layer(ids, blocks or None) -> layer(x, w, wgu, wd): forward and gradients bit for bit
  the same with the blocks as without (and not all zero)."""
  x, ids, w, wgu, wd = _layer(tokens, seed)
  outs = {}
  for name in ("quantised per call", "blocks"):
    blocks = make_layer.quantize(wgu, wd) if name == "blocks" else None
    layer = jax.jit(make_layer(ids, blocks))
    outs[name] = [np.asarray(a.astype(jnp.float32))
                  for a in _value_and_grads(layer, x, w, wgu, wd)]
  for what, a, b in zip(("y", "dx", "dw", "dw_gate_up", "dw_down"), outs["quantised per call"],
                        outs["blocks"]):
    assert np.isfinite(a).all() and np.abs(a).max() > 0, what
    np.testing.assert_array_equal(a, b, err_msg=what)


class _Maker:
  """A layer factory for _assert_same_layer: moe with these options, blocks from
  quantize_expert_weights with the same recipe and mesh."""

  def __init__(self, recipe, mesh=None, **options):
    self.recipe, self.mesh, self.options = recipe, mesh, options

  def quantize(self, wgu, wd):
    return jm.quantize_expert_weights(wgu, wd, self.recipe, mesh=self.mesh)

  def __call__(self, ids, blocks):
    return lambda x, w, a, b: jm.moe(x, ids, w, a, b, recipe=self.recipe, mesh=self.mesh,
                                     weight_blocks=blocks, **self.options)


@needs_fp8_handlers
@pytest.mark.parametrize("recipe", ["fp8", "fp8_pow2"])
def test_reference_backend_with_blocks_is_the_same_layer(recipe):
  _assert_same_layer(_Maker(recipe, backend="reference"))


@needs_fp8_handlers
@pytest.mark.parametrize("recipe", ["fp8", "fp8_pow2"])
def test_reference_backend_over_an_expert_mesh_with_blocks_is_the_same_layer(recipe):
  """EP = 2 over 4 CPU devices (data x expert): every device quantises its own experts."""
  devices = np.array(jax.devices()[:4]).reshape(2, 2)
  mesh = Mesh(devices, ("data", "expert"))
  _assert_same_layer(_Maker(recipe, mesh, backend="reference"), tokens=64, seed=1)


@needs_fp8_handlers
def test_explicit_axes_mesh_with_blocks_is_the_same_layer():
  """The same under a mesh with explicit axes, whose shardings are typed (the blocks are laid
  out over the experts like the weights)."""
  from jax.sharding import AxisType
  mesh = jax.make_mesh((2, 2), ("data", "expert"), axis_types=(AxisType.Explicit,) * 2,
                       devices=jax.devices()[:4])
  with jax.set_mesh(mesh):  # the test's own loss needs it under explicit axes
    _assert_same_layer(_Maker("fp8", mesh, backend="reference"), tokens=64, seed=5)


@needs_fp8_handlers
def test_module_takes_blocks():
  """MoE(recipe="fp8")(x, weight_blocks=) is MoE(x), blocks made from its weights in its dtype."""
  from flax import nnx
  layer = jm.MoE(H, F, E, K, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, backend="reference",
                 recipe="fp8")
  x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 24, H)), jnp.bfloat16)
  blocks = jm.quantize_expert_weights(layer.w_gate_up[...].astype(jnp.bfloat16),
                                      layer.w_down[...].astype(jnp.bfloat16), "fp8")
  np.testing.assert_array_equal(np.asarray(layer(x), np.float32),
                                np.asarray(layer(x, weight_blocks=blocks), np.float32))


@needs_fp8_handlers
def test_rolled_scan_quantises_the_weights_once():
  """A gradient accumulation as a rolled lax.scan: with blocks made before the loop, the
  optimised program quantises each weight once, outside the loop, on the default device's XLA
  (XLA:GPU leaves a loop-invariant quantisation inside the loop: tests/test_fp8_weight_reuse.py),
  and the accumulated gradients are a Python loop's without blocks."""
  rng = np.random.default_rng(9)
  m, n, e = 3, 40, 2
  gs = jnp.asarray([25, 15], jnp.int32)
  xs = jnp.asarray(rng.standard_normal((m, n, H)), jnp.bfloat16)
  wgu = jnp.asarray(rng.standard_normal((e, H, 2 * F)) / 11, jnp.bfloat16)
  wd = jnp.asarray(rng.standard_normal((e, F, H)) / 11, jnp.bfloat16)
  mlp = cuda_fp8.RowsMlp()

  def loss(wgu, wd, x, blocks):
    return jnp.sum(mlp(x, gs, wgu, wd, blocks).astype(jnp.float32) ** 2)

  grad = jax.grad(loss, argnums=(0, 1))

  def accumulate(wgu, wd, xs):
    blocks = jm.quantize_expert_weights(wgu, wd, "fp8")

    def body(acc, x):
      return jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc,
                          grad(wgu, wd, x, blocks)), None
    zeros = (jnp.zeros(wgu.shape, jnp.float32), jnp.zeros(wd.shape, jnp.float32))
    return jax.lax.scan(body, zeros, xs)[0]

  compiled = jax.jit(accumulate).lower(wgu, wd, xs).compile().as_text()
  holding = hlo_computations_holding(compiled, cuda_fp8.QUANTIZE_WEIGHTS_TARGET)
  assert len(holding) == 1 and holding[0].startswith("ENTRY"), holding
  assert compiled.count(cuda_fp8.QUANTIZE_WEIGHTS_TARGET) == 2
  assert " while(" in compiled  # the loop is still a loop
  got = jax.jit(accumulate)(wgu, wd, xs)
  step = jax.jit(lambda a, b, x: grad(a, b, x, None))
  want = [jnp.zeros(wgu.shape, jnp.float32), jnp.zeros(wd.shape, jnp.float32)]
  for i in range(m):
    want = [a + g.astype(jnp.float32) for a, g in zip(want, step(wgu, wd, xs[i]))]
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.gpu
def test_rolled_scan_quantises_the_weights_once_on_the_gpu():
  """The same on XLA:GPU, where the structural check decides (XLA:CPU would hoist the
  quantisation out of the loop by itself)."""
  test_rolled_scan_quantises_the_weights_once()


@needs_fp8_handlers
def test_bad_blocks_are_refused_naming_the_problem():
  x, ids, w, wgu, wd = _layer(16, 3)
  blocks = jm.quantize_expert_weights(wgu, wd, "fp8")
  run = lambda **kw: jm.moe(x, ids, w, wgu, wd, backend="reference", **kw)
  with pytest.raises(ValueError, match="needs recipe 'fp8' or 'fp8_pow2', got recipe None"):
    run(weight_blocks=blocks)
  with pytest.raises(ValueError, match="quantised for recipe 'fp8', the layer runs recipe "
                                       "'fp8_pow2'"):
    run(recipe="fp8_pow2", weight_blocks=blocks)
  with pytest.raises(ValueError, match="must be what jax_megamoe.quantize_expert_weights"):
    run(recipe="fp8", weight_blocks=(blocks.w_gate_up, blocks.w_down))
  other = jm.quantize_expert_weights(wgu[:2], wd[:2], "fp8")
  with pytest.raises(ValueError, match=r"weight_blocks.w_gate_up.q must be "
                                       r"float8_e4m3fn\[4, 256, 256\]"):
    run(recipe="fp8", weight_blocks=other)
  with pytest.raises(ValueError, match="need bfloat16 x and weights, got float32"):
    jm.moe(x.astype(jnp.float32), ids, w, wgu.astype(jnp.float32), wd.astype(jnp.float32),
           backend="reference", recipe="fp8", weight_blocks=blocks)
  with pytest.raises(ValueError, match="weight blocks exist for recipes .* got recipe 'mxfp8'"):
    jm.quantize_expert_weights(wgu, wd, "mxfp8")
  with pytest.raises(ValueError, match=r"w_down must be a 3-D bfloat16 array"):
    jm.quantize_expert_weights(wgu, wd.astype(jnp.float32), "fp8")
  with pytest.raises(ValueError, match="w_gate_up axis 1 must be a multiple of 128 for FP8"):
    jm.quantize_expert_weights(wgu[:, :200], wd, "fp8")
  mesh = Mesh(np.array(jax.devices()[:2]), ("expert",))
  with pytest.raises(ValueError, match="expert_axis 'ep' is not an axis of the mesh"):
    jm.quantize_expert_weights(wgu, wd, "fp8", mesh=mesh, expert_axis="ep")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "fused"])
@pytest.mark.parametrize("recipe", ["fp8", "fp8_pow2"])
@pytest.mark.parametrize("with_mesh", [False, True])
def test_kernels_with_blocks_are_the_same_layer(backend, recipe, with_mesh):
  """Backends cuda and fused on one GPU, without a mesh (cuda: its local path) and under a
  one-GPU mesh (the NVLink exchange / the fused kernel's EP path)."""
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "expert")) if with_mesh \
      else None
  _assert_same_layer(_Maker(recipe, mesh, backend=backend), tokens=200, seed=4)

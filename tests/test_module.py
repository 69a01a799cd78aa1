"""The Flax NNX MoE module: parameters, sharding, parity with the functional op, training."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_megamoe as jm
from moe_oracles import numpy_moe, rel_err

H, F, E, K = 16, 8, 8, 2


def test_parameters_shapes_init_and_annotations():
  layer = jm.MoE(H, F, E, K, rngs=nnx.Rngs(0))
  assert layer.router.shape == (H, E)
  assert layer.w_gate_up.shape == (E, H, 2 * F) and layer.w_down.shape == (E, F, H)
  assert layer.w_gate_up[...].dtype == jnp.float32
  assert abs(float(jnp.std(layer.w_gate_up[...])) - 0.02) < 2e-3  # Qwen3 init, N(0, 0.02^2)
  specs = nnx.get_partition_spec(nnx.state(layer))
  assert specs["w_gate_up"].get_value() == P("expert", None, None)
  assert specs["router"].get_value() == P(None, None)


def test_module_matches_functional_op_in_float32():
  layer = jm.MoE(H, F, E, K, rngs=nnx.Rngs(1), dtype=jnp.float32)
  x = jax.random.normal(jax.random.PRNGKey(2), (2, 8, H))
  y, aux = layer(x, return_aux=True)
  assert y.shape == x.shape
  tokens = x.reshape(-1, H)
  weights, ids, _ = jm.route(tokens @ layer.router[...], K)
  want = numpy_moe(tokens, ids, weights, layer.w_gate_up[...], layer.w_down[...])
  assert rel_err(y.reshape(-1, H), want) < 1e-5
  assert aux.expert_load.shape == (E,)


def test_sharded_module_trains_under_nnx_jit():
  mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)
  layer = jm.MoE(H, F, E, K, rngs=nnx.Rngs(3), mesh=mesh, dtype=jnp.bfloat16)
  assert layer.w_gate_up[...].sharding.spec == P("expert", None, None)
  reference = jm.MoE(H, F, E, K, rngs=nnx.Rngs(3), dtype=jnp.bfloat16)  # same init, no mesh
  x = jax.random.normal(jax.random.PRNGKey(4), (16, H))
  target = jax.random.normal(jax.random.PRNGKey(5), (16, H))

  optimizer = nnx.Optimizer(layer, optax.adam(1e-2), wrt=nnx.Param)

  @nnx.jit
  def train_step(layer, optimizer, x, target):
    def loss_fn(layer):
      y, aux = layer(x, return_aux=True)
      return jnp.mean((y.astype(jnp.float32) - target) ** 2) + 0.01 * aux.load_balancing_loss
    loss, grads = nnx.value_and_grad(loss_fn)(layer)
    optimizer.update(layer, grads)
    return loss

  y_sharded = nnx.jit(lambda m, x: m(x))(layer, x)
  y_plain = reference(x)
  assert rel_err(y_sharded.astype(jnp.float32), y_plain.astype(jnp.float32)) < 1e-2
  losses = [float(train_step(layer, optimizer, x, target)) for _ in range(8)]
  assert losses[-1] < losses[0]
  expert_sharded = NamedSharding(mesh, P("expert", None, None))
  assert layer.w_gate_up[...].sharding.is_equivalent_to(expert_sharded, 3)
  assert np.isfinite(losses).all()

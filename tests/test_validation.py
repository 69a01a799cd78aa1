"""Every bad argument of moe() and MoE raises a ValueError naming the parameter and value."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jax_megamoe as jm
from jax_megamoe import backends

T, H, F, E, K = 8, 16, 8, 8, 2


def cpu_mesh(shape, axes):
  """Meshes over the 8 virtual CPU devices, also on a GPU machine (collection-time safe)."""
  return jax.make_mesh(shape, axes, devices=jax.devices("cpu")[:8])


def good_args(**overrides):
  args = dict(x=jnp.ones((T, H)), topk_ids=jnp.tile(jnp.arange(K, dtype=jnp.int32), (T, 1)),
              topk_weights=jnp.ones((T, K)), w_gate_up=jnp.ones((E, H, 2 * F)),
              w_down=jnp.ones((E, F, H)))
  args.update(overrides)
  return args


@pytest.mark.parametrize("overrides,match", [
    (dict(x=jnp.ones((T, H, 1))), "x must be"),
    (dict(x=jnp.ones((T, H), jnp.int32)), "x must be float32"),
    (dict(topk_ids=jnp.zeros((T + 1, K), jnp.int32)), "topk_ids must be"),
    (dict(topk_ids=jnp.zeros((T, K))), "topk_ids must be an integer"),
    (dict(topk_weights=jnp.ones((T, K + 1))), "topk_weights must have"),
    (dict(topk_weights=jnp.ones((T, K), jnp.int32)), "topk_weights must be floating"),
    (dict(w_gate_up=jnp.ones((E, H + 1, 2 * F))), "w_gate_up must be"),
    (dict(w_gate_up=jnp.ones((E, H, 2 * F + 1))), "w_gate_up must be"),
    (dict(w_down=jnp.ones((E, F + 1, H))), "w_down must be"),
    (dict(w_down=jnp.ones((E, F, H), jnp.bfloat16)), "w_down must have x's dtype"),
    (dict(topk_ids=jnp.zeros((T, E + 1), jnp.int32), topk_weights=jnp.ones((T, E + 1))),
     "top_k"),
    (dict(topk_ids=jnp.full((T, K), E, jnp.int32)), r"topk_ids must be in \[0, 8\)"),
    (dict(topk_ids=jnp.full((T, K), -2, jnp.int32)), "-2"),
])
def test_bad_arrays(overrides, match):
  with pytest.raises(ValueError, match=match):
    jm.moe(**good_args(**overrides))


def test_unknown_backend_and_recipe():
  with pytest.raises(ValueError, match="backend must be one of .* got 'triton'"):
    jm.moe(**good_args(), backend="triton")
  with pytest.raises(ValueError, match="recipe must be one of .* got 'int4'"):
    jm.moe(**good_args(), recipe="int4")


def test_mesh_without_expert_axis():
  mesh = cpu_mesh((8,), ("data",))
  with pytest.raises(ValueError, match="expert_axis 'expert' is not an axis"):
    jm.moe(**good_args(), mesh=mesh)


def test_experts_not_divisible_by_expert_axis():
  mesh = cpu_mesh((8,), ("expert",))
  with pytest.raises(ValueError, match="experts 6 must divide evenly over expert_axis"):
    jm.moe(**good_args(w_gate_up=jnp.ones((6, H, 2 * F)), w_down=jnp.ones((6, F, H))),
           mesh=mesh)


def test_tokens_not_divisible_by_devices():
  mesh = cpu_mesh((2, 4), ("data", "expert"))
  with pytest.raises(ValueError, match="tokens 12 must divide evenly over the mesh's 8"):
    jm.moe(**good_args(x=jnp.ones((12, H)),
                       topk_ids=jnp.tile(jnp.arange(K, dtype=jnp.int32), (12, 1)),
                       topk_weights=jnp.ones((12, K))), mesh=mesh)


@pytest.mark.parametrize("name", ["cuda", "fused"])
def test_unavailable_backend_says_why(name):
  reason = backends.unavailable_reason(name)
  if reason is None:
    pytest.skip(f"not run: backend {name!r} is available on this machine")
  with pytest.raises(backends.BackendUnavailableError, match=f"backend '{name}' is not "
                     "available: .+"):
    jm.moe(**good_args(), backend=name)


def test_auto_picks_an_available_backend():
  assert backends.unavailable_reason(backends.resolve("auto").NAME) is None


def test_repeated_expert_ids_are_named():
  ids = jnp.tile(jnp.arange(K, dtype=jnp.int32), (T, 1)).at[3, 1].set(0)
  with pytest.raises(ValueError, match="distinct experts per token .* token 3 has"):
    jm.moe(**good_args(topk_ids=ids))
  # -1 (masked) may repeat.
  jm.moe(**good_args(topk_ids=jnp.full((T, K), -1, jnp.int32).at[:, 0].set(1)))


def test_out_of_range_ids_under_jit_are_masked():
  args = good_args()
  args["topk_ids"] = args["topk_ids"].at[0, 0].set(E + 3)
  args["x"] = jax.random.normal(jax.random.PRNGKey(0), (T, H))
  masked = dict(args, topk_ids=args["topk_ids"].at[0, 0].set(-1))
  got = jax.jit(lambda a: jm.moe(**a))(args)
  assert jnp.array_equal(got, jm.moe(**masked))


@pytest.mark.parametrize("kwargs,match", [
    (dict(top_k=9), "top_k must be an int in"),
    (dict(num_experts=0), "num_experts must be a positive int"),
    (dict(hidden_size=-1), "hidden_size must be"),
    (dict(mesh=cpu_mesh((8,), ("data",))), "expert_axis 'expert' is not an axis"),
    (dict(num_experts=4, top_k=2, mesh=cpu_mesh((8,), ("expert",))),
     "num_experts 4 must divide evenly"),
])
def test_module_validation(kwargs, match):
  base = dict(hidden_size=H, ffn_size=F, num_experts=E, top_k=K)
  base.update(kwargs)
  with pytest.raises(ValueError, match=match):
    jm.MoE(**base, rngs=nnx.Rngs(0))


def test_module_rejects_wrong_hidden_size():
  layer = jm.MoE(H, F, E, K, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="hidden_size=16"):
    layer(jnp.ones((4, H + 1)))


@pytest.mark.parametrize("overrides,match", [
    (dict(topk_ids=jnp.zeros((T, 0), jnp.int32), topk_weights=jnp.ones((T, 0))),
     r"topk_ids must have at least one slot per token \(k >= 1\), got shape \(8, 0\)"),
    (dict(w_gate_up=jnp.ones((0, H, 2 * F)), w_down=jnp.ones((0, F, H))),
     r"w_gate_up must hold at least one expert, got shape \(0, 16, 16\)"),
    (dict(x=jnp.ones((T, H)).tolist()), "x must be a jax.Array or numpy array, got list"),
    (dict(topk_ids=[[0, 1]] * T), "topk_ids must be a jax.Array or numpy array, got list"),
    (dict(w_down=None), "w_down must be a jax.Array or numpy array, got NoneType"),
])
def test_empty_and_non_array_arguments(overrides, match):
  with pytest.raises(ValueError, match=match):
    jm.moe(**good_args(**overrides))


def test_numpy_arrays_are_accepted():
  import numpy as np
  args = {k: np.asarray(v) for k, v in good_args().items()}
  assert jm.moe(**args).shape == (T, H)


@pytest.mark.parametrize("kwargs,match", [
    (dict(dtype="float7"), "dtype must be float32, bfloat16 or float16, got 'float7'"),
    (dict(dtype=jnp.int32), "dtype must be float32, bfloat16 or float16"),
    (dict(param_dtype="int8"), "param_dtype must be a floating dtype, got 'int8'"),
    (dict(backend="triton"), "backend must be one of .* got 'triton'"),
    (dict(recipe="int4"), "recipe must be one of .* got 'int4'"),
    (dict(top_k=True), "top_k must be an int in .* got True"),
    (dict(hidden_size=16.0), "hidden_size must be a positive int, got 16.0"),
])
def test_module_rejects_bad_options_at_construction(kwargs, match):
  base = dict(hidden_size=H, ffn_size=F, num_experts=E, top_k=K)
  base.update(kwargs)
  with pytest.raises(ValueError, match=match):
    jm.MoE(**base, rngs=nnx.Rngs(0))


def test_module_accepts_numpy_integer_sizes():
  import numpy as np
  layer = jm.MoE(np.int64(H), np.int32(F), np.int64(E), np.int64(K), rngs=nnx.Rngs(0))
  assert type(layer.hidden_size) is int and layer.w_down.shape == (E, F, H)
  assert layer(jnp.ones((4, H))).shape == (4, H)


@pytest.mark.parametrize("x,match", [
    (jnp.float32(1.0), r"x's last axis must be hidden_size=16, got shape \(\)"),
    ([[1.0] * H], "x must be a jax.Array or numpy array, got list"),
])
def test_module_rejects_scalar_and_list_inputs(x, match):
  layer = jm.MoE(H, F, E, K, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=match):
    layer(x)


def test_symmetric_workspace_names_bad_arguments_and_non_gpu_devices():
  """Checked before any native call: on CPU devices the error says they are not GPUs (not a
  CUDA driver error), a float size names the parameter (not a ctypes error)."""
  from jax_megamoe import symmetric
  mesh = cpu_mesh((2,), ("expert",))
  with pytest.raises(ValueError, match="the mesh's devices are not GPUs .*platform cpu"):
    symmetric.create_workspace(mesh, "expert", max_tokens=8, hidden=16, top_k=2)
  for kwargs, match in ((dict(max_tokens=8.0), "max_tokens must be a positive int, got 8.0"),
                        (dict(top_k=0), "top_k must be a positive int, got 0"),
                        (dict(comm_blocks=True), "comm_blocks must be a positive int"),
                        (dict(timeout_s=-1.0), "timeout_s must be a positive number")):
    args = dict(max_tokens=8, hidden=16, top_k=2) | kwargs
    with pytest.raises(ValueError, match=match):
      symmetric.create_workspace(mesh, "expert", **args)

"""Qwen3Moe (jax_megamoe.models.qwen3): shapes, causality, mesh/FSDP invariance, remat, configs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

from jax_megamoe.models import CONFIGS, Qwen3Moe, Qwen3MoeConfig, get_config
from jax_megamoe.models.sharding import param_shardings
from jaxpr_helpers import sub_jaxprs

# Tiny and cheap, with a dense layer among the MoE ones and head_dim != hidden / heads.
SMALL = get_config("tiny", vocab_size=64, hidden_size=32, num_layers=3, num_heads=4,
                   num_kv_heads=2, head_dim=16, num_experts=8, top_k=2, moe_ffn_size=16,
                   dense_ffn_size=48, mlp_only_layers=(1,))


def _ids(batch=8, seq=8, seed=0):
  return jax.random.randint(jax.random.key(seed), (batch, seq), 0, SMALL.vocab_size)


def _forward(model, ids):
  return nnx.jit(lambda m, x: m(x, return_aux=True))(model, ids)


def test_shapes_and_aux():
  model = Qwen3Moe(SMALL, rngs=nnx.Rngs(0), dtype=jnp.float32)
  logits, aux = _forward(model, _ids(2, 8))
  assert logits.shape == (2, 8, SMALL.vocab_size) and logits.dtype == jnp.float32
  assert SMALL.num_moe_layers == 2
  assert aux.load_balancing_loss.shape == (2,) and aux.z_loss.shape == (2,)
  assert aux.expert_load.shape == (2, SMALL.num_experts)
  np.testing.assert_allclose(aux.expert_load.sum(axis=1), 1.0, rtol=1e-5)
  # Initial logits near uniform: std-0.02 weights.
  assert float(jnp.abs(logits).max()) < 1.0


def test_causal():
  model = Qwen3Moe(SMALL, rngs=nnx.Rngs(0), dtype=jnp.float32)
  ids = _ids(2, 8)
  changed = ids.at[:, 5].set((ids[:, 5] + 1) % SMALL.vocab_size)
  before, _ = _forward(model, ids)
  after, _ = _forward(model, changed)
  np.testing.assert_array_equal(before[:, :5], after[:, :5])
  assert not np.allclose(before[:, 5:], after[:, 5:])


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_mesh_with_fsdp_matches_single_device(axis_type):
  """data=2 x expert=4 over 8 virtual CPUs: same logits as without a mesh (fp32). Auto meshes
  also get FSDP over data (as the training script lays them out)."""
  mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(axis_type,) * 2)
  ids = _ids(8, 8)
  expected, expected_aux = _forward(Qwen3Moe(SMALL, rngs=nnx.Rngs(0), dtype=jnp.float32), ids)

  model = Qwen3Moe(SMALL, rngs=nnx.Rngs(0), dtype=jnp.float32, mesh=mesh)
  if axis_type == AxisType.Auto:
    params = nnx.state(model, nnx.Param)
    shardings = param_shardings(params, mesh, fsdp_axis="data")
    nnx.update(model, jax.tree.map(jax.device_put, params, shardings))
    assert "data" in model.layers[0].attn.q_proj.kernel[...].sharding.spec
    w_gate_up_spec = tuple(model.layers[0].mlp.w_gate_up[...].sharding.spec)
    assert w_gate_up_spec[0] == "expert" and "data" in w_gate_up_spec
  got, got_aux = _forward(model, ids)
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got_aux.expert_load, expected_aux.expert_load, atol=1e-6)


def test_remat_keeps_gradients():
  ids = _ids(2, 8)

  def grads(remat):
    model = Qwen3Moe(SMALL, rngs=nnx.Rngs(0), dtype=jnp.float32, remat=remat)
    loss = lambda m: jnp.mean(jax.nn.log_softmax(m(ids))[..., 0])
    return nnx.state(nnx.jit(nnx.grad(loss))(model), nnx.Param)

  for a, b in zip(jax.tree.leaves(grads("none")), jax.tree.leaves(grads("full"))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_tied_embeddings_have_no_head():
  model = Qwen3Moe(SMALL.replace(tie_word_embeddings=True), rngs=nnx.Rngs(0))
  assert not hasattr(model, "lm_head")
  logits = _forward(model, _ids(2, 4))[0]
  assert logits.shape == (2, 4, SMALL.vocab_size)


def test_published_configs():
  a3b = CONFIGS["qwen3-30b-a3b"]
  assert (a3b.num_layers, a3b.num_experts, a3b.top_k, a3b.moe_ffn_size) == (48, 128, 8, 768)
  # ~3.3B active parameters (matmuls incl. head): the "A3B".
  assert 3.0e9 < a3b.matmul_params_per_token() < 3.6e9
  a22b = CONFIGS["qwen3-235b-a22b"]
  assert 21e9 < a22b.matmul_params_per_token() < 23e9
  assert get_config("qwen3-30b-a3b", num_layers=4).num_layers == 4


def test_config_errors_name_the_field():
  with pytest.raises(ValueError, match=r"num_heads \(6\) must be a multiple of num_kv_heads"):
    SMALL.replace(num_heads=6, num_kv_heads=4)
  with pytest.raises(ValueError, match="config must be one of"):
    get_config("qwen3-1t")
  with pytest.raises(ValueError, match="remat must be one of"):
    Qwen3Moe(SMALL, rngs=nnx.Rngs(0), remat="some")
  with pytest.raises(ValueError, match="dense_ffn_size must be positive"):
    SMALL.replace(dense_ffn_size=0)


def test_from_hf_reads_both_rope_layouts():
  hf = dict(model_type="qwen3_moe", vocab_size=10, hidden_size=8, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, head_dim=4, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=6, intermediate_size=12,
            norm_topk_prob=True)
  assert Qwen3MoeConfig.from_hf({**hf, "rope_theta": 5.0}).rope_theta == 5.0
  assert Qwen3MoeConfig.from_hf(
      {**hf, "rope_parameters": {"rope_type": "default", "rope_theta": 7.0}}).rope_theta == 7.0
  with pytest.raises(NotImplementedError, match="rope_type 'yarn'"):
    Qwen3MoeConfig.from_hf({**hf, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}})


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "qwen3-235b-a22b"])
def test_published_shapes_trace_on_a_mesh(name):
  """The real configs (two layers) trace abstractly over data=2 x expert=4 with FSDP: no
  memory, no compile; catches shape or sharding mistakes at those sizes."""
  mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)
  config = get_config(name, num_layers=2)
  model = nnx.eval_shape(lambda: Qwen3Moe(config, rngs=nnx.Rngs(0), mesh=mesh, remat="full"))
  graphdef, params = nnx.split(model, nnx.Param)
  shardings = param_shardings(params, mesh, fsdp_axis="data")
  assert "data" in jax.tree.leaves(shardings)[0].spec  # embedding [V, H] is FSDP-sharded
  ids = jax.ShapeDtypeStruct((8, 256), jnp.int32)
  logits, aux = jax.eval_shape(lambda p, x: nnx.merge(graphdef, p)(x, return_aux=True),
                               params, ids)
  assert logits.shape == (8, 256, config.vocab_size)
  assert aux.expert_load.shape == (2, 128)


@pytest.mark.parametrize("one_pass", [False, True])
def test_chunked_cross_entropy_matches_full_logits(one_pass, monkeypatch):
  from jax_megamoe.models import losses
  from jax_megamoe.models.losses import chunked_cross_entropy
  import optax

  monkeypatch.setattr(losses, "CE_LSE_ONE_PASS", one_pass)

  model = Qwen3Moe(SMALL, rngs=nnx.Rngs(0), dtype=jnp.float32)
  ids, targets = _ids(2, 8, seed=1), _ids(2, 8, seed=2)

  def full(m):
    return optax.softmax_cross_entropy_with_integer_labels(m(ids), targets).mean()

  def chunked(m):
    return chunked_cross_entropy(m(ids, return_hidden=True), m.head(), targets, chunk=4)

  (loss_a, grad_a), (loss_b, grad_b) = (nnx.jit(nnx.value_and_grad(f))(model)
                                        for f in (full, chunked))
  np.testing.assert_allclose(loss_b, loss_a, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(nnx.state(grad_a, nnx.Param)),
                  jax.tree.leaves(nnx.state(grad_b, nnx.Param))):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-7)
  with pytest.raises(ValueError, match="chunk must be a positive int dividing seq=8, got 3"):
    chunked_cross_entropy(jnp.zeros((2, 8, 4)), jnp.zeros((4, 5)), targets, chunk=3)


def test_one_pass_logsumexp_matches_jax():
  """The one-pass (max, sum) reduce against jax.nn.logsumexp: large spreads, an all -inf row,
  a +inf logit, a NaN, and rows whose maximum comes last or first."""
  from jax_megamoe.models import losses

  x = np.random.default_rng(4).standard_normal((3, 5, 1001)).astype(np.float32) * 30
  x[0, 0] = -np.inf
  x[0, 1, 7] = np.inf
  x[0, 2, 9] = np.nan
  x[1, 0, -1] = 200.0
  x[1, 1, 0] = 200.0
  x[2, 3, :900] = -np.inf
  want = np.asarray(jax.nn.logsumexp(jnp.asarray(x), axis=-1))
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(losses, "CE_LSE_ONE_PASS", True)
    got = np.asarray(jax.jit(losses._logsumexp)(jnp.asarray(x)))
  assert got[0, 0] == -np.inf and got[0, 1] == np.inf and np.isnan(got[0, 2])
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("chunk", [8, 32])
def test_chunked_cross_entropy_bf16_backward_runs_bf16_gemms(chunk):
  """bf16 hidden states with a float32 head: the loss and both gradients stay within bf16
  rounding of the float32 computation, and every GEMM of the backward takes bf16 operands
  (autodiff of the float32 logits ran them as float32 GEMMs, 3x slower on an H200)."""
  from jax_megamoe.models.losses import chunked_cross_entropy
  import optax

  rng = np.random.default_rng(3)
  hidden32 = jnp.asarray(rng.standard_normal((2, 32, 64)), jnp.float32)
  head = jnp.asarray(rng.standard_normal((64, 500)) * 0.2, jnp.float32)
  targets = jnp.asarray(rng.integers(0, 500, (2, 32)), jnp.int32)
  hidden = hidden32.astype(jnp.bfloat16)

  def chunked(h, w):
    return chunked_cross_entropy(h, w, targets, chunk=chunk)

  def full(h, w):
    logits = jnp.einsum("bsh,hv->bsv", h.astype(jnp.float32),
                        w.astype(jnp.bfloat16).astype(jnp.float32))
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  loss, (dh, dw) = jax.value_and_grad(chunked, argnums=(0, 1))(hidden, head)
  want, (dh_want, dw_want) = jax.value_and_grad(full, argnums=(0, 1))(hidden, head)
  assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
  np.testing.assert_allclose(loss, want, rtol=1e-5)
  for got, ref in ((dh, dh_want), (dw, dw_want)):
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2

  jaxpr = jax.make_jaxpr(jax.grad(chunked, argnums=(0, 1)))(hidden, head)
  dots = []

  def visit(jp):
    for eqn in jp.eqns:
      if eqn.primitive.name == "dot_general":
        dots.append(tuple(v.aval.dtype for v in eqn.invars))
      for sub in sub_jaxprs(eqn.params):
        visit(sub)

  visit(jaxpr.jaxpr)
  assert len(dots) == 3, dots  # logits, d_hidden, d_head: the logits are made once
  assert all(a == b == jnp.bfloat16 for a, b in dots), dots



def test_moe_weight_blocks_give_the_same_model():
  """model(ids, moe_weight_blocks=model.quantize_moe_weights()) is model(ids) bit for bit,
  logits and every parameter's gradient, with and without remat (recipe fp8, reference
  backend; the dense layer's entry is None); a wrong length or a bf16 model is refused."""
  config = get_config("tiny", vocab_size=64, hidden_size=128, num_layers=3, num_heads=2,
                      num_kv_heads=1, head_dim=64, num_experts=4, top_k=2, moe_ffn_size=128,
                      dense_ffn_size=64, mlp_only_layers=(1,))
  ids = jax.random.randint(jax.random.key(3), (2, 16), 0, config.vocab_size)
  for remat in ("none", "full"):
    model = Qwen3Moe(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, backend="reference",
                     recipe="fp8", remat=remat)
    graphdef, params = nnx.split(model)

    def loss(params, with_blocks):
      m = nnx.merge(graphdef, params)
      blocks = m.quantize_moe_weights() if with_blocks else None
      return jnp.mean(m(ids, moe_weight_blocks=blocks) ** 2)

    results = [jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, b)
               for b in (False, True)]
    (v0, g0), (v1, g1) = results
    assert np.isfinite(float(v0)) and float(v0) > 0
    np.testing.assert_array_equal(np.asarray(v0), np.asarray(v1))
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert model.quantize_moe_weights()[1] is None
  with pytest.raises(ValueError, match="one entry per decoder layer \\(3\\), got 2"):
    model(ids, moe_weight_blocks=(None, None))
  plain = Qwen3Moe(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, backend="reference")
  with pytest.raises(ValueError, match="got recipe None"):
    plain.quantize_moe_weights()

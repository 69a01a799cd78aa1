"""CPU tests of the expert-parallel backend's Python side: workspace sizing, capacity, validation,
and that the layer and its gradient trace to the four EP custom calls (no GPU needed)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from jax_megamoe import symmetric
from jax_megamoe.backends import cuda_ep
import ep_helpers


def test_workspace_bytes_formula():
  R, T, H, k = 2, 16384, 2048, 8
  got = symmetric.workspace_bytes(R, T, H, k, 2)
  expected = 512 + 3 * R * T * k * 4 + 2 * R * T * H * 2
  assert expected <= got < expected + 6 * 256
  assert symmetric.workspace_bytes(8, 16384, 4096, 8, 2) > 2 * 2**30


def test_workspace_layout_matches_native():
  try:
    native = symmetric.native_layout(3, 1000, 136, 6, 4)
  except RuntimeError as e:
    pytest.skip(f"not run: {e}")
  assert native == symmetric.workspace_layout(3, 1000, 136, 6, 4)
  # With the fused kernel's regions (and without them, the same offsets as before).
  fused = symmetric.native_layout(3, 1000, 136, 6, 4, fused_rows=777)
  assert fused == symmetric.workspace_layout(3, 1000, 136, 6, 4, fused_rows=777)
  assert fused["fpool"] < fused["fcomb"] < fused["total_bytes"]
  assert fused["pool_c"] == native["pool_c"]


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_ranks=9), "num_ranks"), (dict(elem_bytes=1), "elem_bytes"),
    (dict(hidden=3), "multiple of 16"), (dict(top_k=33), "top_k"),
    (dict(max_tokens=0), "max_tokens")])
def test_workspace_size_validation(kwargs, match):
  args = dict(num_ranks=2, max_tokens=8, hidden=64, top_k=2, elem_bytes=2) | kwargs
  with pytest.raises(ValueError, match=match):
    symmetric.workspace_bytes(**args)


def test_capacity_rows():
  assert cuda_ep.dropless_capacity(2, 100, 8, 64) == 1600
  assert cuda_ep.dropless_capacity(2, 100, 8, 4) == 800
  assert cuda_ep.capacity_rows(2, 100, 8, 64, None) == 1600
  assert cuda_ep.capacity_rows(2, 100, 8, 64, 1.0) == 896  # 800 rounded up to 128 rows
  assert cuda_ep.capacity_rows(2, 100, 8, 64, 100.0) == 1600  # never above dropless
  with pytest.raises(ValueError, match="capacity_factor"):
    cuda_ep.capacity_rows(2, 100, 8, 64, 0.0)


def _fake_workspace(mesh, **kw):
  args = dict(id=424242, num_ranks=mesh.shape["expert"], max_tokens=32, hidden=64, top_k=4,
              elem_bytes=4, comm_blocks=8, timeout_s=1.0, device_ids=(), expert_axis="expert",
              bytes_per_device=0, multiprocess=False)
  args.update(kw)
  return symmetric.SymmetricWorkspace(**args)


def _problem(tokens=64, hidden=64, ffn=32, experts=8, top_k=4, dtype=jnp.float32):
  rng = np.random.default_rng(0)
  ids, w = ep_helpers.routing(rng, tokens, experts, top_k)
  x = jnp.asarray(rng.standard_normal((tokens, hidden)), dtype)
  wgu, wd = ep_helpers.weights_for(rng, experts, hidden, ffn, dtype)
  return x, jnp.asarray(ids), jnp.asarray(w), wgu, wd


def test_layer_and_gradient_trace_to_ep_custom_calls():
  mesh = Mesh(np.array(jax.devices()[:2]), ("expert",))
  ws = _fake_workspace(mesh)
  x, ids, w, wgu, wd = _problem()

  def loss(x, w, wgu, wd):
    y = cuda_ep.expert_parallel_moe(x, ids, w, wgu, wd, mesh=mesh, workspace=ws,
                                    mlp=ep_helpers.dense_grouped_mlp)
    return jnp.sum(y * y)

  text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, w, wgu, wd))
  for target in ("megamoe_ep_dispatch_fwd", "megamoe_ep_combine_fwd", "megamoe_ep_combine_bwd",
                 "megamoe_ep_dispatch_bwd"):
    assert target in text, target
  assert "424242" in text


def test_validation_messages():
  mesh = Mesh(np.array(jax.devices()[:2]), ("expert",))
  x, ids, w, wgu, wd = _problem()
  small = _fake_workspace(mesh, max_tokens=8)
  with pytest.raises(ValueError, match="cannot hold 32 tokens"):
    jax.make_jaxpr(lambda x: cuda_ep.expert_parallel_moe(
        x, ids, w, wgu, wd, mesh=mesh, workspace=small,
        mlp=ep_helpers.dense_grouped_mlp))(x)
  with pytest.raises(ValueError, match="expert_axis"):
    cuda_ep.expert_parallel_moe(x, ids, w, wgu, wd, mesh=mesh, expert_axis="ep", workspace=small,
                                mlp=ep_helpers.dense_grouped_mlp)
  with pytest.raises(ValueError, match="divide evenly"):
    cuda_ep.expert_parallel_moe(x[:63], ids[:63], w[:63], wgu, wd, mesh=mesh, workspace=small,
                                mlp=ep_helpers.dense_grouped_mlp)
  with pytest.raises(ValueError, match="experts 7 must divide evenly"):
    distinct = jnp.tile(jnp.arange(ids.shape[1], dtype=jnp.int32), (ids.shape[0], 1))
    cuda_ep.expert_parallel_moe(x, distinct, w, wgu[:7], wd[:7], mesh=mesh, workspace=small,
                                mlp=ep_helpers.dense_grouped_mlp)
  wrong = _fake_workspace(mesh, device_ids=(1, 0))
  with pytest.raises(ValueError, match="created for devices"):
    cuda_ep.expert_parallel_moe(x, ids, w, wgu, wd, mesh=mesh, workspace=wrong,
                                mlp=ep_helpers.dense_grouped_mlp)
  with pytest.raises(ValueError, match="dtype int32"):
    cuda_ep.expert_parallel_moe(x.astype(jnp.int32), ids, w, wgu, wd, mesh=mesh, workspace=small,
                                mlp=ep_helpers.dense_grouped_mlp)


def test_overflow_stats_raise_clear_errors():
  with pytest.raises(RuntimeError, match="overflow.*3000.*capacity is 2048"):
    cuda_ep.raise_on_bad_stats(np.array([3000, 2048, 1, 0], np.int32))
  with pytest.raises(RuntimeError, match="distinct"):
    cuda_ep.raise_on_bad_stats(np.array([10, 2048, 0, 2], np.int32))
  cuda_ep.raise_on_bad_stats(np.array([10, 2048, 0, 0], np.int32))


def test_data_and_expert_axes_trace():
  """Tokens over ("data", "expert"), experts over "expert": 4 EP groups of 2 on 8 CPU devices."""
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "expert"))
  ws = _fake_workspace(mesh, max_tokens=16,
                       device_ids=tuple(int(d.id) for d in mesh.devices.reshape(-1)))
  x, ids, w, wgu, wd = _problem(tokens=128)

  def loss(x, w, wgu, wd):
    return jnp.sum(cuda_ep.expert_parallel_moe(x, ids, w, wgu, wd, mesh=mesh, workspace=ws,
                                               mlp=ep_helpers.dense_grouped_mlp))

  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, w, wgu, wd)
  assert "megamoe_ep_dispatch_bwd" in str(jaxpr)


def test_unavailable_reason_on_cpu():
  mesh = Mesh(np.array(jax.devices()[:2]), ("expert",))
  assert cuda_ep.unavailable_reason(mesh) is not None


@pytest.mark.parametrize("num_ranks", [1, 3])
def test_virtual_group_fp8_rows_trace(num_ranks):
  """A virtual group's recipe-"fp8" layer slices each rank's FP8 rows (a QuantizedRows pytree)
  leaf by leaf: forward and gradients trace to the EP custom calls and the FP8 GEMMs (tracing
  indexed the tuple once, which the GPU tests caught)."""
  from jax_megamoe import virtual_ranks
  from jax_megamoe.backends import cuda
  ws = _fake_workspace(Mesh(np.array(jax.devices()[:1]), ("expert",)), num_ranks=num_ranks,
                       max_tokens=32, hidden=128, elem_bytes=2, virtual=True)
  tokens, experts = 32, 6
  x, ids, w, wgu, wd = _problem(tokens * num_ranks, hidden=128, ffn=128, experts=experts,
                                dtype=jnp.bfloat16)
  stack = lambda a: a.reshape(num_ranks, tokens, *a.shape[1:])
  mlp = cuda.expert_mlp("fp8", jnp.bfloat16, 128, 128)

  def loss(x, w, wgu, wd):
    y = virtual_ranks.expert_parallel_moe(stack(x), stack(ids), stack(w), wgu, wd,
                                          workspace=ws, mlp=mlp, fp8_dispatch=True)
    return jnp.sum(y.astype(jnp.float32))

  text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, w, wgu, wd))
  assert "megamoe_ep_dispatch_fwd" in text and "megamoe_ep_dispatch_bwd" in text
  assert "float8_e4m3fn" in text
  # Rematerialised under the models' "full" policy: each rank's two weights quantised once
  # (the recomputed forward reads the saved blocks: cuda_fp8 module doc), twice without it.
  from jax_megamoe.backends import cuda_fp8
  from jax_megamoe.models import REMAT_POLICIES
  for policy, quantisations in ((REMAT_POLICIES["full"], 2 * num_ranks),
                                (jax.checkpoint_policies.nothing_saveable, 4 * num_ranks)):
    step = jax.grad(jax.checkpoint(loss, policy=policy), argnums=(0, 1, 2, 3))
    text = str(jax.make_jaxpr(step)(x, w, wgu, wd))
    assert text.count(cuda_fp8.QUANTIZE_WEIGHTS_TARGET) == quantisations


def test_close_all_without_workspaces_needs_no_cuda():
  """Nothing to close: a CPU build (no CUDA library) can call close_all, e.g. a worker's
  clean-up after a run that never made a workspace."""
  symmetric.close_all()


def test_fp8_layer_under_remat_inside_shard_map_quantises_each_weight_once():
  """The mesh path (the weight blocks quantised inside shard_map, per device) under the models'
  "full" remat policy: each weight quantised once per step, twice with nothing_saveable."""
  from jax_megamoe.backends import cuda, cuda_fp8
  from jax_megamoe.models import REMAT_POLICIES
  mesh = Mesh(np.array(jax.devices()[:2]), ("expert",))
  ws = _fake_workspace(mesh, max_tokens=32, hidden=128, elem_bytes=2)
  x, ids, w, wgu, wd = _problem(hidden=128, ffn=128, dtype=jnp.bfloat16)
  mlp = cuda.expert_mlp("fp8", jnp.bfloat16, 128, 128)

  def loss(x, w, wgu, wd):
    return jnp.sum(cuda_ep.expert_parallel_moe(x, ids, w, wgu, wd, mesh=mesh, workspace=ws,
                                               mlp=mlp).astype(jnp.float32))

  for policy, quantisations in ((REMAT_POLICIES["full"], 2),
                                (jax.checkpoint_policies.nothing_saveable, 4)):
    step = jax.grad(jax.checkpoint(loss, policy=policy), argnums=(0, 1, 2, 3))
    text = str(jax.make_jaxpr(step)(x, w, wgu, wd))
    assert text.count(cuda_fp8.QUANTIZE_WEIGHTS_TARGET) == quantisations


@pytest.mark.parametrize("num_ranks", [1, 2, 4])
def test_fused_gradient_traces_to_cuda_backward(num_ranks):
  """Backend fused's backward from the kernel's residuals (its Python side, traced on CPU): one
  rank and a virtual group alike read the kept rows and the slot tables built from every
  source's slot_dest, recompute no dispatch and no GEMM, and end in cuda's EP backward."""
  from jax_megamoe import virtual_ranks
  from jax_megamoe.backends import fused
  tokens, hidden, ffn, experts, top_k = 32, 256, 128, 8, 2
  mesh = Mesh(np.array(jax.devices()[:1]), ("expert",))
  ws = _fake_workspace(mesh, num_ranks=num_ranks, max_tokens=tokens, hidden=hidden, top_k=top_k,
                       elem_bytes=2, fused_rows=num_ranks * tokens * top_k,
                       virtual=num_ranks > 1)
  x, ids, w, wgu, wd = _problem(tokens * num_ranks, hidden, ffn, experts, top_k, jnp.bfloat16)
  stack = lambda a: a.reshape(num_ranks, tokens, *a.shape[1:])

  def loss(x, w, wgu, wd):
    if num_ranks == 1:
      plan = cuda_ep.LayerPlan(n_cap=tokens * top_k, check_capacity=False, fp8_rows=False)
      cfg = fused.FusedConfig(ws, experts, plan, max_ctas=0)
      y = fused.fused_layer(x, ids, w, wgu, wd, cfg)
    else:
      y = virtual_ranks.fused_moe(stack(x), stack(ids), stack(w), wgu, wd, workspace=ws)
    return jnp.sum(y.astype(jnp.float32))

  text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, w, wgu, wd))
  assert text.count(fused.TARGET) == 1
  for target in ("megamoe_ep_combine_bwd", "megamoe_grouped_mlp_bwd", "megamoe_ep_dispatch_bwd"):
    assert target in text, target
  for gemm in ("megamoe_grouped_mlp_fwd", "megamoe_grouped_gemm"):
    assert gemm not in text, f"the backward recomputes a GEMM ({gemm})"
  assert "megamoe_ep_dispatch_fwd" not in text, "the backward dispatches the rows again"

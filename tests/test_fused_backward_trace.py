"""Backend "fused", the fused backward's kernel pass (MEGAMOE_FUSED_BACKWARD), the Python side:
traced and lowered on a CPU (the kernel itself runs on a GPU only).

What is checked: by default it runs with several ranks and not at one, "0" / "1" force it, and a
bad value is refused; requested, the
gradient program of a bf16 layer runs one fused backward call and the two wgrad GEMMs per rank,
no EP combine or dispatch VJP and no MLP backward of backend cuda; the forward keeps y_sorted
with one rank and y_comb (the comb rows) instead with several; F not a multiple of 256 and FP8
recipes keep backend cuda's backward; under jax.checkpoint the forward pass's call keeps no
residuals (one rank, and an EP = 2 mesh).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fused_trace_helpers import (E, H, K, T, config_for, errors_against, random_problem,
                                 traced_config)
from fused_trace_helpers import layer_inputs as _inputs
from jax_megamoe.backends import cuda_ep, fused


def _config(ffn, num_ranks=1, recipe=None):
  return traced_config(ffn, recipe=recipe, num_ranks=num_ranks)


def _grad_text(cfg, ffn, lead=()):
  x, ids, w, wgu, wd = _inputs(ffn, lead)

  def loss(x, w, a, b):
    return jnp.sum(fused.fused_layer(x, ids, w, a, b, cfg).astype(jnp.float32) ** 2)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))).lower(x, w, wgu, wd).as_text()


def _results_of_each(text: str, target: str) -> list[list[str]]:
  """Result types of every custom call to `target` in the lowered StableHLO."""
  return [re.findall(r"tensor<[^>]*>", line.rsplit(") -> ", 1)[1])
          for line in text.splitlines() if f"@{target}(" in line]


def _results(text: str, target: str) -> list[str]:
  """Result types of the one custom call to `target` in the lowered StableHLO."""
  (results,) = _results_of_each(text, target)
  return results


GATE_UP = 9  # the forward call's gate_up residual among its results (fused._fused_call)


@pytest.mark.parametrize("value, one_rank, several", [
    (None, False, True), ("auto", False, True), ("0", False, False), ("1", True, True)])
def test_on_with_several_ranks_by_default(monkeypatch, value, one_rank, several):
  """Unset or "auto": the kernel pass with several ranks (measured faster there), not at one;
  "0" / "1" force it off / on (where it applies: bf16, F % 256 == 0)."""
  if value is None:
    monkeypatch.delenv("MEGAMOE_FUSED_BACKWARD", raising=False)
  else:
    monkeypatch.setenv("MEGAMOE_FUSED_BACKWARD", value)
  assert _config(256).fused_backward(256) is one_rank
  assert _config(256, num_ranks=2).fused_backward(256) is several
  assert not _config(128, num_ranks=2).fused_backward(128)
  assert not _config(256, num_ranks=2, recipe="fp8").fused_backward(256)


def test_a_bad_value_is_refused(monkeypatch):
  monkeypatch.setenv("MEGAMOE_FUSED_BACKWARD", "yes")
  with pytest.raises(ValueError, match="MEGAMOE_FUSED_BACKWARD must be 0, 1 or auto, got 'yes'"):
    _config(256)


def test_one_rank_gradient_runs_the_fused_backward(monkeypatch):
  monkeypatch.setenv("MEGAMOE_FUSED_BACKWARD", "1")
  ffn = 256
  cfg = _config(ffn)
  assert cfg.one_rank and cfg.fused_backward(ffn)
  text = _grad_text(cfg, ffn)
  n_cap = cfg.plan.n_cap
  outs = _results(text, fused.TARGET)
  # Residuals: x_sorted, gate_up, y_sorted (the comb buffer, one rank alone); no y_comb.
  assert outs[8:12] == [f"tensor<{n_cap}x{H}xbf16>", f"tensor<{n_cap}x{2 * ffn}xbf16>",
                        f"tensor<{n_cap}x{H}xbf16>", "tensor<0xbf16>"], outs
  bwd = _results(text, fused.BWD_TARGET)
  assert bwd[:4] == [f"tensor<{T}x{H}xbf16>", f"tensor<{T}x{K}xf32>",
                     f"tensor<{n_cap}x{H}xbf16>", f"tensor<{n_cap}x{2 * ffn}xbf16>"], bwd
  assert text.count("@megamoe_grouped_gemm(") == 2  # the wgrads
  for cuda_kernel in ("ep_combine_bwd", "ep_dispatch_bwd", "grouped_mlp_bwd", "ep_dispatch_fwd"):
    assert f"@megamoe_{cuda_kernel}(" not in text, cuda_kernel


def test_several_ranks_keep_the_comb_rows_instead_of_y_sorted(monkeypatch):
  monkeypatch.setenv("MEGAMOE_FUSED_BACKWARD", "1")
  ffn, ranks = 256, 2
  cfg = _config(ffn, ranks)
  text = _grad_text(cfg, ffn, (ranks,))
  n_cap = cfg.plan.n_cap
  outs = _results(text, fused.TARGET)
  assert outs[10:12] == ["tensor<0xbf16>", f"tensor<{ranks}x{T * K}x{H}xbf16>"], outs
  bwd = _results(text, fused.BWD_TARGET)
  assert bwd[2] == f"tensor<{ranks}x{n_cap}x{H}xbf16>", bwd  # dy_sorted, per rank
  assert text.count("@megamoe_grouped_gemm(") == 2 * ranks
  assert "@megamoe_ep_combine_bwd(" not in text and "@megamoe_ep_dispatch_bwd(" not in text


@pytest.mark.parametrize("ffn, recipe", [(128, None), (256, "fp8")])
def test_backend_cuda_backward_where_the_kernel_pass_does_not_apply(monkeypatch, ffn, recipe):
  monkeypatch.setenv("MEGAMOE_FUSED_BACKWARD", "1")
  cfg = _config(ffn, recipe=recipe)
  assert cfg.kernel_backward and not cfg.fused_backward(ffn)
  text = _grad_text(cfg, ffn)
  assert f"@{fused.BWD_TARGET}(" not in text
  assert "@megamoe_ep_combine_bwd(" in text and "@megamoe_ep_dispatch_bwd(" in text


# --- the one-rank wiring, run on the CPU with stand-ins -----------------------------------------
# The forward kernel and the backward's kernel pass (CUDA only) are replaced by pure-JAX functions
# with their contracts (pool rows in expert then token order; the backward pass's dx, d topk
# weights, dy_sorted = w * dy and dgate_up in pool order), and so is the grouped wgrad GEMM (no
# CPU handler). Checks that the Python side pairs each wgrad with the right residuals.


def _pool_layout(ids, num_experts):
  from jax_megamoe import token_layout
  tokens, top_k = ids.shape
  slots = token_layout.sort_by_expert(ids.reshape(-1), num_experts)
  total = jnp.sum(slots.group_sizes)
  slot_dest = jnp.where(slots.inverse < total, slots.inverse, -1).reshape(tokens, top_k)
  return slots, slot_dest


def _ragged(a, b, group_sizes):
  return jax.lax.ragged_dot(a.astype(jnp.float32), b.astype(jnp.float32), group_sizes,
                            precision=jax.lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32)


def _forward_stand_in(x, ids, w, wgu, wd, cfg, *, residuals=False, fp8_scales=None):
  from jax_megamoe import token_layout
  assert fp8_scales is None
  tokens, top_k = ids.shape
  n_cap = cfg.plan.n_cap
  slots, slot_dest = _pool_layout(ids, cfg.num_experts)
  rows = jnp.zeros((n_cap, x.shape[1]), x.dtype).at[:tokens * top_k].set(
      x[slots.order // top_k])
  gate_up = _ragged(rows, wgu, slots.group_sizes).astype(jnp.bfloat16)
  g = gate_up.astype(jnp.float32)
  ffn = g.shape[1] // 2
  h = (jax.nn.silu(g[:, :ffn]) * g[:, ffn:]).astype(jnp.bfloat16)
  y_sorted = _ragged(h, wd, slots.group_sizes).astype(jnp.bfloat16)
  weights = token_layout.masked_weights(ids, w, cfg.num_experts)
  y = token_layout.combine_slots(y_sorted[jnp.maximum(slot_dest, 0)], weights, jnp.bfloat16)
  kept = (fused.FusedResiduals(gate_up, h, y_sorted, slots.group_sizes, rows, slot_dest)
          if residuals else None)
  return y, jnp.zeros((4,), jnp.int32), None, kept


def _grouped_gemm_stand_in(a, group_sizes, b, *, kind):
  """cuda_bf16.grouped_gemm's wgrad: [E, M, P], a_g^T b_g over group g's rows."""
  assert kind == "wgrad"
  ends = jnp.cumsum(group_sizes)
  row = jnp.arange(a.shape[0])[:, None]
  member = ((row >= ends - group_sizes) & (row < ends)).astype(jnp.float32)  # [N, E]
  return jnp.einsum("ng,nm,np->gmp", member, a.astype(jnp.float32),
                    b.astype(jnp.float32)).astype(a.dtype)


def _backward_pass_stand_in(dy, ids, w, y_comb, gate_up, wgu, wd, cfg):
  n_cap = cfg.plan.n_cap
  slots, slot_dest = _pool_layout(ids, cfg.num_experts)
  valid = slot_dest >= 0
  d32 = dy.astype(jnp.float32)
  dy_sorted = jnp.zeros((n_cap, dy.shape[1]), jnp.float32).at[
      jnp.where(valid, slot_dest, n_cap)].set(w[:, :, None] * d32[:, None, :], mode="drop")
  dy_sorted = dy_sorted.astype(jnp.bfloat16)
  d_w = jnp.where(valid, jnp.einsum(
      "th,tjh->tj", d32, y_comb[jnp.maximum(slot_dest, 0)].astype(jnp.float32)), 0.0)
  dh = _ragged(dy_sorted, jnp.swapaxes(wd, 1, 2), slots.group_sizes).astype(jnp.bfloat16)
  dh = dh.astype(jnp.float32)
  g = gate_up.astype(jnp.float32)
  ffn = g.shape[1] // 2
  gate, up = g[:, :ffn], g[:, ffn:]
  s = jax.nn.sigmoid(gate)
  dgate_up = jnp.concatenate([dh * up * s * (1 + gate * (1 - s)), dh * gate * s], axis=1)
  dgate_up = dgate_up.astype(jnp.bfloat16)
  dx_sorted = _ragged(dgate_up, jnp.swapaxes(wgu, 1, 2), slots.group_sizes)
  parts = jnp.where(valid[:, :, None], dx_sorted.astype(jnp.bfloat16)[
      jnp.maximum(slot_dest, 0)].astype(jnp.float32), 0.0)
  phases = jnp.zeros((len(fused.PHASES),), jnp.int32)
  return parts.sum(axis=1).astype(jnp.bfloat16), d_w, dy_sorted, dgate_up, phases


def test_one_rank_wiring_matches_the_reference(monkeypatch):
  import jax_megamoe as jm
  from moe_oracles import assert_errors_below
  monkeypatch.setenv("MEGAMOE_FUSED_BACKWARD", "1")
  monkeypatch.setattr(fused, "_fused_call", _forward_stand_in)
  monkeypatch.setattr(fused, "_fused_bwd_call", _backward_pass_stand_in)
  monkeypatch.setattr(fused.cuda_bf16, "grouped_gemm", _grouped_gemm_stand_in)
  monkeypatch.setattr(cuda_ep, "combine_backward", None)  # must not run
  monkeypatch.setattr(cuda_ep, "dispatch_backward", None)
  ffn = 256
  x, ids, w, wgu, wd, dy = random_problem(11, ffn, 16)
  cfg = config_for(x, ids, w, wgu, wd)
  assert cfg.fused_backward(ffn)
  errs = errors_against(lambda *a: fused.fused_layer(*a, cfg),
                        lambda *a: jm.moe(*a, backend="reference"), x, ids, w, wgu, wd, dy)
  assert_errors_below(errs, 2e-2)


@pytest.mark.parametrize("check_capacity", [False, True])
@pytest.mark.parametrize("recipe", [None, "fp8"])
def test_rematerialised_forward_without_residuals_runs_the_primal(recipe, check_capacity):
  """Under jax.checkpoint the forward pass's call keeps no residuals (optimize_remat: nothing
  reads them; the kernel skips their stores) and the backward's recomputation keeps them; also
  with the capacity check, a debug callback outside the custom_vjp (inside its fwd rule it would
  make the rule effectful, never recomputed: one call keeping every residual)."""
  import dataclasses
  ffn = 256
  cfg = traced_config(ffn, recipe=recipe)
  cfg = dataclasses.replace(cfg, plan=dataclasses.replace(cfg.plan, check_capacity=check_capacity))
  x, ids, w, wgu, wd = _inputs(ffn)

  def loss(x, w, a, b):
    layer = jax.checkpoint(lambda x, w, a, b: fused.fused_layer(x, ids, w, a, b, cfg))
    return jnp.sum(layer(x, w, a, b).astype(jnp.float32) ** 2)
  text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))).lower(x, w, wgu, wd).as_text()
  gate_up = [outs[GATE_UP] for outs in _results_of_each(text, fused.TARGET)]
  assert sorted(gate_up) == sorted(["tensor<0xbf16>", f"tensor<{cfg.plan.n_cap}x{2 * ffn}xbf16>"])
  assert ("callback" in text) == check_capacity


@pytest.mark.parametrize("recipe", [None, "fp8"])
def test_rematerialised_forward_without_residuals_under_an_ep_mesh(monkeypatch, recipe):
  """The same through jax_megamoe.moe on an EP = 2 mesh (shard_map; bf16 with the backward's
  kernel pass, fp8 with backend cuda's), a stand-in workspace."""
  import jax_megamoe as jm
  from jax.sharding import Mesh
  from jax_megamoe import backends, symmetric

  def workspace_for(mesh, axis, **kw):
    return symmetric.SymmetricWorkspace(
        id=7, num_ranks=2, max_tokens=kw["max_tokens"], hidden=kw["hidden"], top_k=kw["top_k"],
        elem_bytes=2, comm_blocks=8, timeout_s=1.0, device_ids=(0, 1), expert_axis=axis,
        bytes_per_device=0, multiprocess=False, fused_rows=kw["fused_rows"])
  monkeypatch.setattr(symmetric, "workspace_for", workspace_for)
  monkeypatch.setattr(backends, "unavailable_reason", lambda name, recipe=None: None)
  monkeypatch.setattr(cuda_ep, "unavailable_reason", lambda *a, **k: None)
  ffn = 256
  mesh = Mesh(np.array(jax.devices()[:2]), ("expert",))
  x, ids, w, wgu, wd = _inputs(ffn)

  def loss(x, w, a, b):
    layer = jax.checkpoint(lambda x, w, a, b: jm.moe(x, ids, w, a, b, mesh=mesh,
                                                     backend="fused", recipe=recipe))
    return jnp.sum(layer(x, w, a, b).astype(jnp.float32) ** 2)
  text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))).lower(x, w, wgu, wd).as_text()
  gate_up = sorted(outs[GATE_UP] for outs in _results_of_each(text, fused.TARGET))
  assert len(gate_up) == 2 and gate_up[0] == "tensor<0xbf16>", gate_up
  assert gate_up[1].endswith(f"x{2 * ffn}xbf16>"), gate_up

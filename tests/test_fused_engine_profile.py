"""The fused kernel's cycle accounting (a benchmark build, JAX_MEGAMOE_ENGINE_PROFILE=ON): the
layout the extension hands Python, the breakdown fused_phases.py prints from it, and, on a GPU,
what fused.engine_profile() returns (an error naming the build option on a plain build)."""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_megamoe as jm
from jax_megamoe import _ffi
from jax_megamoe.backends import fused

sys.path.append(str(pathlib.Path(__file__).resolve().parent.parent))
from benchmarks import fused_phases  # noqa: E402


def _layout():
  ext = _ffi.extension()
  if ext is None:
    pytest.skip("not run: the native extension is not built in this environment")
  return dict(ext.engine_profile_slots())


def test_layout_names_every_slot_once():
  layout = _layout()
  slots = [i for group in ("cta", "wg0", "wg1", "producer") for i in layout[group].values()]
  assert len(slots) == len(set(slots)), "two names share a slot"
  assert all(0 <= i < layout["slots"] for i in slots)
  assert layout["rows"] >= 132
  for wg in ("wg0", "wg1"):
    assert {"mainloop", "epilogue", "full_wait", "tiles", "kblocks", "begin_clk",
            "end_clk"} <= set(layout[wg])
  assert {"rows_wait", "empty_wait", "begin_clk", "end_clk"} <= set(layout["producer"])


@pytest.mark.parametrize("deferred", [0, 1])
def test_breakdown_of_known_counters(deferred):
  """Two CTAs of the last launch (a third row is an older launch's and must not count): the
  shares and per-tile figures are the sums' ratios, clocks wrap at 32 bits. With `deferred`
  tiles of each warpgroup's two deferred (MEGAMOE_DEFER_L1_EPILOGUE), the staged parts are per
  staged tile and the deferred tiles' cycles per deferred tile."""
  layout = _layout()
  v = np.zeros((layout["rows"], layout["slots"]), np.uint64)
  t0 = 5_000_000_000
  for cta in (0, 1):
    v[cta, layout["cta"]["begin_ns"]] = t0 + cta * 1000
    for wg in ("wg0", "wg1"):
      s = layout[wg]
      v[cta, s["begin_clk"]] = 2**32 - 500  # wraps: the role spans 10,000 cycles
      v[cta, s["end_clk"]] = 9_500
      v[cta, s["mainloop"]] = 8_000
      v[cta, s["full_wait"]] = 1_000
      v[cta, s["epilogue"]] = 1_500
      v[cta, s["job_wait"]] = 100
      v[cta, s["kblocks"]] = 8
      v[cta, s["tiles"]] = 2
      v[cta, s["epi_store"]] = 600
      v[cta, s["deferred_tiles"]] = deferred
      v[cta, s["epi_deferred"]] = 500 * deferred
      v[cta, s["deferred_parts"]] = 400 * deferred
      v[cta, s["deferred_parts_in_mainloop"]] = 300 * deferred
    p = layout["producer"]
    v[cta, p["begin_clk"]], v[cta, p["end_clk"]] = 0, 10_000
    v[cta, p["rows_wait"]] = 2_000
    v[cta, p["tiles"]] = 4
  v[2, layout["cta"]["begin_ns"]] = t0 - 10**9  # a launch a second earlier
  v[2, layout["wg0"]["mainloop"]] = 10**9
  b = fused_phases.engine_breakdown(layout, v)
  assert b["ctas"] == 2
  w = b["wg0"]
  assert w["cycles"] == 20_000
  assert w["share_pct"]["mainloop"] == pytest.approx(80.0)
  assert w["share_pct"]["epilogue"] == pytest.approx(15.0)
  assert w["share_pct"]["full_wait"] == pytest.approx(10.0)
  assert w["mainloop_cycles_per_stage"] == pytest.approx(1000.0)
  assert w["epilogue_cycles_per_tile"] == pytest.approx(750.0)
  assert w["epilogue_parts_per_tile"]["epi_store"] == pytest.approx(300.0 * (1 + deferred))
  assert w["deferred_tiles"] == 2 * deferred
  if deferred:
    assert w["deferred_per_tile"] == pytest.approx(
        {"epi_deferred": 500.0, "deferred_parts": 400.0, "deferred_parts_in_mainloop": 300.0})
  assert b["producer"]["rows_wait_pct"] == pytest.approx(20.0)
  assert b["producer"]["tiles"] == 8
  fused_phases.print_engine_breakdown(b)


@pytest.mark.gpu
def test_engine_profile_after_a_fused_call():
  """After a fused forward: on a plain build the read fails and names the build option; on a
  profiling build every CTA of the launch counted its tiles and cycles."""
  reason = fused.unavailable_reason()
  if reason is not None:
    pytest.skip(f"not run: {reason}")
  rng = np.random.default_rng(3)
  tokens, experts, top_k, hidden, ffn = 512, 16, 4, 256, 128
  x = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.bfloat16)
  ids = jnp.asarray(np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k], jnp.int32)
  w = jnp.asarray(rng.random((tokens, top_k)), jnp.float32)
  wgu = jnp.asarray(rng.standard_normal((experts, hidden, 2 * ffn)) * 0.05, jnp.bfloat16)
  wd = jnp.asarray(rng.standard_normal((experts, ffn, hidden)) * 0.05, jnp.bfloat16)
  jax.block_until_ready(jax.jit(lambda *a: jm.moe(*a, backend="fused"))(x, ids, w, wgu, wd))
  if not jm.build_info()["engine_profile"]:
    with pytest.raises(Exception, match="JAX_MEGAMOE_ENGINE_PROFILE=ON"):
      fused.engine_profile()
    return
  b = fused_phases.engine_breakdown(*fused.engine_profile())
  assert b["ctas"] > 0
  tiles = b["wg0"]["tiles"]
  assert tiles > 0 and b["wg1"]["tiles"] == tiles and b["producer"]["tiles"] == tiles
  assert 0 < b["wg0"]["share_pct"]["mainloop"] < 100

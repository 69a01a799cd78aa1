"""The JAX implementations the layer benchmark compares, and how each pass of one is timed.

Implementations share one signature, layer(x, topk_ids, topk_weights, w_gate_up, w_down) -> y,
under one mesh: jax_megamoe.moe with each backend, and the JAX-native baseline. "megamoe:B+blocks"
(FP8 recipes) is backend B with its weights quantised once before the timed
calls (jax_megamoe.quantize_expert_weights, moe(..., weight_blocks=)), as a training step
that quantises once per step or an inference loop sees it: its w_gate_up input is the pair
(w_gate_up, blocks), made by layer_inputs.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp

from benchmarks import timing
from benchmarks.baselines import jax_native

MEGAMOE_BACKENDS = ("reference", "cuda", "fused")
BLOCKS = "+blocks"
IMPLS = (tuple(f"megamoe:{b}" for b in MEGAMOE_BACKENDS) + ("jax_native",)
         + tuple(f"megamoe:{b}{BLOCKS}" for b in MEGAMOE_BACKENDS))


def _backend(impl: str) -> str:
  return impl.split(":")[1].removesuffix(BLOCKS)


def recipe_arg(recipe: str) -> str | None:
  """Benchmark recipe name -> jax_megamoe.moe's recipe ("bf16" is None; others pass through,
  e.g. "fp8", "mxfp8", or any recipe a backend adds)."""
  return None if recipe == "bf16" else recipe


def unavailable_reason(impl: str, recipe: str) -> str | None:
  if impl == "jax_native":
    return None if recipe == "bf16" else "bf16 only (ragged_dot has no blockwise FP8 path)"
  try:
    from jax_megamoe import backends  # noqa: PLC0415  (after the platform is set up)
    from jax_megamoe.backends import cuda_fp8  # noqa: PLC0415
    if impl.endswith(BLOCKS) and recipe not in cuda_fp8.RECIPES:
      return f"weight blocks are for recipes {cuda_fp8.RECIPES}"
    return backends.unavailable_reason(_backend(impl), recipe_arg(recipe))
  except Exception as e:  # noqa: BLE001  (a broken backend must not stop the others)
    return f"the backend failed to load: {timing.classify_error(e)[1]}"


def make_layer(impl: str, recipe: str, mesh, expert_axis: str = "expert"):
  if impl == "jax_native":
    return functools.partial(jax_native.moe, mesh=mesh, expert_axis=expert_axis)
  import jax_megamoe  # noqa: PLC0415
  layer = functools.partial(jax_megamoe.moe, mesh=mesh, expert_axis=expert_axis,
                            backend=_backend(impl), recipe=recipe_arg(recipe))
  if not impl.endswith(BLOCKS):
    return layer
  return lambda x, ids, w, wgu_blocks, wd: layer(x, ids, w, wgu_blocks[0], wd,
                                                 weight_blocks=wgu_blocks[1])


def fallback_reason(impl: str, layer, inputs) -> str | None:
  """Why megamoe:fused* did not lower to the fused kernel for these inputs (backend fused runs
  the layers and meshes its kernel does not take on backend cuda), so that its numbers are not
  recorded as the fused kernel's; None when it did, or for any other implementation."""
  if not impl.startswith("megamoe:") or _backend(impl) != "fused":
    return None
  from jax_megamoe.backends import fused  # noqa: PLC0415
  if fused.TARGET in jax.jit(layer).lower(*inputs).as_text():
    return None
  return f"backend fused ran this case on backend cuda (no {fused.TARGET} in its program)"


def layer_inputs(impl: str, recipe: str, mesh, inputs, expert_axis: str = "expert"):
  """The inputs (x, topk_ids, topk_weights, w_gate_up, w_down) as make_layer(impl)'s layer takes
  them: for "+blocks", w_gate_up becomes (w_gate_up, its and w_down's blocks), quantised here,
  once, outside the timed calls."""
  if not impl.endswith(BLOCKS):
    return inputs
  x, ids, w, wgu, wd = inputs
  return x, ids, w, (wgu, weight_blocks(wgu, wd, recipe, mesh, expert_axis)), wd


def weight_blocks(w_gate_up, w_down, recipe: str, mesh, expert_axis: str = "expert"):
  """w_gate_up's and w_down's blocks for recipe (an FP8 one), quantised once under `mesh`, as
  a training step that quantises once per step reads them (moe's weight_blocks)."""
  import jax_megamoe  # noqa: PLC0415
  quantize = jax.jit(functools.partial(jax_megamoe.quantize_expert_weights, recipe=recipe,
                                       mesh=mesh, expert_axis=expert_axis))
  return quantize(w_gate_up, w_down)


def _differentiable(layer, topk_ids):
  """layer as a function of the differentiable inputs (x, topk_weights, w_gate_up, w_down)."""
  return lambda x, w, wgu, wd: layer(x, topk_ids, w, wgu, wd)


def pass_functions(layer):
  """jitted callables per pass; each takes (inputs, dy) and returns something to block on.

  fwd   y = layer(...)
  bwd   the backward alone: residuals from one earlier jax.vjp call, then vjp(dy) timed
  2f1b  jax.vjp of jax.checkpoint(layer) applied to dy: forward, re-forward, backward (the cost
        under full activation checkpointing; checkpoint keeps XLA from merging the forwards)
  """
  fwd = jax.jit(layer)
  fwd_with_residuals = jax.jit(
      lambda x, ids, w, wgu, wd: jax.vjp(_differentiable(layer, ids), x, w, wgu, wd))
  apply_vjp = jax.jit(lambda vjp, dy: vjp(dy))

  @jax.jit
  def two_forward_one_backward(x, ids, w, wgu, wd, dy):
    y, vjp = jax.vjp(jax.checkpoint(_differentiable(layer, ids)), x, w, wgu, wd)
    return y, vjp(dy)

  def bwd_setup(inputs, dy):
    _, vjp = fwd_with_residuals(*inputs)
    return lambda: apply_vjp(vjp, dy)

  return {
      "fwd": lambda inputs, dy: (lambda: fwd(*inputs)),
      "bwd": bwd_setup,
      "2f1b": lambda inputs, dy: (lambda: two_forward_one_backward(*inputs, dy)),
  }


def time_passes(layer, inputs, dy, passes, *, reps: int, case_cap_s: float,
                deadline: timing.Deadline, log=print) -> dict[str, dict]:
  """{pass: {"status", "ms", "samples", "spread", "compile_s"} or {"status", "error"}}."""
  fns = pass_functions(layer)
  out = {}
  for name in passes:
    if deadline.expired:
      out[name] = {"status": "skipped", "error": "time budget"}
      continue
    try:
      t0 = time.perf_counter()
      call = fns[name](inputs, dy)
      run = lambda call=call: jax.block_until_ready(call())  # noqa: E731
      run()  # compile + first run
      compile_s = time.perf_counter() - t0
      result = timing.measure_ms(run, warmup=1, reps=reps, cap_s=case_cap_s)
      result.update(timing.measure_queued_ms(call, jax.block_until_ready))
      out[name] = {"status": "ok", "compile_s": round(compile_s, 2), **result}
      log(f"    {name:5s} {result['ms']:9.3f} ms  queued {result['queued_ms']:9.3f} ms  "
          f"({result['samples']} reps, compile+first {compile_s:.1f} s)")
    except Exception as e:  # noqa: BLE001  (recorded, the run goes on)
      status, message = timing.classify_error(e)
      out[name] = {"status": status, "error": message}
      log(f"    {name:5s} {status}: {message[:200]}")
  return out


def layer_outputs(layer, inputs, dy):
  """(y, (dx, dtopk_weights, dw_gate_up, dw_down)) for numerics checks, in one jitted call."""
  @jax.jit
  def outputs(x, ids, w, wgu, wd, dy):
    y, vjp = jax.vjp(_differentiable(layer, ids), x, w, wgu, wd)
    return y, vjp(dy.astype(y.dtype))
  return outputs(*inputs, dy)


def relative_error(got, want) -> float:
  got, want = jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32)
  scale = float(jnp.max(jnp.abs(want)))
  return float(jnp.max(jnp.abs(got - want))) / (scale if scale > 0 else 1.0)

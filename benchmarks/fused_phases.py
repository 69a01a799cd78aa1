"""Where the fused forward's time goes: the kernel stamps CTA 0's clock at the end of each of its
phases (backends.fused.PHASES); this prints the median duration of each phase over repeated
calls of the layer benchmark's problem (EP=1, one GPU), beside the whole call's time.

  python3 benchmarks/fused_phases.py [--shapes 30b,235b] [--tokens 16384] [--reps 20]
      [--recipe bf16|fp8|fp8_pow2] [--kernel-pass fwd|fwd-residuals|bwd] [--copy-heads 100,12,0]
      [--debug-bits 0,2] [--out F]

--kernel-pass bwd prints the same phases for the fused backward's kernel pass (bf16), called
alone on the residuals of one forward: routing again, the w * dy rows' copy with d topk_weights
("head copied": all of it, in token order, and the arrivals released after the rank's barrier;
the backward ignores MEGAMOE_FUSED_COPY_HEAD), "GEMM tiles done" for the dh and dx tiles, then
the unweighted slot sum into dx.
--kernel-pass fwd-residuals: the forward keeping the backward's residuals, as a training step's
forward runs it (with one rank: gate_up stored by L1's epilogue, the pool and comb rows in XLA
buffers).
--debug-bits 0,2 compares MEGAMOE_FUSED_DEBUG values (2: no GEMM tile, the routing, copies and
combine alone; 1: the first GEMM's tiles only; 4: no gate_up stored, with fwd-residuals: what
that residual costs), interleaved as --copy-heads.

Each row also gives the GEMM region ("rows copied" + "GEMM tiles done": the tiles with the copy
beside them) and the two GEMMs' TFLOP/s over it (gemm_region), the rate issue 14's misses are
explained by.
The phases are seen from CTA 0 (the other CTAs' work overlaps the boundaries: "head copied" is
CTA 0's share of the copy plan's head, before the GEMMs; "rows copied" ends when CTA 0's first
copy warp has copied its share of the rest beside the tiles, and "GEMM tiles done" is measured
from there, waiting for every CTA's tiles). --copy-heads 100,12,0 times the kernel at each of
those MEGAMOE_FUSED_COPY_HEAD values (the percent of the rows copied before the GEMMs; 100:
the whole copy first), the calls interleaved value by value so that clocks and heat are shared.

--engine-profile (an extension built with JAX_MEGAMOE_ENGINE_PROFILE=ON, e.g.
`JAX_MEGAMOE_ENGINE_PROFILE=ON scripts/device_run.sh build`) also prints, after one more call,
where the tile engine's cycles went inside the kernel (ffi/gemm/sm90_engine_profile.cuh): per
consumer warpgroup the job waits, the mainloop (cycles a stage against the tensor cores' 1,024)
and the epilogue by part; the producer's waits for free stages and for rows (the copy beside
the tiles); over every CTA of the launch.

--overhead also measures, for backends "fused" and "cuda" (the layer as bench_layer runs it),
where a host-timed call's time goes beyond the kernels: the call timed alone
(block_until_ready each call, as bench_layer does), the same calls queued back to back (one
wait at the end: launch and dispatch hidden behind the GPU), and from a profiler trace of
queued calls the GPU time of each kernel per call and the GPU's idle time between calls.
To place the alone-vs-queued gap it also times a trivial jitted program on the same arguments
alone (the floor of dispatch + wait), and reads a trace of alone calls: the GPU's busy time per
call there, and its idle time inside calls (gaps under 50 us between a call's kernels: the host
enqueueing kernels slower than the GPU runs them).
The layer is called under bench_layer's one-device mesh (EP=1), so that its figures are
those of the bar; --no-mesh calls it with mesh=None (backend "cuda" then runs its single-device
path: XLA sort and gathers around the grouped GEMMs; its backward held 4 ms of XLA scatters at
30B fp8 in session 10, since replaced by gathers: token_layout).
--overhead-pass grad does that for one training pass of the layer instead of its forward:
the gradients of <y, dy> w.r.t. x, the routing weights and both expert weights (the forward in
its residual mode, then the backward), so that the kernels of two backends' backward passes
can be compared one by one.
--weight-blocks (FP8 recipes) has --overhead's calls of both backends read the weights quantised
once before them (moe's weight_blocks), as bench_layer's "+blocks" rows: the split of the call
whose kernel is under issue 14's FP8 bars while the call is not (RESULTS "Session 40").
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 2)[0])
from benchmarks import problem  # noqa: E402
import jax_megamoe  # noqa: E402
from benchmarks import jax_impls, step_breakdown, timing, trace_events  # noqa: E402
from jax_megamoe.backends import fused  # noqa: E402


# Kernels of one alone call are closer than this; alone calls are farther apart (each waits for
# the previous one to finish and return to Python first).
_CALL_GAP_NS = 50e3


def _alone_ms(fn, args, reps: int) -> float:
  """The median of reps calls of fn(*args), each waited for (as bench_layer times a call)."""
  jax.block_until_ready(fn(*args))
  alone = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    alone.append((time.perf_counter() - t) * 1e3)
  return statistics.median(alone)


def _device_events(fn_calls) -> list:
  """The device events of a profiler trace of fn_calls()."""
  trace_dir = tempfile.mkdtemp(prefix="fused_overhead_")
  with jax.profiler.trace(trace_dir):
    fn_calls()
  platform = jax.devices()[0].platform
  return [e for e in trace_events.read_trace(trace_dir).events if e.device.startswith(platform)]


def alone_trace(events: list, calls: int) -> dict:
  """From a trace of `calls` calls each waited for: per call, the GPU's busy time and its idle
  time between kernels closer than _CALL_GAP_NS (inside a call); alone_groups_seen: the groups
  of kernels farther apart than that (more than `calls` where a call itself has such a gap)."""
  events = sorted(events, key=lambda e: e.start_ns)
  groups, inside, end = 0, 0.0, None
  for e in events:
    if end is None or e.start_ns - end > _CALL_GAP_NS:
      groups += 1
    elif e.start_ns > end:
      inside += e.start_ns - end
    end = e.end_ns if end is None else max(end, e.end_ns)
  return {"alone_groups_seen": groups,
          "alone_gpu_busy_ms": step_breakdown.busy_ns(events) / calls * 1e-6,
          "alone_gpu_idle_inside_ms": inside / calls * 1e-6}


def call_overhead(fn, args, reps: int) -> dict:
  """Per call of fn(*args): alone_ms (median, waiting for each call), queued_ms (reps calls
  queued, one wait: timing.measure_queued_ms), and from a trace of queued calls: gpu_busy_ms
  (union of kernel time per call), gpu_idle_ms (window minus busy, per call) and kernels_ms
  (GPU time per call by kernel name, largest first); trivial_alone_ms (a one-kernel program on
  the same arguments, alone) and alone_trace's figures."""
  alone = _alone_ms(fn, args, reps)
  trivial = jax.jit(lambda x, *rest: x[:8] * 2)
  trivial_alone = _alone_ms(trivial, args, reps)
  # Warmed-up and a median, as bench_layer's queued_ms: a first queue of calls keeps `reps`
  # calls' outputs alive (1.2 GB of weight gradients per grad call at 30B) and may grow XLA's
  # allocator, whose device allocations wait for the GPU (session 18 read 18 ms per queued
  # 30B grad call, 7.5 of GPU work, on the backend that ran first).
  queued = timing.measure_queued_ms(lambda: fn(*args), jax.block_until_ready, depth=reps,
                                    samples=3)["queued_ms"]
  events = _device_events(lambda: jax.block_until_ready([fn(*args) for _ in range(reps)]))
  alone_events = _device_events(
      lambda: [jax.block_until_ready(fn(*args)) for _ in range(reps)])
  kernels = collections.defaultdict(float)
  for e in events:
    kernels[e.name] += e.duration_ns / reps * 1e-6
  busy = step_breakdown.busy_ns(events)
  window = (max(e.end_ns for e in events) - min(e.start_ns for e in events)) if events else 0.0
  return {"alone_ms": alone, "queued_ms": queued, "trivial_alone_ms": trivial_alone,
          "gpu_busy_ms": busy / reps * 1e-6, "gpu_idle_ms": (window - busy) / reps * 1e-6,
          **alone_trace(alone_events, reps),
          "kernels_ms": dict(sorted(kernels.items(), key=lambda kv: -kv[1]))}


def engine_breakdown(layout: dict, values: np.ndarray) -> dict:
  """fused.engine_profile()'s counters summed over the last launch's CTAs (rows whose start lies
  within 1 ms of the latest: older rows are other launches'): per consumer warpgroup the share of
  its cycles in each part and the per-tile figures, and the producer's waits."""
  begin = values[:, layout["cta"]["begin_ns"]].astype(np.float64)
  live = (begin > 0) & (begin >= begin.max() - 1e6)
  v = values[live].astype(np.float64)
  span = lambda s: float(np.sum((values[live, s["end_clk"]] - values[live, s["begin_clk"]])
                                & np.uint64(0xFFFFFFFF)))  # 32-bit clocks
  out = {"ctas": int(live.sum())}
  for wg in ("wg0", "wg1"):
    s = layout[wg]
    total = span(s)
    part = lambda name: float(v[:, s[name]].sum())
    tiles, stages = max(part("tiles"), 1.0), max(part("kblocks"), 1.0)
    # Deferred tiles (MEGAMOE_DEFER_L1/L2_EPILOGUE) have no staged parts; their own epilogue and
    # their deferred parts (which also count in the mainloop, or outside it) per deferred tile.
    deferred = part("deferred_tiles")
    staged = max(part("tiles") - deferred, 1.0)
    out[wg] = {
        "cycles": total,
        "share_pct": {n: 100 * part(n) / total for n in ("job_wait", "mainloop", "full_wait",
                                                          "epilogue")},
        "mainloop_cycles_per_stage": part("mainloop") / stages,
        "tiles": part("tiles"), "stages_per_tile": part("kblocks") / tiles,
        "epilogue_cycles_per_tile": part("epilogue") / tiles,
        "epilogue_parts_per_tile": {n: part(n) / staged for n in ("epi_other_wg", "epi_stage",
                                                                  "epi_dst", "epi_store")},
        "deferred_tiles": deferred,
        "deferred_per_tile": {n: part(n) / max(deferred, 1.0) for n in (
            "epi_deferred", "deferred_parts", "deferred_parts_in_mainloop")}}
  s = layout["producer"]
  total = span(s)
  out["producer"] = {"tiles": float(v[:, s["tiles"]].sum()),
                     **{f"{n}_pct": 100 * float(v[:, s[n]].sum()) / total
                        for n in ("empty_wait", "job_empty_wait", "rows_wait")}}
  return out


def print_engine_breakdown(b: dict):
  print(f"    engine, {b['ctas']} CTAs:")
  for wg in ("wg0", "wg1"):
    w, sh = b[wg], b[wg]["share_pct"]
    parts = ", ".join(f"{n[4:]} {c:.0f}" for n, c in w["epilogue_parts_per_tile"].items())
    print(f"      {wg}: mainloop {sh['mainloop']:.1f}% (stage data waits {sh['full_wait']:.1f}%), "
          f"epilogue {sh['epilogue']:.1f}%, job waits {sh['job_wait']:.1f}%; "
          f"{w['mainloop_cycles_per_stage']:.0f} cycles a stage (floor 1024), epilogue "
          f"{w['epilogue_cycles_per_tile']:.0f} cycles a tile (staged tiles' parts: {parts})")
    if w["deferred_tiles"]:
      d = w["deferred_per_tile"]
      print(f"        {w['deferred_tiles']:.0f} deferred tiles: at the tile's end "
            f"{d['epi_deferred']:.0f} cycles, the deferred parts {d['deferred_parts']:.0f} "
            f"({d['deferred_parts_in_mainloop']:.0f} inside the next mainloop)")
  p = b["producer"]
  print(f"      producer: {p['tiles']:.0f} tiles; waiting for a free stage "
        f"{p['empty_wait_pct']:.1f}%, for rows {p['rows_wait_pct']:.1f}%, for a job slot "
        f"{p['job_empty_wait_pct']:.1f}%")


def gemm_region(phases_ms: dict, tokens: int, top_k: int, hidden: int, ffn: int) -> dict:
  """The kernel's GEMM region on CTA 0's clock: from the end of the copy before the GEMMs to
  the last tile ("rows copied", the rest of the copy beside the tiles, + "GEMM tiles done"),
  and the rate of the pass's two GEMMs over it (6 T k H F flops: forward L1 2F x H and L2
  H x F; the backward's dh and dx the same), as issue 14 asks its misses to be explained."""
  ms = phases_ms["rows copied"] + phases_ms["GEMM tiles done"]
  flops = 6.0 * tokens * top_k * hidden * ffn
  return {"ms": ms, "tflops": flops / (ms * 1e-3) / 1e12 if ms > 0 else float("nan")}


@contextlib.contextmanager
def env_var(name: str, value: str | None):
  """Environment variable `name` set to `value` (None: as it was) for the calls inside; the
  fused handlers read their overrides (ffi/heuristics/) at every call, so one compiled program
  runs each setting."""
  if value is None:
    yield
    return
  before = os.environ.get(name)
  os.environ[name] = value
  try:
    yield
  finally:
    if before is None:
      del os.environ[name]
    else:
      os.environ[name] = before


def one_gpu_mesh():
  """bench_layer's mesh at EP=1 on one device: ("data", "expert") = (1, 1)."""
  return jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "expert"))


def layer_arrays(shape: str, tokens: int, experts: int, top_k: int):
  """(x, topk_ids, topk_weights, w_gate_up, w_down) of the layer benchmark's problem at `shape`,
  bf16, the routing from problem.make_routing: the same arrays in every script that uses it."""
  hidden, ffn = problem.SHAPES[shape]
  ids_np, w_np = problem.make_routing(tokens, experts, top_k)
  ks = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(ks[0], (tokens, hidden), jnp.bfloat16)
  wgu = (jax.random.normal(ks[1], (experts, hidden, 2 * ffn)) * 0.02).astype(jnp.bfloat16)
  wd = (jax.random.normal(ks[2], (experts, ffn, hidden)) * 0.02).astype(jnp.bfloat16)
  return x, jnp.asarray(ids_np), jnp.asarray(w_np), wgu, wd


def layer_call(backend: str, recipe: str | None, overhead_pass: str, dy=None, mesh=None):
  """The jitted call that --overhead times: the layer's forward, or (overhead_pass "grad") the
  gradients of <y, dy> w.r.t. x, the routing weights and both expert weights; under `mesh`
  (expert axis "expert") as bench_layer calls it, or with mesh=None (backend "cuda" then takes
  its single-device path: XLA sort and gathers around the grouped GEMMs). Its optional sixth
  argument is moe's weight_blocks (FP8: the weights quantised once, outside the timed calls)."""
  def forward(x, ids, w, wgu, wd, blocks=None):
    return jax_megamoe.moe(x, ids, w, wgu, wd, mesh=mesh, expert_axis="expert",
                           backend=backend, recipe=recipe, weight_blocks=blocks)
  if overhead_pass == "fwd":
    return jax.jit(forward)
  if overhead_pass != "grad":
    raise ValueError(f"overhead_pass must be 'fwd' or 'grad', got {overhead_pass!r}")

  def grads(x, ids, w, wgu, wd, blocks=None):
    inner = lambda x, w, wgu, wd: jnp.vdot(
        forward(x, ids, w, wgu, wd, blocks).astype(jnp.float32), dy.astype(jnp.float32))
    return jax.grad(inner, argnums=(0, 1, 2, 3))(x, w, wgu, wd)
  return jax.jit(grads)


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--shapes", default="30b,235b")
  ap.add_argument("--tokens", type=int, default=16384)
  ap.add_argument("--experts", type=int, default=128)
  ap.add_argument("--top-k", type=int, default=8)
  ap.add_argument("--reps", type=int, default=20)
  ap.add_argument("--recipe", default="bf16", choices=("bf16", "fp8", "fp8_pow2"),
                  help="the kernel's recipe (FP8: rows and weights quantised before the call)")
  ap.add_argument("--out", default="")
  ap.add_argument("--copy-heads", default="",
                  help="comma-separated MEGAMOE_FUSED_COPY_HEAD percents to compare (interleaved "
                       "call by call); empty: the kernel's default only")
  ap.add_argument("--debug-bits", default="",
                  help="comma-separated MEGAMOE_FUSED_DEBUG values to compare (fused_moe.h: "
                       "2 no GEMM tile, 1 no second GEMM, 4 no gate_up residual), interleaved "
                       "as --copy-heads")
  ap.add_argument("--kernel-pass", default="fwd", choices=("fwd", "fwd-residuals", "bwd"),
                  help="whose phases: the forward's, the forward keeping its residuals (a "
                       "training step's), or the fused backward's kernel pass alone (bf16; on "
                       "residuals of one forward)")
  ap.add_argument("--overhead", action="store_true",
                  help="also measure host/launch overhead of fused and cuda (see the doc)")
  ap.add_argument("--overhead-pass", default="fwd", choices=("fwd", "grad"),
                  help="what --overhead times: the forward, or one forward + backward")
  ap.add_argument("--engine-profile", action="store_true",
                  help="also print the tile engine's cycle accounting inside the kernel (needs "
                       "an extension built with JAX_MEGAMOE_ENGINE_PROFILE=ON)")
  ap.add_argument("--weight-blocks", action="store_true",
                  help="--overhead with an FP8 recipe: both backends read the weights quantised "
                       "once before the timed calls (moe's weight_blocks), as bench_layer's "
                       "+blocks rows")
  ap.add_argument("--no-mesh", action="store_true",
                  help="--overhead calls the layer with mesh=None instead of bench_layer's "
                       "one-device mesh")
  args = ap.parse_args(argv)
  if args.weight_blocks and args.recipe == "bf16":
    ap.error("--weight-blocks: weight blocks are for FP8 recipes, got --recipe bf16")
  recipe = jax_impls.recipe_arg(args.recipe)
  results, overhead = [], []
  for shape in args.shapes.split(","):
    hidden, ffn = problem.SHAPES[shape]
    x, ids, w, wgu, wd = layer_arrays(shape, args.tokens, args.experts, args.top_k)
    dy = jax.random.normal(jax.random.key(1), x.shape, jnp.bfloat16)
    if args.kernel_pass == "bwd":
      if args.recipe != "bf16":
        raise SystemExit("--kernel-pass bwd: the fused backward's kernel pass is bf16 only")
      bwd = fused.backward_with_phases(x, ids, w, wgu, wd)
      fn = lambda *_: bwd(dy)
    else:
      fn = jax.jit(functools.partial(fused.forward_with_phases, recipe=recipe,
                                     residuals=args.kernel_pass == "fwd-residuals"))
    split = lambda text: [v.strip() for v in text.split(",") if v.strip()] or [None]
    variants = [(h, d) for h in split(args.copy_heads) for d in split(args.debug_bits)]
    walls = {v: [] for v in variants}
    phases = {v: [] for v in variants}
    for rep in range(args.reps + 1):  # the first round warms up
      for head, debug in variants:
        with env_var("MEGAMOE_FUSED_COPY_HEAD", head), env_var("MEGAMOE_FUSED_DEBUG", debug):
          t = time.perf_counter()
          _, ph = jax.block_until_ready(fn(x, ids, w, wgu, wd))
          if rep:
            walls[head, debug].append((time.perf_counter() - t) * 1e3)
            phases[head, debug].append(np.asarray(ph, np.int64))
    for head, debug in variants:
      clock = np.stack(phases[head, debug])  # [reps, len(PHASES)] ns from the start
      steps = np.diff(clock, axis=1)
      row = {"shape": shape, "recipe": args.recipe, "tokens": args.tokens,
             "kernel_pass": args.kernel_pass, "copy_head_percent": head, "debug_bits": debug,
             "wall_ms": statistics.median(walls[head, debug]),
             "kernel_ms": float(np.median(clock[:, -1])) * 1e-6,
             "phases_ms": {name: float(np.median(steps[:, i])) * 1e-6
                           for i, name in enumerate(fused.PHASES[1:])}}
      if not debug or debug == "0":  # debug bits skip tiles: no rate to give
        row["gemm_region"] = gemm_region(row["phases_ms"], args.tokens, args.top_k, hidden, ffn)
      results.append(row)
      label = "".join(f" [{n}={v}]" for n, v in (("MEGAMOE_FUSED_COPY_HEAD", head),
                                                  ("MEGAMOE_FUSED_DEBUG", debug)) if v)
      print(f"{shape} {args.kernel_pass}{label}: kernel {row['kernel_ms']:.3f} ms (call "
            f"{row['wall_ms']:.3f} ms host-timed)")
      for name, ms in row["phases_ms"].items():
        print(f"    {name:18s} {ms:7.3f} ms")
      if "gemm_region" in row:
        g = row["gemm_region"]
        print(f"    GEMM region        {g['ms']:7.3f} ms, {g['tflops']:.0f} TFLOP/s (rows copied "
              f"+ GEMM tiles done)")
      if args.engine_profile:
        with env_var("MEGAMOE_FUSED_COPY_HEAD", head), env_var("MEGAMOE_FUSED_DEBUG", debug):
          jax.block_until_ready(fn(x, ids, w, wgu, wd))
          row["engine"] = engine_breakdown(*fused.engine_profile())
        print_engine_breakdown(row["engine"])
    if args.overhead:
      mesh = None if args.no_mesh else one_gpu_mesh()
      call_args = (x, ids, w, wgu, wd)
      if args.weight_blocks:  # quantised once, as bench_layer's "+blocks" inputs
        call_args += (jax_impls.weight_blocks(wgu, wd, args.recipe, mesh),)
      for backend in ("fused", "cuda"):
        layer = layer_call(backend, recipe, args.overhead_pass, dy, mesh)
        o = {"shape": shape, "backend": backend, "pass": args.overhead_pass,
             "mesh": not args.no_mesh, "weight_blocks": args.weight_blocks,
             **call_overhead(layer, call_args, args.reps)}
        overhead.append(o)
        label = backend + (" + weight blocks" if args.weight_blocks else "")
        print(f"  {label:5s}: alone {o['alone_ms']:.3f} ms, queued {o['queued_ms']:.3f} ms, "
              f"GPU busy {o['gpu_busy_ms']:.3f} ms, GPU idle between calls "
              f"{o['gpu_idle_ms']:.3f} ms per call")
        print(f"         alone: GPU busy {o['alone_gpu_busy_ms']:.3f} ms, GPU idle inside the "
              f"call {o['alone_gpu_idle_inside_ms']:.3f} ms ({o['alone_groups_seen']} kernel "
              f"groups for {args.reps} calls); a one-kernel program alone "
              f"{o['trivial_alone_ms']:.3f} ms")
        for name, ms in o["kernels_ms"].items():
          print(f"      {ms:7.3f} ms  {name[:90]}")
  out = {"device": str(jax.devices()[0].device_kind), "results": results,
         "overhead": overhead}
  if args.out:
    with open(args.out, "w") as f:
      json.dump(out, f, indent=1)
  return out


if __name__ == "__main__":
  main()

"""Where a layer call's time goes before its first kernel starts and after its last one ends, when
each call is waited for (as bench_layer times it): a profiler trace of such calls, each inside a
TraceAnnotation, read on the host's and the GPU's timeline.

  python3 benchmarks/call_latency.py [--shape 30b] [--backend fused] [--recipe fp8] [--reps 10]
      [--pass fwd|grad] [--top 25] [--no-mesh] [--out F]

The layer runs under bench_layer's one-device mesh (--no-mesh: mesh=None; session 10's figures
were taken that way). Per call: launch delay (the annotation's start to the first kernel's start),
GPU span (first kernel start to last kernel end), tail (last kernel end to the annotation's end:
the wait's wake-up), and the host events that run inside the launch delay by name (time clipped to
it, median over calls, largest first). Host events nest (a jit dispatch holds the executable's
run, which holds each thunk), so the list is read top-down, not summed. Two programs are measured
the same way, as floors: a one-kernel program on the same arguments (dispatch and wait), and a
chain of plain XLA matmuls of about the layer's GPU span (what the runtime's wait costs a program
that runs as long, with none of this project's code in it).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile

import jax
import jax.numpy as jnp

sys.path.insert(0, __file__.rsplit("/", 2)[0])
from benchmarks import problem, trace_events  # noqa: E402
from benchmarks.fused_phases import layer_call, one_gpu_mesh  # noqa: E402

ANNOTATION = "call_latency_call"


def host_and_gpu_events(trace_dir: str):
  """(host events [(name, start_ns, end_ns)], GPU kernels [(start_ns, end_ns)]) of a trace."""
  from jax.profiler import ProfileData  # noqa: PLC0415

  data = ProfileData.from_file(str(trace_events.find_trace_file(trace_dir)))
  host, gpu = [], []
  for plane in data.planes:
    if plane.name == "/host:CPU":
      for line in plane.lines:
        for e in line.events:
          host.append((e.name, e.start_ns, e.start_ns + e.duration_ns))
  for e in trace_events.read_trace(trace_dir).events:
    if e.device.startswith("gpu"):
      gpu.append((e.start_ns, e.end_ns))
  return host, gpu


def split_calls(host, gpu) -> list[dict]:
  """Per annotated call: launch_delay_ns, gpu_span_ns, tail_ns and the host events (name ->
  ns clipped to the launch delay) inside it. Calls with no kernel inside are skipped."""
  calls = []
  for name, start, end in host:
    if name != ANNOTATION:
      continue
    kernels = [(s, e) for s, e in gpu if s >= start and e <= end]
    if not kernels:
      continue
    first = min(s for s, _ in kernels)
    last = max(e for _, e in kernels)
    inside = collections.defaultdict(float)
    for n, s, e in host:
      if n == ANNOTATION:
        continue
      clipped = min(e, first) - max(s, start)
      if clipped > 0:
        inside[n] += clipped
    calls.append({"launch_delay_ns": first - start, "gpu_span_ns": last - first,
                  "tail_ns": end - last, "host_ns": dict(inside)})
  return calls


def summarise(calls: list[dict], top: int) -> dict:
  """Medians over calls of the three intervals and of each host event's clipped time."""
  if not calls:
    return {"calls": 0}
  med = lambda key: statistics.median(c[key] for c in calls) * 1e-6
  names = {n for c in calls for n in c["host_ns"]}
  host = {n: statistics.median(c["host_ns"].get(n, 0.0) for c in calls) * 1e-6 for n in names}
  host = dict(sorted(host.items(), key=lambda kv: -kv[1])[:top])
  return {"calls": len(calls), "launch_delay_ms": med("launch_delay_ns"),
          "gpu_span_ms": med("gpu_span_ns"), "tail_ms": med("tail_ns"), "host_ms": host}


MATMUL_N = 8192  # one bf16 matmul of this size: ~1.1 TFLOP, ~1.5 ms on an H200


def matmul_chain(count: int):
  """A jitted chain of `count` dependent matmuls a @ b (rescaled to stay finite)."""
  def chain(a, b):
    for _ in range(count):
      a = (a @ b) * (1.0 / MATMUL_N)
    return a
  return jax.jit(chain)


def measure(fn, args, reps: int, top: int) -> dict:
  """summarise() of `reps` calls of fn(*args) after two warm-up calls, each call waited for
  inside its TraceAnnotation in one profiler trace."""
  jax.block_until_ready(fn(*args))
  jax.block_until_ready(fn(*args))
  trace_dir = tempfile.mkdtemp(prefix="call_latency_")
  with jax.profiler.trace(trace_dir):
    for _ in range(reps):
      with jax.profiler.TraceAnnotation(ANNOTATION):
        jax.block_until_ready(fn(*args))
  return summarise(split_calls(*host_and_gpu_events(trace_dir)), top)


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--shape", default="30b", choices=sorted(problem.SHAPES))
  ap.add_argument("--tokens", type=int, default=16384)
  ap.add_argument("--experts", type=int, default=128)
  ap.add_argument("--top-k", type=int, default=8)
  ap.add_argument("--backend", default="fused")
  ap.add_argument("--recipe", default="bf16", choices=("bf16", "fp8", "fp8_pow2"))
  ap.add_argument("--pass", dest="pass_", default="fwd", choices=("fwd", "grad"))
  ap.add_argument("--reps", type=int, default=10)
  ap.add_argument("--top", type=int, default=25)
  ap.add_argument("--no-mesh", action="store_true",
                  help="call the layer with mesh=None instead of bench_layer's one-device mesh")
  ap.add_argument("--out", default="")
  args = ap.parse_args(argv)
  hidden, ffn = problem.SHAPES[args.shape]
  ids_np, w_np = problem.make_routing(args.tokens, args.experts, args.top_k)
  ks = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(ks[0], (args.tokens, hidden), jnp.bfloat16)
  wgu = (jax.random.normal(ks[1], (args.experts, hidden, 2 * ffn)) * 0.02).astype(jnp.bfloat16)
  wd = (jax.random.normal(ks[2], (args.experts, ffn, hidden)) * 0.02).astype(jnp.bfloat16)
  dy = jax.random.normal(ks[3], x.shape, jnp.bfloat16)
  layer_args = (x, jnp.asarray(ids_np), jnp.asarray(w_np), wgu, wd)
  recipe = None if args.recipe == "bf16" else args.recipe
  out = {"device": str(jax.devices()[0].device_kind), "shape": args.shape,
         "backend": args.backend, "recipe": args.recipe, "pass": args.pass_}
  mm = jax.random.normal(ks[0], (2, MATMUL_N, MATMUL_N), jnp.bfloat16)
  layer = layer_call(args.backend, recipe, args.pass_, dy,
                     None if args.no_mesh else one_gpu_mesh())
  programs = [("layer", layer, layer_args),
              ("one-kernel program", jax.jit(lambda x, *rest: x[:8] * 2), layer_args),
              ("XLA matmuls", None, (mm[0], mm[1]))]
  for label, fn, fn_args in programs:
    if fn is None:  # as many matmuls as fill the layer's span
      span = out["layer"].get("gpu_span_ms", 1.0)
      first = measure(matmul_chain(1), fn_args, 3, 1)
      count = max(1, round(span / max(first.get("gpu_span_ms", span), 1e-3)))
      fn = matmul_chain(count)
      label = f"{label} x{count}"
    s = measure(fn, fn_args, args.reps, args.top)
    out[label] = s
    if not s["calls"]:
      print(f"{label}: no annotated call with a kernel in the trace")
      continue
    print(f"{label}: launch delay {s['launch_delay_ms']:.3f} ms, GPU span {s['gpu_span_ms']:.3f} "
          f"ms, tail {s['tail_ms']:.3f} ms ({s['calls']} calls)")
    for name, ms in s["host_ms"].items():
      print(f"    {ms:7.3f} ms  {name[:100]}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(out, f, indent=1)
  return out


if __name__ == "__main__":
  main()

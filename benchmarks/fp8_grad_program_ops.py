"""The large array operations of the FP8 layer's gradient program, backend "fused" (one rank,
from the kernel's residuals) beside backend "cuda" (no mesh), at the 30B shape: every equation
of jax.grad's jaxpr that writes more than --min-mib, with its output shapes. Traced on a CPU
(jax.make_jaxpr: nothing is lowered or run), so it shows what each program asks for, not how
long it takes.

  python benchmarks/fp8_grad_program_ops.py [--tokens 16384] [--min-mib 50]
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (REPO, os.path.join(REPO, "tests")):
  if path not in sys.path:
    sys.path.append(path)

from jax_megamoe.backends import cuda_ep, cuda_fp8, fused  # noqa: E402
from jax_megamoe.backends.local import local_moe  # noqa: E402
from jax_megamoe.validation import check_layer_args  # noqa: E402
# The stand-in one-rank workspace the CPU trace tests use (tracing needs its id and rank count).
from fused_trace_helpers import TracedWorkspace  # noqa: E402

H, F, E, K = 2048, 768, 128, 8  # qwen3-30b-a3b's MoE layer
# remat_opt: a custom_vjp's fwd rule under optimize_remat (backend fused's layers).
CALLS = ("pjit", "custom_vjp_call", "custom_vjp_call_jaxpr", "closed_call", "remat",
         "checkpoint", "custom_jvp_call", "remat_opt")


def large_ops(jaxpr, min_bytes: int) -> list[tuple[str, int, list]]:
  """(primitive[:custom-call target], output bytes, output shapes) of every equation, nested
  calls included, whose outputs exceed min_bytes."""
  rows = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in CALLS:
      for key in ("jaxpr", "call_jaxpr", "fun_jaxpr", "fwd_jaxpr"):
        if key in eqn.params:
          sub = eqn.params[key]
          rows += large_ops(getattr(sub, "jaxpr", sub), min_bytes)
      continue
    size = sum(int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize for v in eqn.outvars
               if hasattr(v.aval, "shape"))
    if size > min_bytes:
      target = eqn.params.get("target_name", "")
      rows.append((eqn.primitive.name + (f":{target}" if target else ""), size,
                   [tuple(v.aval.shape) for v in eqn.outvars][:3]))
  return rows


def main(argv=None) -> dict[str, list]:
  """Prints the table; returns {program: large_ops rows}."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=int, default=16384)
  parser.add_argument("--min-mib", type=float, default=50)
  flags = parser.parse_args(argv)
  t = flags.tokens
  rng = np.random.default_rng(0)
  ids = jnp.asarray(np.stack([rng.permutation(E)[:K] for _ in range(t)]).astype(np.int32))
  spec = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)
  operands = (spec(t, H), spec(t, K, dt=jnp.float32), spec(E, H, 2 * F), spec(E, F, H),
              spec(t, H, dt=jnp.float32))
  zeros = lambda o: jnp.zeros(o.shape, o.dtype)
  shape = check_layer_args(zeros(operands[0]), ids, zeros(operands[1]), zeros(operands[2]),
                           zeros(operands[3]))
  plan = cuda_ep.LayerPlan.of(shape, fused.cuda_mlp("fp8"))
  cfg = fused.FusedConfig(TracedWorkspace(), E, plan, 0, recipe="fp8")
  layers = {
      "fused (one rank)": lambda x, w, a, b: fused.fused_layer(x, ids, w, a, b, cfg),
      "cuda (no mesh)": lambda x, w, a, b: local_moe(x, ids, w, a, b,
                                                     mlp=cuda_fp8.RowsMlp(pow2=False)),
  }
  programs = {}
  for name, layer in layers.items():
    loss = lambda x, w, a, b, dy, f=layer: jnp.sum(f(x, w, a, b).astype(jnp.float32) * dy)
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(*operands)
    rows = programs[name] = large_ops(jaxpr.jaxpr, int(flags.min_mib * 2**20))
    print(f"== {name}: {len(rows)} operations write > {flags.min_mib:g} MiB, "
          f"{sum(r[1] for r in rows) / 2**30:.1f} GiB in all")
    for op, size, shapes in rows:
      print(f"   {op:48s} {size / 2**20:7.0f} MiB  {shapes}")
  return programs


if __name__ == "__main__":
  main()

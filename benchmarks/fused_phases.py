"""Where the fused forward's time goes: the kernel stamps CTA 0's clock at the end of each of its
phases (backends.fused.PHASES); this prints the median duration of each phase over repeated
calls of the layer benchmark's problem (EP=1, one GPU), beside the whole call's time.

  python3 benchmarks/fused_phases.py [--shapes 30b,235b] [--tokens 16384] [--reps 20] [--out F]

The phases are seen from CTA 0 (the other CTAs' work overlaps the boundaries: "rows copied" is
CTA 0's share of the copy, "GEMM tiles done" waits for every CTA's tiles).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 2)[0])
from benchmarks import problem  # noqa: E402
from jax_megamoe.backends import fused  # noqa: E402


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--shapes", default="30b,235b")
  ap.add_argument("--tokens", type=int, default=16384)
  ap.add_argument("--experts", type=int, default=128)
  ap.add_argument("--top-k", type=int, default=8)
  ap.add_argument("--reps", type=int, default=20)
  ap.add_argument("--out", default="")
  args = ap.parse_args(argv)
  results = []
  for shape in args.shapes.split(","):
    hidden, ffn = problem.SHAPES[shape]
    ids_np, w_np = problem.make_routing(args.tokens, args.experts, args.top_k)
    ks = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(ks[0], (args.tokens, hidden), jnp.bfloat16)
    wgu = (jax.random.normal(ks[1], (args.experts, hidden, 2 * ffn)) * 0.02).astype(jnp.bfloat16)
    wd = (jax.random.normal(ks[2], (args.experts, ffn, hidden)) * 0.02).astype(jnp.bfloat16)
    ids, w = jnp.asarray(ids_np), jnp.asarray(w_np)
    fn = jax.jit(fused.forward_with_phases)
    jax.block_until_ready(fn(x, ids, w, wgu, wd))
    walls, phases = [], []
    for _ in range(args.reps):
      t = time.perf_counter()
      _, ph = jax.block_until_ready(fn(x, ids, w, wgu, wd))
      walls.append((time.perf_counter() - t) * 1e3)
      phases.append(np.asarray(ph, np.int64))
    phases = np.stack(phases)  # [reps, 8] ns from the start
    steps = np.diff(phases, axis=1)
    row = {"shape": shape, "tokens": args.tokens, "wall_ms": statistics.median(walls),
           "kernel_ms": float(np.median(phases[:, -1])) * 1e-6,
           "phases_ms": {name: float(np.median(steps[:, i])) * 1e-6
                         for i, name in enumerate(fused.PHASES[1:])}}
    results.append(row)
    print(f"{shape}: kernel {row['kernel_ms']:.3f} ms (call {row['wall_ms']:.3f} ms host-timed)")
    for name, ms in row["phases_ms"].items():
      print(f"    {name:18s} {ms:7.3f} ms")
  out = {"device": str(jax.devices()[0].device_kind), "results": results}
  if args.out:
    with open(args.out, "w") as f:
      json.dump(out, f, indent=1)
  return out


if __name__ == "__main__":
  main()

"""The FP8 quantisers at the layer's shapes, against the device's copy bandwidth.

  python3 benchmarks/bench_quantize.py [--shapes 30b,235b] [--experts 128] [--tokens 16384]
      [--pow2] [--out F]

Per shape: both expert weights in the forward layout (cuda_fp8.quantize_weights, what every
fp8 layer call runs) and in the dgrad layout, the token rows (quantize_rows), and as the floor
an XLA copy of the same bytes read (bf16 -> bf16, so it reads and writes 2 bytes per value where
a quantiser writes ~1). Each figure is the per-call time of queued calls (the host's round trip
hidden), with the bytes the op must move and the bandwidth that gives.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, __file__.rsplit("/", 2)[0])
from benchmarks import problem, timing  # noqa: E402
from jax_megamoe.backends import cuda_fp8  # noqa: E402


def quantised_bytes(shape) -> int:
  """Bytes a quantiser moves for a bf16 tensor of `shape` in 128-wide blocks along the last
  axis at least: 2 read + 1 written per value, plus one fp32 scale per 128 x 128 (weights) or
  1 x 128 (rows) block, counted as 1 x 128 (an upper bound)."""
  n = math.prod(shape)
  return 3 * n + 4 * (n // 128)


def timed(fn, *args) -> float:
  jitted = jax.jit(fn)
  return timing.measure_queued_ms(lambda: jitted(*args), jax.block_until_ready,
                                  samples=7)["queued_ms"]


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--shapes", default="30b,235b")
  ap.add_argument("--experts", type=int, default=128)
  ap.add_argument("--tokens", type=int, default=16384)
  ap.add_argument("--pow2", action="store_true")
  ap.add_argument("--out", default="")
  args = ap.parse_args(argv)
  rows = []
  for shape in args.shapes.split(","):
    hidden, ffn = problem.SHAPES[shape]
    ks = jax.random.split(jax.random.key(0), 3)
    wgu = (jax.random.normal(ks[0], (args.experts, hidden, 2 * ffn)) * 0.02).astype(jnp.bfloat16)
    wd = (jax.random.normal(ks[1], (args.experts, ffn, hidden)) * 0.02).astype(jnp.bfloat16)
    x = jax.random.normal(ks[2], (args.tokens, hidden), jnp.bfloat16)
    weight_bytes = quantised_bytes(wgu.shape) + quantised_bytes(wd.shape)
    copy_bytes = 4 * (wgu.size + wd.size)  # bf16 read + bf16 written
    both = lambda dgrad: (lambda a, b: (cuda_fp8.quantize_weights(a, pow2=args.pow2, dgrad=dgrad),
                                        cuda_fp8.quantize_weights(b, pow2=args.pow2, dgrad=dgrad)))
    cases = [("weights (forward layout)", both(False), (wgu, wd), weight_bytes),
             ("weights (dgrad layout)", both(True), (wgu, wd), weight_bytes),
             ("rows", lambda a: cuda_fp8.quantize_rows(a, pow2=args.pow2), (x,),
              quantised_bytes(x.shape)),
             ("floor: XLA copy of the weights (bf16 -> bf16)",
              lambda a, b: (a * 2, b * 2), (wgu, wd), copy_bytes)]
    for name, fn, fn_args, nbytes in cases:
      ms = timed(fn, *fn_args)
      row = {"shape": shape, "op": name, "ms": ms, "bytes": nbytes,
             "tb_per_s": nbytes / (ms * 1e-3) / 1e12}
      rows.append(row)
      print(f"{shape:5s} {name:46s} {ms:7.3f} ms  {row['tb_per_s']:5.2f} TB/s "
            f"({nbytes / 1e9:.2f} GB)")
  out = {"device": str(jax.devices()[0].device_kind), "pow2": args.pow2, "rows": rows}
  if args.out:
    with open(args.out, "w") as f:
      json.dump(out, f, indent=1)
  return out


if __name__ == "__main__":
  main()

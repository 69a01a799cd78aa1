"""The layer's forward and gradient at R virtual ranks on one GPU, backends fused and cuda.

  python3 benchmarks/bench_virtual_ranks.py [--ranks 2] [--tokens 4096] [--shape 30b]
      [--recipes bf16,fp8] [--impls fused,cuda] [--label L] [--out F]

A virtual group (jax_megamoe.virtual_ranks) runs every rank's kernels on one GPU, so a call's
time is the work of all R ranks added up, not the latency of an EP step across GPUs: what this
measures is how much work a pass does (what the backward recomputes, for instance), at EP sizes
that one GPU can hold. Tokens are per rank; routing uniform over the experts; per-call times of
queued calls (the host's round trip hidden), median of 5 runs of 8 calls:
  fwd   y = layer(x)
  grad  value_and_grad of sum(y * dy) over x, the routing weights and both expert weights
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, __file__.rsplit("/", 2)[0])
from benchmarks import problem, timing  # noqa: E402
from benchmarks.bench_layer import git_commit  # noqa: E402
from jax_megamoe import virtual_ranks  # noqa: E402
from jax_megamoe.backends import fused  # noqa: E402


def _layer(impl: str, recipe: str | None, ws, ranks: int, tokens: int):
  """The layer on the virtual group, over token-major [R * T, ...] operands."""
  stack = lambda a: a.reshape(ranks, tokens, *a.shape[1:])
  if impl == "fused":
    call = lambda x, ids, w, wgu, wd: virtual_ranks.fused_moe(
        stack(x), stack(ids), stack(w), wgu, wd, workspace=ws, recipe=recipe)
  elif impl == "cuda":
    call = lambda x, ids, w, wgu, wd: virtual_ranks.expert_parallel_moe(
        stack(x), stack(ids), stack(w), wgu, wd, workspace=ws, mlp=fused.cuda_mlp(recipe))
  else:
    raise ValueError(f"--impls: unknown impl {impl!r} (fused, cuda)")
  return lambda x, ids, w, wgu, wd: call(x, ids, w, wgu, wd).reshape(ranks * tokens, -1)


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--ranks", type=int, default=2, help="virtual ranks R (1..8)")
  ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
  ap.add_argument("--shape", default="30b", choices=sorted(problem.SHAPES))
  ap.add_argument("--experts", type=int, default=problem.NUM_EXPERTS)
  ap.add_argument("--top-k", type=int, default=problem.TOP_K)
  ap.add_argument("--recipes", default="bf16,fp8", help="comma list of bf16, fp8, fp8_pow2")
  ap.add_argument("--impls", default="fused,cuda", help="comma list of fused, cuda")
  ap.add_argument("--label", default="", help="a name for this run in the JSON (e.g. a branch)")
  ap.add_argument("--out", default="")
  args = ap.parse_args(argv)
  if not 1 <= args.ranks <= 8:
    raise SystemExit(f"--ranks must be in [1, 8], got {args.ranks}")
  if args.tokens < 1:
    raise SystemExit(f"--tokens must be >= 1, got {args.tokens}")

  hidden, ffn = problem.SHAPES[args.shape]
  r, t, e, k = args.ranks, args.tokens, args.experts, args.top_k
  ids, w = problem.make_routing(r * t, e, k, seed=0)
  keys = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(keys[0], (r * t, hidden), jnp.bfloat16)
  wgu = (jax.random.normal(keys[1], (e, hidden, 2 * ffn)) * 0.02).astype(jnp.bfloat16)
  wd = (jax.random.normal(keys[2], (e, ffn, hidden)) * 0.02).astype(jnp.bfloat16)
  dy = jax.random.normal(keys[3], (r * t, hidden), jnp.float32)
  ids, w = jnp.asarray(ids), jnp.asarray(w)
  ws = virtual_ranks.create_workspace(r, max_tokens=t, hidden=hidden, top_k=k,
                                      dtype=jnp.bfloat16, fused_rows=r * t * k)
  rows = []
  try:
    for recipe_name in args.recipes.split(","):
      recipe = None if recipe_name == "bf16" else recipe_name
      for impl in args.impls.split(","):
        layer = _layer(impl, recipe, ws, r, t)
        fwd = jax.jit(layer)

        def loss(x, w, a, b, layer=layer):
          return jnp.sum(layer(x, ids, w, a, b).astype(jnp.float32) * dy)
        grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
        row = dict(impl=impl, recipe=recipe_name)
        for name, call in (("fwd", lambda: fwd(x, ids, w, wgu, wd)),
                           ("grad", lambda: grad(x, w, wgu, wd))):
          row[f"{name}_ms"] = round(timing.measure_queued_ms(
              call, jax.block_until_ready, depth=8)["queued_ms"], 3)
        rows.append(row)
        print(f"{args.label or '-'} R={r} T={t} {args.shape} {recipe_name:8s} {impl:5s} "
              f"fwd {row['fwd_ms']:8.3f} ms  grad {row['grad_ms']:8.3f} ms", flush=True)
  finally:
    ws.close()
  result = dict(bench="virtual_ranks", label=args.label, ranks=r, tokens_per_rank=t,
                shape=args.shape, hidden=hidden, ffn=ffn, experts=e, top_k=k,
                device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                commit=git_commit(), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                rows=rows)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)
  return result


if __name__ == "__main__":
  main()

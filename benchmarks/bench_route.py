"""jax_megamoe.route's cost per call, for each selection norm, on the default device: alone
(block_until_ready each call) and queued (a few calls back to back, one wait), medians
(benchmarks/timing.py). For "balance" also the variants of its offset solve that
router._balancing_offsets takes as keywords (the Sinkhorn stage in the exp or the log domain,
its iterations, the loops unrolled); each variant's choice and imbalance are compared with the
default's; and the solve by its CUDA kernel (router.BALANCE_KERNEL) where it runs. (Dropped
after measuring: the k-th largest by lax.top_k, 2.4x slower, session 25;
the load steps over each row's 16 or 24 largest candidates, slower than over every expert,
session 27.)

  python3 benchmarks/bench_route.py [--tokens 16384] [--experts 128] [--top-k 8] [--reps 50]
"""
import argparse
import contextlib
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import timing  # noqa: E402

from jax_megamoe import router  # noqa: E402


@contextlib.contextmanager
def balance_solve(kernel=False, **solve):
  """Inside: route's "balance" solves its offsets with these router._balancing_offsets keywords
  (the JAX loops), or with kernel=True by its kernel (router.BALANCE_KERNEL), in what is traced
  inside (jit a new function there: jit reuses a function's earlier trace)."""
  shipped, shipped_kernel = router._balancing_offsets, router.BALANCE_KERNEL
  router._balancing_offsets = functools.partial(shipped, **solve)
  router.BALANCE_KERNEL = kernel
  try:
    yield
  finally:
    router._balancing_offsets, router.BALANCE_KERNEL = shipped, shipped_kernel


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--tokens", type=int, default=16384)
  p.add_argument("--experts", type=int, default=128)
  p.add_argument("--top-k", type=int, default=8)
  p.add_argument("--reps", type=int, default=50)
  args = p.parse_args(argv)
  k = args.top_k
  logits = jax.random.normal(jax.random.key(1), (args.tokens, args.experts), jnp.float32) * 0.3
  print(f"{jax.devices()[0].device_kind}: route of {args.tokens} x {args.experts} logits, "
        f"top {k}, ms per call")
  for norm in router.SELECTION_NORMS[:-1]:
    f = jax.jit(lambda l, n=norm: router.route(l, k, selection_norm=n)[1])
    alone, queued = timing.alone_and_queued_ms(lambda: f(logits), jax.block_until_ready,
                                               args.reps)
    print(f"{norm:34s} alone {alone:.3f}  queued {queued:.3f}")
  variants = [("balance (JAX loops)", {}),
              ("balance, loops unrolled", dict(unroll=True)),
              ("balance, Sinkhorn log", dict(sinkhorn="log")),
              ("balance, 10 Sinkhorn iterations", dict(sinkhorn_iterations=10)),
              ("balance, kernel", dict(kernel=True))]
  reference = None
  for name, solve in variants:
    with balance_solve(**solve):
      if solve.get("kernel") and not router._kernel_platforms(args.experts, None):
        print(f"{name:40s} not run (no kernel for {jax.devices()[0].platform} with "
              f"{jax.device_count()} devices)")
        continue
      f = jax.jit(lambda l: router.route(l, k, selection_norm="balance")[1])
      alone, queued = timing.alone_and_queued_ms(lambda: f(logits), jax.block_until_ready,
                                                 args.reps)
      ids = np.asarray(f(logits))
    if reference is None:
      reference, same = ids, ""
    else:
      same = ("same choice" if np.array_equal(ids, reference) else
              f"choice differs in {np.mean(np.any(ids != reference, 1)):.4f} of the tokens")
    load = np.bincount(ids.ravel(), minlength=args.experts) / ids.size * args.experts
    print(f"{name:40s} alone {alone:.3f}  queued {queued:.3f}  imbalance {load.max():.3f}  "
          f"{same}")

if __name__ == "__main__":
  main()

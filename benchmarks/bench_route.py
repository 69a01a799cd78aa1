"""jax_megamoe.route's cost per call, for each selection norm, on the default device: alone
(block_until_ready each call) and queued (calls back to back, one wait), medians. For "balance"
also three variants of its offset solve, to place its time (session 25): its two loops unrolled,
and the k-th largest of each row from lax.top_k instead of k row maxima; each variant's choice
is compared with the shipped one's.

  python3 benchmarks/bench_route.py [--tokens 16384] [--experts 128] [--top-k 8] [--reps 50]
"""
import argparse
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_megamoe import router  # noqa: E402


def kth_by_top_k(x, k):
  return jax.lax.top_k(x, k)[0][:, k - 1:k]


def offsets_variant(z, top_k, unroll, kth):
  """router._balancing_offsets with its loops' unrolling and its k-th largest replaced."""
  num_tokens, num_experts = z.shape
  scaled = z / router.BALANCE_TEMPERATURE
  log_row = jnp.log(jnp.float32(top_k))
  mean_load = num_tokens * top_k / num_experts
  log_col = jnp.log(jnp.float32(mean_load))

  def sinkhorn(_, b):
    a = log_row - jax.nn.logsumexp(scaled + b, axis=1, keepdims=True)
    return log_col - jax.nn.logsumexp(scaled + a, axis=0)

  b = router.BALANCE_TEMPERATURE * jax.lax.fori_loop(
      0, router.BALANCE_SINKHORN_ITERATIONS, sinkhorn, jnp.zeros((num_experts,), jnp.float32),
      unroll=unroll)
  first, last = router.BALANCE_LOAD_STEP_SIZE
  decay = (last / first) ** (1.0 / max(router.BALANCE_LOAD_STEPS - 1, 1))

  def load_step(i, carry):
    b, best_b, best = carry
    chooser = z + b
    load = jnp.sum((chooser >= kth(chooser, top_k)).astype(jnp.float32), axis=0) / mean_load
    peak = jnp.max(load)
    best_b, best = jnp.where(peak < best, b, best_b), jnp.minimum(peak, best)
    return b - first * decay ** i * jnp.log(jnp.maximum(load, 0.25)), best_b, best

  _, best_b, _ = jax.lax.fori_loop(0, router.BALANCE_LOAD_STEPS, load_step,
                                   (b, b, jnp.float32(jnp.inf)), unroll=unroll)
  return best_b


def time_ms(fn, x, reps):
  f = jax.jit(fn)
  jax.block_until_ready(f(x))
  alone = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(f(x))
    alone.append(time.perf_counter() - t)
  t = time.perf_counter()
  jax.block_until_ready([f(x) for _ in range(reps)])
  return np.median(alone) * 1e3, (time.perf_counter() - t) / reps * 1e3


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
    alone, queued = time_ms(lambda l, n=norm: router.route(l, k, selection_norm=n)[1], logits,
                            args.reps)
    print(f"{norm:34s} alone {alone:.3f}  queued {queued:.3f}")
  shipped = router._balancing_offsets
  variants = [("balance (shipped)", None),
              ("balance, loops unrolled", dict(unroll=True, kth=router._kth_largest)),
              ("balance, top_k for the k-th", dict(unroll=1, kth=kth_by_top_k)),
              ("balance, unrolled + top_k", dict(unroll=True, kth=kth_by_top_k))]
  reference = None
  try:
    for name, kw in variants:
      router._balancing_offsets = (shipped if kw is None
                                   else functools.partial(offsets_variant, **kw))
      fn = lambda l: router.route(l, k, selection_norm="balance")[1]  # noqa: E731
      alone, queued = time_ms(fn, logits, args.reps)
      ids = np.asarray(jax.jit(fn)(logits))
      if reference is None:
        reference, same = ids, ""
      else:
        same = ("same choice" if np.array_equal(ids, reference) else
                f"choice differs in {np.mean(np.any(ids != reference, 1)):.4f} of the tokens")
      load = np.bincount(ids.ravel(), minlength=args.experts) / ids.size * args.experts
      print(f"{name:34s} alone {alone:.3f}  queued {queued:.3f}  imbalance {load.max():.3f}  "
            f"{same}")
  finally:
    router._balancing_offsets = shipped


if __name__ == "__main__":
  main()

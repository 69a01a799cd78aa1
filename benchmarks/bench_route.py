"""jax_megamoe.route's cost per call, for each selection norm, on the default device: alone
(block_until_ready each call) and queued (calls back to back, one wait), medians. For "balance"
also variants of its offset solve, to place its time (session 25): its two loops unrolled, and
the k-th largest of each row from lax.top_k instead of k row maxima; each variant's choice
is compared with the shipped one's. Also: the k-th largest by a row sort, or over each row's
16 largest after the Sinkhorn stage (found once), and 10 Sinkhorn iterations instead of 20.

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


def kth_by_sort(x, k):
  return jnp.sort(x, axis=1)[:, x.shape[1] - k:x.shape[1] - k + 1]


CANDIDATES = 16  # "candidates": each row's top 16 of z + b after the Sinkhorn stage


def offsets_variant(z, top_k, unroll, kth, sinkhorn_iterations=None):
  """router._balancing_offsets with its loops' unrolling, its k-th largest ("maxima": k row
  maxima, as shipped; "top_k"; "sort"; "candidates": k maxima over each row's CANDIDATES
  largest after the Sinkhorn stage, found once: exact while the row's top k stay among them)
  and its Sinkhorn iterations replaced."""
  num_tokens, num_experts = z.shape
  scaled = z / router.BALANCE_TEMPERATURE
  log_row = jnp.log(jnp.float32(top_k))
  mean_load = num_tokens * top_k / num_experts
  log_col = jnp.log(jnp.float32(mean_load))

  def sinkhorn(_, b):
    a = log_row - jax.nn.logsumexp(scaled + b, axis=1, keepdims=True)
    return log_col - jax.nn.logsumexp(scaled + a, axis=0)

  b0 = router.BALANCE_TEMPERATURE * jax.lax.fori_loop(
      0, sinkhorn_iterations or router.BALANCE_SINKHORN_ITERATIONS, sinkhorn,
      jnp.zeros((num_experts,), jnp.float32), unroll=unroll)
  first, last = router.BALANCE_LOAD_STEP_SIZE
  decay = (last / first) ** (1.0 / max(router.BALANCE_LOAD_STEPS - 1, 1))
  if kth == "candidates":
    _, cand_ids = jax.lax.top_k(z + b0, min(CANDIDATES, num_experts))
    cand_z = jnp.take_along_axis(z, cand_ids, axis=1)

  def kth_of(b):
    if kth == "candidates":
      return router._kth_largest(cand_z + b[cand_ids], top_k)
    return {"maxima": router._kth_largest, "top_k": kth_by_top_k,
            "sort": kth_by_sort}[kth](z + b, top_k)

  def load_step(i, carry):
    b, best_b, best = carry
    load = jnp.sum((z + b >= kth_of(b)).astype(jnp.float32), axis=0) / mean_load
    peak = jnp.max(load)
    best_b, best = jnp.where(peak < best, b, best_b), jnp.minimum(peak, best)
    return b - first * decay ** i * jnp.log(jnp.maximum(load, 0.25)), best_b, best

  _, best_b, _ = jax.lax.fori_loop(0, router.BALANCE_LOAD_STEPS, load_step,
                                   (b0, b0, jnp.float32(jnp.inf)), unroll=unroll)
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
              ("balance, loops unrolled", dict(unroll=True, kth="maxima")),
              ("balance, top_k for the k-th", dict(unroll=1, kth="top_k")),
              ("balance, sort for the k-th", dict(unroll=1, kth="sort")),
              ("balance, candidates for the k-th", dict(unroll=1, kth="candidates")),
              ("balance, candidates, unrolled", dict(unroll=True, kth="candidates")),
              ("balance, 10 Sinkhorn iterations", dict(unroll=1, kth="maxima",
                                                       sinkhorn_iterations=10))]
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

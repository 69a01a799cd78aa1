"""How well each variant of route's "balance" offset solve (router._balancing_offsets' keywords,
which bench_route.py times) balances synthetic logits shaped like a collapsing router's, against
the default solve: the largest expert load over the mean after the final top-k choice, how far
the offsets and the choice move, and the wall time on this machine (a CPU's, not a GPU's).

Routers, T x 128 experts, top 8: a shared per-expert profile plus small spread ("profile"); a
rank-1 and a rank-3 spread across tokens; Zipf-distributed token identities plus a rank-2
context term ("zipf+ctx"); a quarter of the tokens in one tight cluster ("cluster").

  python3 benchmarks/balance_solve_quality.py [--tokens 16384]
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.bench_route import balance_solve  # noqa: E402
from jax_megamoe import router  # noqa: E402

EXPERTS, TOP_K = 128, 8
VARIANTS = {
    "default (exp)": {},
    "log": dict(sinkhorn="log"),
    "10 Sinkhorn iterations": dict(sinkhorn_iterations=10),
}


def synthetic_routers(tokens: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  e = EXPERTS
  profile = rng.standard_normal(e)
  yield "profile", profile * 2 + rng.standard_normal((tokens, e)) * 0.3
  yield "rank1", (np.outer(rng.standard_normal(tokens), rng.standard_normal(e)) + profile
                  + rng.standard_normal((tokens, e)) * 0.05)
  yield "rank3", (rng.standard_normal((tokens, 3)) @ rng.standard_normal((3, e)) + profile
                  + rng.standard_normal((tokens, e)) * 0.05)
  ids = np.minimum(rng.zipf(1.3, tokens), 255)
  context = rng.standard_normal((tokens, 2)) @ rng.standard_normal((2, e)) * 0.3
  yield "zipf+ctx", rng.standard_normal((256, e))[ids] + context + profile
  logits = rng.standard_normal((tokens, e)) * 0.3
  logits[: tokens // 4] = (rng.standard_normal(e) * 0.3
                           + rng.standard_normal((tokens // 4, e)) * 0.01)
  yield "cluster", logits


def solve_and_choose(logits):
  """route's "balance" on the logits: (offsets [E], top-k ids [T, k])."""
  _, ids, aux = router.route(logits, TOP_K, selection_norm="balance")
  return aux.selection_stats[2], ids


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--tokens", type=int, default=16384)
  args = p.parse_args(argv)
  print(f"{args.tokens} x {EXPERTS} logits, top {TOP_K}; imbalance = largest load / mean")
  for name, logits in synthetic_routers(args.tokens):
    reference = None
    logits = jnp.asarray(logits, jnp.float32)
    for variant, solve in VARIANTS.items():
      with balance_solve(**solve):
        fn = jax.jit(lambda l: solve_and_choose(l))  # a new function: jit traces it anew
        jax.block_until_ready(fn(logits))
        t = time.perf_counter()
        b, ids = jax.block_until_ready(fn(logits))
        ms = (time.perf_counter() - t) * 1e3
      b, ids = np.asarray(b), np.asarray(ids)
      load = np.bincount(ids.ravel(), minlength=EXPERTS) / ids.size * EXPERTS
      moved = ""
      if reference is None:
        reference = (b, ids)
      else:
        db = (b - b.mean()) - (reference[0] - reference[0].mean())
        moved = (f"offsets moved <= {np.abs(db).max():.3f}, choice differs in "
                 f"{np.mean(np.any(ids != reference[1], 1)):.4f} of the tokens")
      print(f"{name:9s} {variant:20s} imbalance {load.max():.3f}  {ms:7.1f} ms  {moved}",
            flush=True)


if __name__ == "__main__":
  main()

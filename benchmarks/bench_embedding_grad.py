"""The token embedding's table gradient: jnp.take's (XLA's scatter-add of every token's row)
against models.embedding.embedding_lookup's (rows of equal ids summed per sequence first), per
call of the jitted vjp on the default device (alone: median of --reps after a warm-up; queued:
a few calls back to back, one wait; benchmarks/timing.py), for three id distributions:
uniformly random; the byte corpus's (256 ids, examples/data, as the example trains on them);
Zipf (s = 1.1, a word-level vocabulary's shape). Also each result's largest error against a
float64 sum on the host (the bfloat16 scatter rounds at every add).

  python3 benchmarks/bench_embedding_grad.py [--batch 4] [--seq 4096] [--vocab 151936]
      [--hidden 2048] [--dtype bfloat16] [--reps 20]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import timing  # noqa: E402

from examples import data as data_lib  # noqa: E402
from jax_megamoe.models.embedding import embedding_lookup  # noqa: E402

LOOKUPS = {"jnp.take": lambda t, i: jnp.take(t, i, axis=0), "embedding_lookup": embedding_lookup}


def token_ids(kind: str, batch: int, seq: int, vocab: int, rng) -> np.ndarray:
  if kind == "random":
    return rng.integers(0, vocab, (batch, seq))
  if kind == "bytes":  # the example's embedded corpus, tokenised as it trains on it
    data = np.asarray(data_lib.load_tokens(None, vocab), np.int64)
    starts = rng.integers(0, len(data) - seq, batch)
    return np.stack([data[s:s + seq] for s in starts])
  if kind == "zipf":
    return (rng.zipf(1.1, (batch, seq)) - 1) % vocab  # the tail wrapped, not piled on one id
  raise ValueError(kind)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--seq", type=int, default=4096)
  p.add_argument("--vocab", type=int, default=151936)
  p.add_argument("--hidden", type=int, default=2048)
  p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
  p.add_argument("--reps", type=int, default=20)
  args = p.parse_args(argv)
  dtype = jnp.dtype(args.dtype)
  rng = np.random.default_rng(0)
  cotangent_host = rng.standard_normal((args.batch, args.seq, args.hidden)).astype(np.float32)
  cotangent = jnp.asarray(cotangent_host, dtype)
  cotangent_host = np.asarray(cotangent, np.float64)  # what the device sums, exactly
  table = jnp.zeros((args.vocab, args.hidden), dtype)
  print(f"{jax.devices()[0].device_kind}: table gradient of a [{args.vocab}, {args.hidden}] "
        f"{args.dtype} embedding, {args.batch} x {args.seq} tokens, ms per call")
  for kind in ("random", "bytes", "zipf"):
    ids_host = token_ids(kind, args.batch, args.seq, args.vocab, rng)
    ids = jnp.asarray(ids_host, jnp.int32)
    used, where = np.unique(ids_host, return_inverse=True)
    exact = np.zeros((len(used), args.hidden))
    np.add.at(exact, where.ravel(), cotangent_host.reshape(-1, args.hidden))
    top = np.bincount(ids_host.ravel()).max() / ids_host.size
    for name, lookup in LOOKUPS.items():
      grad = jax.jit(lambda t, c, lookup=lookup: jax.vjp(lambda t: lookup(t, ids), t)[1](c)[0])
      alone, queued = timing.alone_and_queued_ms(lambda: grad(table, cotangent),
                                                 jax.block_until_ready, args.reps)
      got = np.asarray(grad(table, cotangent)[used], np.float64)
      err = np.abs(got - exact).max() / np.abs(exact).max()
      print(f"{kind:7s} (most frequent id {top:6.2%}) {name:17s} alone {alone:8.3f}  "
            f"queued {queued:8.3f}  largest error / largest entry {err:.2e}", flush=True)


if __name__ == "__main__":
  main()

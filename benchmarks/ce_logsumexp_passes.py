"""The LM head's per-chunk log-sum-exp on the default device, in both forms of
models.losses._logsumexp (CE_LSE_ONE_PASS): jax.nn.logsumexp (a max pass, then a sum-exp pass
over the float32 logits) and one variadic (max, sum) reduce. Alone, and with the d_logits pass
that follows it in losses._chunked_ce_fwd. Then the chunk's loss and d_logits as the training
step makes them (losses._loss_and_d_logits): by the JAX definition, and by the kernel
(CE_KERNEL: one read of the logits) where it runs. At the 30B example's chunk: [4, 256, 151936]
float32 logits (622 MB).

  python3 benchmarks/ce_logsumexp_passes.py [--vocab 151936] [--reps 20]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import timing  # noqa: E402
from jax_megamoe.models import losses  # noqa: E402

CHUNK = (4, 256)  # sequences x positions of the 30B example's chunk


def _with_d_logits(x, t):
  """lse and d_logits as losses._chunked_ce_fwd makes them (mean over 16,384 tokens)."""
  lse = losses._logsumexp(x)
  return lse, losses._d_logits(x, lse, t, 16384, jnp.bfloat16)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--vocab", type=int, default=151936)
  p.add_argument("--reps", type=int, default=20)
  args = p.parse_args(argv)
  x = jax.random.normal(jax.random.key(0), (*CHUNK, args.vocab), jnp.float32) * 3
  t = jax.random.randint(jax.random.key(1), CHUNK, 0, args.vocab)
  ref = jax.jit(lambda x: jax.nn.logsumexp(x, axis=-1))(x)
  print(jax.devices()[0].device_kind, "ms per chunk (alone, queued)")
  saved = losses.CE_LSE_ONE_PASS
  try:
    for name, one_pass in (("two passes", False), ("one pass", True)):
      losses.CE_LSE_ONE_PASS = one_pass  # read when jit traces below
      f, g = jax.jit(losses._logsumexp), jax.jit(_with_d_logits)
      err = float(jnp.abs(f(x) - ref).max())
      a, q = timing.alone_and_queued_ms(lambda: f(x), jax.block_until_ready, args.reps)
      a2, q2 = timing.alone_and_queued_ms(lambda: g(x, t), jax.block_until_ready, args.reps)
      print(f"{name:10s} lse {a:.3f} {q:.3f}   lse + d_logits {a2:.3f} {q2:.3f}   "
            f"max |diff| {err:.2e}")
  finally:
    losses.CE_LSE_ONE_PASS = saved
  _loss_and_d_logits_rows(x, t, args.reps)


def _loss_and_d_logits_rows(x, t, reps):
  """The chunk's loss + d_logits, JAX definition against the kernel (a line each; the kernel's
  says "not run" where it does not run), whatever CE_KERNEL's default."""
  def with_kernel(kernel, f, *args):
    saved = losses.CE_KERNEL
    losses.CE_KERNEL = kernel
    try:
      return f(*args)
    finally:
      losses.CE_KERNEL = saved

  def path(kernel):  # CE_KERNEL is read while jit traces
    return jax.jit(lambda x, t: with_kernel(
        kernel, losses._loss_and_d_logits, x, t, 16384, jnp.bfloat16, None))

  runs = with_kernel(True, losses._kernel_platforms, jnp.bfloat16, None)
  loss, d = path(False)(x, t)
  for name, f in (("jax", path(False)), ("kernel", path(True) if runs else None)):
    if f is None:
      print(f"{name:10s} loss + d_logits not run (no kernel for {jax.devices()[0].platform} "
            f"with {jax.device_count()} devices)")
      continue
    got_loss, got_d = f(x, t)
    err = float(jnp.abs(got_d.astype(jnp.float32) - d.astype(jnp.float32)).max())
    a, q = timing.alone_and_queued_ms(lambda f=f: f(x, t), jax.block_until_ready, reps)
    print(f"{name:10s} loss + d_logits {a:.3f} {q:.3f}   loss {float(got_loss):.6e} "
          f"(jax {float(loss):.6e})   max |d diff| {err:.2e}")


if __name__ == "__main__":
  main()

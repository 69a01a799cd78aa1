"""Language-model loss without materialising the [B, S, V] logits: with Qwen3's 151,936-token
vocabulary the float32 logits of 16k tokens alone take 10 GB (and as much again for their
gradient)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# The float32 logits one device may hold at once before the cross-entropy is chunked: 1 GiB
# (the 30B config's 151,936-token vocabulary at 16,384 tokens would take 10 GB, and as much
# again for their gradient).
LOGITS_BUDGET_BYTES = 1 << 30


def auto_ce_chunk(vocab_size: int, batch_per_device: int, seq_len: int, *,
                  budget_bytes: int = LOGITS_BUDGET_BYTES) -> int:
  """The default `chunk` of chunked_cross_entropy: 0 (full logits) when one device's float32
  logits [batch_per_device, seq_len, vocab_size] fit `budget_bytes`, else the largest divisor
  of seq_len whose chunk fits (at least 1). A large vocabulary is what makes logits big: the
  tiny config's 320 tokens never chunk, the published configs' 151,936 do at any useful batch.
  """
  for name, value in (("vocab_size", vocab_size), ("batch_per_device", batch_per_device),
                      ("seq_len", seq_len), ("budget_bytes", budget_bytes)):
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}")
  per_position = 4 * vocab_size * batch_per_device
  if per_position * seq_len <= budget_bytes:
    return 0
  fits = [c for c in range(1, seq_len + 1)
          if seq_len % c == 0 and c * per_position <= budget_bytes]
  return max(fits, default=1)


def chunked_cross_entropy(hidden: jax.Array, head: jax.Array, targets: jax.Array, *,
                          chunk: int) -> jax.Array:
  """Mean next-token cross-entropy, computed `chunk` sequence positions at a time.

  Args:
    hidden: [B, S, H] final (normed) hidden states, compute dtype.
    head: [H, V] output projection (lm_head kernel, or the embedding transposed when tied), any
      float dtype (float32 master weights: rounded to hidden's dtype once per pass, not per
      chunk; its gradient is summed over the chunks in float32).
    targets: [B, S] int target ids.
    chunk: positions per chunk; must divide S. Each chunk's logits [B, chunk, V] (float32
      out of a GEMM in hidden's dtype) are made, reduced and dropped, and made again in the
      backward pass, so peak memory is one chunk's logits. The batch axis keeps its sharding:
      chunks run over S.

  Returns:
    Scalar float32, equal to the mean of softmax cross-entropy over all B * S positions.

  The backward is written out (a custom VJP) so that both of its GEMMs run in hidden's dtype:
  d logits = softmax - one_hot is rounded to it, as autodiff of the float32 logits would not do
  (it ran them as float32 (TF32) GEMMs, 3x slower: benchmarks/RESULTS.md, step profile).
  """
  batch, seq, _ = hidden.shape
  if targets.shape != (batch, seq):
    raise ValueError(f"targets must be [batch={batch}, seq={seq}], got shape {targets.shape}")
  if not isinstance(chunk, int) or chunk < 1 or seq % chunk:
    raise ValueError(f"chunk must be a positive int dividing seq={seq}, got {chunk!r}")
  if head.ndim != 2 or head.shape[0] != hidden.shape[-1]:
    raise ValueError(f"head must be [hidden={hidden.shape[-1]}, vocab], got shape {head.shape}")
  with jax.named_scope("cross_entropy"):  # the scans' own work too, for step profiles
    return _chunked_ce(hidden, head, targets.astype(jnp.int32), chunk)


def _by_chunk(a: jax.Array, chunk: int) -> jax.Array:
  """[B, S, ...] -> [S / chunk, B, chunk, ...] (the scan's axis first)."""
  batch, seq = a.shape[:2]
  return jnp.moveaxis(a.reshape(batch, seq // chunk, chunk, *a.shape[2:]), 1, 0)


def _from_chunks(a: jax.Array) -> jax.Array:
  """The inverse of _by_chunk."""
  steps, batch, chunk = a.shape[:3]
  return jnp.moveaxis(a, 0, 1).reshape(batch, steps * chunk, *a.shape[3:])


def _logits(h: jax.Array, head: jax.Array) -> jax.Array:
  with jax.named_scope("lm_head"):
    return jnp.einsum("bch,hv->bcv", h, head, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _chunked_ce(hidden, head, targets, chunk):
  return _chunked_ce_fwd(hidden, head, targets, chunk)[0]


def _chunked_ce_fwd(hidden, head, targets, chunk):
  head_c = head.astype(hidden.dtype)

  def body(total, xs):
    h, t = xs
    logits = _logits(h, head_c)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0]
    return total + jnp.sum(lse - target_logit), lse

  total, lse = jax.lax.scan(body, jnp.zeros((), jnp.float32),
                            (_by_chunk(hidden, chunk), _by_chunk(targets, chunk)))
  # lse [S / chunk, B, chunk] is kept: the backward needs it and it is tiny beside the logits.
  return total / targets.size, (hidden, head, targets, lse)


def _chunked_ce_bwd(chunk, res, g):
  hidden, head, targets, lse = res
  head_c = head.astype(hidden.dtype)
  vocab = head.shape[1]
  scale = g / targets.size

  def body(d_head, xs):
    h, t, lse_c = xs
    logits = _logits(h, head_c)
    one_hot = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2) == t[..., None]
    d_logits = ((jnp.exp(logits - lse_c[..., None]) - one_hot) * scale).astype(hidden.dtype)
    with jax.named_scope("lm_head"):
      d_h = jnp.einsum("bcv,hv->bch", d_logits, head_c, preferred_element_type=jnp.float32)
      d_head = d_head + jnp.einsum("bch,bcv->hv", h, d_logits,
                                   preferred_element_type=jnp.float32)
    return d_head, d_h.astype(hidden.dtype)

  d_head, d_hidden = jax.lax.scan(
      body, jnp.zeros((head.shape[0], vocab), jnp.float32),
      (_by_chunk(hidden, chunk), _by_chunk(targets, chunk), lse))
  return _from_chunks(d_hidden), d_head.astype(head.dtype), None


_chunked_ce.defvjp(_chunked_ce_fwd, _chunked_ce_bwd)

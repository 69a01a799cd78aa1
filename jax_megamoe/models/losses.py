"""Language-model loss without materialising the [B, S, V] logits: with Qwen3's 151,936-token
vocabulary the float32 logits of 16k tokens alone take 10 GB (and as much again for their
gradient)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def chunked_cross_entropy(hidden: jax.Array, head: jax.Array, targets: jax.Array, *,
                          chunk: int) -> jax.Array:
  """Mean next-token cross-entropy, computed `chunk` sequence positions at a time.

  Args:
    hidden: [B, S, H] final (normed) hidden states, compute dtype.
    head: [H, V] output projection (lm_head kernel, or the embedding transposed when tied).
    targets: [B, S] int target ids.
    chunk: positions per chunk; must divide S. Each chunk's logits [B, chunk, V] (float32) are
      made, reduced and dropped, and made again in the backward pass (rematerialised), so peak
      memory is one chunk's logits. The batch axis keeps its sharding: chunks run over S.

  Returns:
    Scalar float32, equal to the mean of softmax cross-entropy over all B * S positions.
  """
  batch, seq, hidden_size = hidden.shape
  if targets.shape != (batch, seq):
    raise ValueError(f"targets must be [batch={batch}, seq={seq}], got shape {targets.shape}")
  if not isinstance(chunk, int) or chunk < 1 or seq % chunk:
    raise ValueError(f"chunk must be a positive int dividing seq={seq}, got {chunk!r}")
  steps = seq // chunk
  hidden_chunks = jnp.moveaxis(hidden.reshape(batch, steps, chunk, hidden_size), 1, 0)
  target_chunks = jnp.moveaxis(targets.reshape(batch, steps, chunk), 1, 0)

  @jax.checkpoint
  def chunk_loss_sum(h, t):
    logits = jnp.einsum("bch,hv->bcv", h, head.astype(h.dtype),
                        preferred_element_type=jnp.float32)
    target_logit = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0]
    return jnp.sum(jax.nn.logsumexp(logits, axis=-1) - target_logit)

  def body(total, xs):
    return total + chunk_loss_sum(*xs), None

  total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (hidden_chunks, target_chunks))
  return total / (batch * seq)

"""Language-model loss without materialising the [B, S, V] logits: with Qwen3's 151,936-token
vocabulary the float32 logits of 16k tokens alone take 10 GB (and as much again for their
gradient)."""

from __future__ import annotations

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
    with jax.named_scope("lm_head"):
      logits = jnp.einsum("bch,hv->bcv", h, head.astype(h.dtype),
                          preferred_element_type=jnp.float32)
    target_logit = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0]
    return jnp.sum(jax.nn.logsumexp(logits, axis=-1) - target_logit)

  def body(total, xs):
    return total + chunk_loss_sum(*xs), None

  with jax.named_scope("cross_entropy"):  # the scan's own work too, for step profiles
    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (hidden_chunks, target_chunks))
  return total / (batch * seq)

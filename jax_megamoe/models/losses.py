"""Language-model loss without materialising the [B, S, V] logits: with Qwen3's 151,936-token
vocabulary the float32 logits of 16k tokens alone take 10 GB (and as much again for their
gradient)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jax_megamoe import _ffi, env_overrides, parallel

# The float32 logits one device may hold at once before the cross-entropy is chunked: 1 GiB
# (the 30B config's 151,936-token vocabulary at 16,384 tokens would take 10 GB, and as much
# again for their gradient).
LOGITS_BUDGET_BYTES = 1 << 30

# Each chunk's log-sum-exp by one variadic (max, sum) reduce, one read of the float32 logits,
# instead of jax.nn.logsumexp's max pass and sum-exp pass (two reads of 622 MB per chunk at the
# 30B config's 1,024-token chunks). On an H100 the chunk's log-sum-exp and d_logits took 0.603
# ms queued against 0.767 (benchmarks/RESULTS.md, session 27; ~2.6 ms of a 16-chunk step).
CE_LSE_ONE_PASS = True

# Each chunk's loss and d_logits by one CUDA kernel (ffi/impls/cross_entropy_grad.cu) that reads
# the float32 logits once, where XLA's log-sum-exp reduce and d_logits pass read them twice
# (~9 ms of a 16-chunk 30B step on an H100 outside any GEMM: benchmarks/RESULTS.md, session 28).
# Taken on GPUs the kernels were built for, for bfloat16 hidden states, on one device or under
# chunked_cross_entropy's `mesh`; everywhere else the JAX definition (_loss_and_d_logits_jax).
# On since its GPU tests passed on an H100 (session 29: the chunk's loss + d_logits 0.385 ms in
# the step against XLA's 0.56, the 4-layer step's outside share 15.8% -> 13.8% with the balance
# kernel); MEGAMOE_CE_KERNEL=0 turns it off.
CE_KERNEL = env_overrides.switch("MEGAMOE_CE_KERNEL", True)
CE_KERNEL_TARGET = "megamoe_cross_entropy_grad"
# The platforms (jax.lax.platform_dependent's names) whose handler the kernel path calls; tests
# add "cpu", the handler's CPU twin, to run the path end to end in CI.
CE_KERNEL_PLATFORMS = ("cuda",)


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
                          chunk: int, mesh: Mesh | None = None) -> jax.Array:
  """Mean next-token cross-entropy, computed `chunk` sequence positions at a time.

  Args:
    hidden: [B, S, H] final (normed) hidden states, compute dtype.
    head: [H, V] output projection (lm_head kernel, or the embedding transposed when tied), any
      float dtype (float32 master weights: rounded to hidden's dtype once per pass, not per
      chunk; its gradient is summed over the chunks in float32).
    targets: [B, S] int target ids.
    chunk: positions per chunk; must divide S. Each chunk's logits [B, chunk, V] (float32
      out of a GEMM in hidden's dtype) are made, reduced and dropped, so peak memory is one
      chunk's logits. The batch axis keeps its sharding: chunks run over S.
    mesh: the mesh whose every axis shards the batch (as Qwen3Moe's `mesh`), or None. Under a
      mesh the loss's kernel (CE_KERNEL) runs on each device's own rows; with several devices
      and no mesh it is not used (XLA would gather a custom call's operands onto every device).

  Returns:
    Scalar float32, equal to the mean of softmax cross-entropy over all B * S positions.

  Differentiated, it computes the gradients in the same pass over each chunk (a custom VJP: the
  backward only scales them), so the logits are made once, not again for the backward, and
  both gradient GEMMs run in hidden's dtype (d logits = softmax - one_hot rounded to it; d head
  summed over the chunks in float32). Autodiff of the float32 logits made them twice and ran the
  gradient GEMMs in float32 (TF32): a third of an 8-layer 30B step (benchmarks/RESULTS.md).
  The price: d head (float32 [H, V], 1.2 GB at Qwen3's 2048 x 151,936) and d hidden are held from
  the forward until the backward reaches them.
  """
  batch, seq, _ = hidden.shape
  if targets.shape != (batch, seq):
    raise ValueError(f"targets must be [batch={batch}, seq={seq}], got shape {targets.shape}")
  if not isinstance(chunk, int) or chunk < 1 or seq % chunk:
    raise ValueError(f"chunk must be a positive int dividing seq={seq}, got {chunk!r}")
  if head.ndim != 2 or head.shape[0] != hidden.shape[-1]:
    raise ValueError(f"head must be [hidden={hidden.shape[-1]}, vocab], got shape {head.shape}")
  if mesh is not None and batch % mesh.size:
    raise ValueError(f"the batch ({batch}) must divide over the mesh's {mesh.size} devices")
  with jax.named_scope("cross_entropy"):  # the scans' own work too, for step profiles
    return _chunked_ce(hidden, head, targets.astype(jnp.int32), chunk, mesh)


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


def _logsumexp(logits: jax.Array) -> jax.Array:
  """log(sum(exp(logits))) over the last axis; CE_LSE_ONE_PASS picks the form."""
  if not CE_LSE_ONE_PASS:
    return jax.nn.logsumexp(logits, axis=-1)

  # Partial results (m, s) stand for s * exp(m). Combining rescales the smaller one's sum to
  # the larger max; equal maxima (both -inf or both +inf included) keep their sums unscaled,
  # so (-inf, 0) is the identity, an all -inf row gives -inf and a +inf logit gives +inf.
  def combine(a, b):
    (m1, s1), (m2, s2) = a, b
    m = jnp.maximum(m1, m2)
    return m, (jnp.where(m1 == m, s1, s1 * jnp.exp(m1 - m)) +
               jnp.where(m2 == m, s2, s2 * jnp.exp(m2 - m)))

  m, s = jax.lax.reduce((logits, jnp.ones_like(logits)),
                        (jnp.array(-jnp.inf, logits.dtype), jnp.array(0, logits.dtype)),
                        combine, (logits.ndim - 1,))
  return m + jnp.log(s)


def _d_logits(logits: jax.Array, lse: jax.Array, targets: jax.Array, count: int,
              dtype) -> jax.Array:
  """The mean loss's gradient with respect to a chunk's logits [B, c, V] (the mean over
  `count` positions), rounded to `dtype`: (softmax - one_hot(targets)) / count."""
  one_hot = (jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1) ==
             targets[..., None])
  return ((jnp.exp(logits - lse[..., None]) - one_hot) / count).astype(dtype)


def _loss_and_lse(logits, targets):
  """A chunk's summed loss (lse - target logit over its positions) and its lse. A target
  outside [0, V) makes the loss NaN (take_along_axis alone would count a negative one from the
  end)."""
  lse = _logsumexp(logits)
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  valid = (targets >= 0) & (targets < logits.shape[-1])
  return jnp.sum(lse - jnp.where(valid, target_logit, jnp.nan)), lse


def _loss_and_d_logits_jax(logits, targets, count, dtype):
  """A chunk's summed loss and d_logits (_d_logits): the kernel's definition."""
  loss, lse = _loss_and_lse(logits, targets)
  return loss, _d_logits(logits, lse, targets, count, dtype)


def _kernel_platforms(dtype, mesh: Mesh | None) -> tuple[str, ...]:
  """The platforms on which _loss_and_d_logits calls the kernel (CE_KERNEL); () for none."""
  if not CE_KERNEL or jnp.dtype(dtype) != jnp.bfloat16:
    return ()
  return _ffi.custom_call_platforms(CE_KERNEL_TARGET, CE_KERNEL_PLATFORMS, mesh)


def _loss_and_d_logits(logits, targets, count, dtype, mesh):
  """_loss_and_d_logits_jax, by the kernel where _kernel_platforms says (within float32 and
  bfloat16 rounding of it: its exp is the SFU's)."""
  platforms = _kernel_platforms(dtype, mesh)
  if not platforms:
    return _loss_and_d_logits_jax(logits, targets, count, dtype)

  def rows(logits, targets):  # [N, V], [N] -> d_logits [N, V], row_loss [N]
    out = (jax.ShapeDtypeStruct(logits.shape, jnp.bfloat16),
           jax.ShapeDtypeStruct(targets.shape, jnp.float32))
    return jax.ffi.ffi_call(CE_KERNEL_TARGET, out, vmap_method="sequential")(
        logits, targets, count=np.int64(count))

  def kernel(logits, targets):
    args = (logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    d_logits, row_loss = (rows(*args) if mesh is None
                          else parallel.shard_over_tokens(rows, mesh, args, 2, check_vma=False))
    return jnp.sum(row_loss), d_logits.reshape(logits.shape)

  def definition(logits, targets):
    return _loss_and_d_logits_jax(logits, targets, count, dtype)

  return jax.lax.platform_dependent(logits, targets, default=definition,
                                    **{p: kernel for p in platforms})


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _chunked_ce(hidden, head, targets, chunk, mesh):
  head_c = head.astype(hidden.dtype)

  def body(total, xs):
    h, t = xs
    return total + _loss_and_lse(_logits(h, head_c), t)[0], None

  total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32),
                          (_by_chunk(hidden, chunk), _by_chunk(targets, chunk)))
  return total / targets.size


def _chunked_ce_fwd(hidden, head, targets, chunk, mesh):
  """The loss and, in the same pass over each chunk's logits, its gradients (the loss is a
  scalar, so they are known up to the cotangent's factor): the backward does not make the
  logits again (3 GEMMs per chunk, not 4)."""
  head_c = head.astype(hidden.dtype)

  def body(carry, xs):
    total, d_head = carry
    h, t = xs
    loss, d_logits = _loss_and_d_logits(_logits(h, head_c), t, targets.size, h.dtype, mesh)
    with jax.named_scope("lm_head"):
      d_h = jnp.einsum("bcv,hv->bch", d_logits, head_c, preferred_element_type=jnp.float32)
      d_head = d_head + jnp.einsum("bch,bcv->hv", h, d_logits,
                                   preferred_element_type=jnp.float32)
    return (total + loss, d_head), d_h.astype(h.dtype)

  (total, d_head), d_hidden = jax.lax.scan(
      body, (jnp.zeros((), jnp.float32), jnp.zeros(head.shape, jnp.float32)),
      (_by_chunk(hidden, chunk), _by_chunk(targets, chunk)))
  return total / targets.size, (_from_chunks(d_hidden), d_head.astype(head.dtype))


def _chunked_ce_bwd(chunk, mesh, res, g):
  del chunk, mesh
  d_hidden, d_head = res
  return (g * d_hidden).astype(d_hidden.dtype), (g * d_head).astype(d_head.dtype), None


_chunked_ce.defvjp(_chunked_ce_fwd, _chunked_ce_bwd)

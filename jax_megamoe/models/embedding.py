"""Token-embedding lookup whose gradient sums each token's rows before it touches the table.

`jnp.take`'s gradient is a scatter-add of every token's cotangent row into the [V, H] table. On
GPUs XLA runs it with atomic adds, one per element, in the table's dtype: where many tokens share
an id they serialise on the same addresses, and in bfloat16 each add rounds. On the byte corpus
(256 ids in a 151,936-row table) that scatter took 12.65 ms of a 285 ms 30B step on the H200
(benchmarks/RESULTS.md, session 25: the largest kernel outside GEMMs and attention); a bfloat16
gradient of an id that a quarter of the tokens share came out ~10% off (tests/test_embedding.py).

`embedding_lookup` computes the same forward; its backward first sums the rows of equal ids in
float32, per sequence, then adds one row per (sequence, id) into the table:
1. sort each sequence's ids (stable) and its cotangent rows with them;
2. in blocks of EMBEDDING_GRAD_BLOCK sorted rows, the running sum over the rows of the same id
   up to each row: a matmul with a 0/1 lower-triangular mask (tensor cores, float32 accumulation);
3. across blocks, add to a block's first id the partial sums that earlier blocks' last rows hold
   for it (a small float32 matmul over the blocks);
4. each id's last row then holds its sum over the sequence; scatter those rows alone (rounded to
   the table's dtype once), so an address receives one add per sequence that uses the id.
Sorting and summing per sequence keeps a batch-sharded lookup local to its devices. On GPUs the
scatter's adds to one address are atomic: an id used by several sequences gets its per-sequence
sums in any order (jnp.take's gradient: every token's row in any order).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

__all__ = ["EMBEDDING_GRAD_BLOCK", "embedding_lookup"]

# Sorted rows summed by one mask matmul: [S / 128] blocks of a [128, 128] mask per sequence.
EMBEDDING_GRAD_BLOCK = 128


def embedding_lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
  """table [V, H] (any float dtype), ids [B, S] integer -> rows [B, S, H] (table's dtype):
  jnp.take(table, ids, axis=0), ids narrower than 32 bits widened first. Ids in [-V, 0) count
  from the end; ids outside [-V, V) give NaN rows (jnp.take's "fill") and no gradient.

  The table's gradient is jnp.take's sum, with each sequence's equal ids summed first (module
  docstring); no gradient reaches ids. Differences: a non-finite cotangent row makes the
  gradient of every id in its block of sorted rows NaN (0 x inf in the mask product), where
  jnp.take's keeps it to its own id: non-finite either way. Reverse mode only (a custom_vjp:
  jax.jvp through it raises).
  """
  if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(f"ids must be an integer [batch, seq] array, got {ids.dtype} "
                     f"{ids.shape}")
  if table.ndim != 2 or not jnp.issubdtype(table.dtype, jnp.floating):
    raise ValueError(f"table must be a float [vocab, hidden] array, got {table.dtype} "
                     f"{table.shape}")
  if ids.dtype.itemsize < 4:  # jnp.take's negative ids wrap in int8 arithmetic (-1 -> row 43)
    ids = ids.astype(jnp.int32)
  return _lookup(table.shape[0], table, ids)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _lookup(vocab, table, ids):
  del vocab
  return jnp.take(table, ids, axis=0)


def _lookup_fwd(vocab, table, ids):
  return _lookup(vocab, table, ids), ids  # the backward needs the ids alone


def _lookup_bwd(vocab, ids, rows_grad):
  return _table_grad(ids, rows_grad, vocab), None


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


def _table_grad(ids: jax.Array, rows_grad: jax.Array, vocab: int) -> jax.Array:
  """[V, H] in rows_grad's dtype (the table's): the sum over the tokens of ids [B, S] of
  rows_grad [B, S, H] at their id."""
  batch, seq = ids.shape
  hidden, dtype = rows_grad.shape[-1], rows_grad.dtype
  block = EMBEDDING_GRAD_BLOCK
  # As jnp.take: an id in [-V, 0) counts from the end; ids outside [-V, V) get no gradient
  # ("fill" mode): their rows are zeroed and they sort as one id, `vocab`, which the final
  # scatter drops. Checked before the cast to int32, which would wrap a large uint32 or int64
  # id into range.
  if jnp.issubdtype(ids.dtype, jnp.unsignedinteger):
    valid = ids < vocab
  else:
    valid = (ids >= -vocab) & (ids < vocab)
    ids = jnp.where(ids < 0, ids + vocab, ids)
  ids = jnp.where(valid, ids, vocab).astype(jnp.int32)
  rows_grad = jnp.where(valid[..., None], rows_grad, 0)
  order = jnp.argsort(ids, axis=1, stable=True)
  ids = jnp.take_along_axis(ids, order, axis=1)
  rows = jnp.take_along_axis(rows_grad, order[:, :, None], axis=1)
  padded = -(-seq // block) * block
  if padded != seq:  # padding rows: id `vocab` after every real id, zero rows
    ids = jnp.pad(ids, ((0, 0), (0, padded - seq)), constant_values=vocab)
    rows = jnp.pad(rows, ((0, 0), (0, padded - seq), (0, 0)))
  blocks = padded // block
  ids = ids.reshape(batch, blocks, block)
  rows = rows.reshape(batch, blocks, block, hidden)

  # 2. Within each block: the running sum of the rows of the same id, up to each row.
  pos = jnp.arange(block)
  same_before = ((ids[..., :, None] == ids[..., None, :])
                 & (pos[:, None] >= pos[None, :]))                          # [B, n, i, j]
  # Float32 sums (float64 for a float64 table). A float32 table's product asks for HIGHEST, so
  # that XLA:GPU does not run it in TF32; narrower rows are exact in any mode (and keep the
  # plain bfloat16 GEMM).
  acc = jnp.promote_types(dtype, jnp.float32)
  exact = jax.lax.Precision.HIGHEST if jnp.finfo(dtype).bits >= 32 else None
  partial = jnp.einsum("bnij,bnjh->bnih", same_before.astype(rows.dtype), rows,
                       preferred_element_type=acc, precision=exact)
  # 3. Across blocks: what earlier blocks' last rows hold for this block's first id (sorted,
  # so only the first id of a block can continue from earlier blocks).
  first, last = ids[..., 0], ids[..., -1]                                    # [B, n]
  carried_from = ((last[:, None, :] == first[:, :, None])
                  & (jnp.arange(blocks)[None, :] < jnp.arange(blocks)[:, None]))  # [B, n, c]
  carried = jnp.einsum("bnc,bch->bnh", carried_from.astype(acc), partial[..., -1, :],
                       precision=jax.lax.Precision.HIGHEST)
  total = partial + jnp.where((ids == first[..., None])[..., None], carried[:, :, None, :], 0.0)
  # 4. Each id's last row holds its sum over the sequence: scatter those rows alone.
  ids = ids.reshape(batch, padded)
  is_last = jnp.concatenate([ids[:, 1:] != ids[:, :-1], jnp.ones((batch, 1), bool)], axis=1)
  target = jnp.where(is_last, ids, vocab).reshape(-1)
  return jnp.zeros((vocab, hidden), dtype).at[target].add(
      total.reshape(-1, hidden).astype(dtype), mode="drop")

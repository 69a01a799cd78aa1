"""models.embedding.embedding_lookup: jnp.take's forward; its table gradient, summed by id within
each sequence before the scatter, equals jnp.take's (float32) and rounds once per (sequence, id)
in bfloat16, where jnp.take's scatter rounds at every add."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jax_megamoe.models import embedding
from jax_megamoe.models.embedding import embedding_lookup


def _ids(kind, batch, seq, vocab, rng):
  if kind == "random":
    return rng.integers(0, vocab, (batch, seq))
  if kind == "one id":  # one segment across every block of the sequence
    return np.full((batch, seq), 3)
  if kind == "zipf":  # long runs of a few ids next to single ones
    return np.minimum(rng.zipf(1.2, (batch, seq)), vocab - 1)
  if kind == "out of range":  # jnp.take: [-V, 0) counts from the end, beyond: NaN, no gradient
    ids = rng.integers(0, vocab, (batch, seq))
    ids[0, :6] = [-1, vocab, vocab + 3, -vocab, -vocab - 1, 2]
    return ids
  raise ValueError(kind)


def _take_grad(table, ids, cotangent):
  return jax.vjp(lambda t: jnp.take(t, ids, axis=0), table)[1](cotangent)[0]


@pytest.mark.parametrize("kind,batch,seq", [
    ("random", 2, 300), ("random", 1, 1), ("one id", 3, 257), ("zipf", 2, 1000),
    ("out of range", 2, 40), ("zipf", 1, 24)])
@pytest.mark.parametrize("block", [128, 8])
def test_matches_take_forward_and_gradient(kind, batch, seq, block, monkeypatch):
  """Fresh random tables and cotangents; block 8 puts sequences over many blocks (and 24
  tokens in exactly 3). The gradient is taken jitted."""
  monkeypatch.setattr(embedding, "EMBEDDING_GRAD_BLOCK", block)
  rng = np.random.default_rng(seq + block)
  vocab, hidden = 50, 16
  ids = jnp.asarray(_ids(kind, batch, seq, vocab, rng), jnp.int32)
  table = jnp.asarray(rng.standard_normal((vocab, hidden)), jnp.float32)
  cotangent = jnp.asarray(rng.standard_normal((batch, seq, hidden)), jnp.float32)
  np.testing.assert_array_equal(embedding_lookup(table, ids), jnp.take(table, ids, axis=0))
  got = jax.jit(lambda t, c: jax.vjp(lambda t: embedding_lookup(t, ids), t)[1](c)[0])(
      table, cotangent)
  # Against the float64 sum, within float32 rounding of the terms' magnitudes (on a GPU
  # jnp.take's atomic adds run in another order than this sum: a row summed from ~500 ids
  # differed by 2e-5 of 0.88).
  exact, magnitude = _exact_grad(np.asarray(ids), np.asarray(cotangent), vocab)
  bound = 1e-6 * magnitude + 1e-7
  assert np.all(np.abs(np.asarray(got, np.float64) - exact) <= bound)
  assert np.all(np.abs(np.asarray(_take_grad(table, ids, cotangent), np.float64) - exact)
                <= bound)
  # Same inputs, same bits: on XLA:CPU always; on GPUs where no id repeats across sequences
  # (the final scatter's adds of one id from several sequences are atomic, in any order).
  if jax.default_backend() != "cpu" and batch > 1:
    return
  again = jax.jit(lambda t, c: jax.vjp(lambda t: embedding_lookup(t, ids), t)[1](c)[0])(
      table, cotangent)
  np.testing.assert_array_equal(got, again)


def _exact_grad(ids, cotangent, vocab):
  """(sum of each id's cotangent rows, sum of their absolute values), float64; ids in [-V, 0)
  count from the end as in jnp.take, ids beyond get no gradient."""
  ids = np.where((ids < 0) & (ids >= -vocab), ids + vocab, ids).reshape(-1)
  rows = cotangent.reshape(ids.size, -1).astype(np.float64)
  keep = (ids >= 0) & (ids < vocab)
  exact = np.zeros((vocab, rows.shape[1]))
  magnitude = np.zeros_like(exact)
  np.add.at(exact, ids[keep], rows[keep])
  np.add.at(magnitude, ids[keep], np.abs(rows[keep]))
  return exact, magnitude


@pytest.mark.parametrize("dtype,values", [
    (np.int8, [-1, 5, 127, -128]), (np.uint8, [0, 255, 7, 43]), (np.int16, [-300, -301, 299, 300]),
    (np.uint32, [2**32 - 1, 299, 300, 0]), (np.int32, [-2**31, 2**31 - 1, -1, 5])])
def test_id_dtypes_and_their_extremes(dtype, values):
  """Every integer dtype, at its extremes, against jnp.take of the ids as int32 (jnp.take of
  int8 ids wraps -1 + 300 in int8, to row 43; embedding_lookup widens them first): the same
  rows, NaN where out of range, and the same gradient (a uint32 id of 2**32 - 1 stays out of
  range rather than wrapping to -1, row V - 1)."""
  rng = np.random.default_rng(3)
  vocab, hidden = 300, 4
  table = jnp.asarray(rng.standard_normal((vocab, hidden)), jnp.float32)
  ids = jnp.asarray(np.array([values * 3], dtype))
  wide = jnp.asarray(np.array([values * 3], dtype).astype(np.int64).clip(-2**31, 2**31 - 1),
                     jnp.int32)
  cotangent = jnp.asarray(rng.standard_normal(ids.shape + (hidden,)), jnp.float32)
  np.testing.assert_array_equal(embedding_lookup(table, ids), jnp.take(table, wide, axis=0))
  got = jax.vjp(lambda t: embedding_lookup(t, ids), table)[1](cotangent)[0]
  np.testing.assert_allclose(got, _take_grad(table, wide, cotangent), rtol=1e-6, atol=1e-6)


def test_out_of_range_ids_drop_even_a_nan_cotangent():
  """An out-of-range id's row is NaN forward, so its cotangent may well be NaN: it is dropped
  (as jnp.take's), not summed into the last valid id sorted beside it."""
  vocab, hidden = 10, 4
  ids = jnp.asarray([[vocab - 1, vocab + 5, vocab - 1]], jnp.int32)
  cotangent = jnp.asarray([[[1.0] * hidden, [np.nan] * hidden, [2.0] * hidden]], jnp.float32)
  got = jax.vjp(lambda t: embedding_lookup(t, ids), jnp.zeros((vocab, hidden)))[1](cotangent)[0]
  np.testing.assert_array_equal(got[vocab - 1], [3.0] * hidden)
  assert np.isfinite(np.asarray(got)).all()


@pytest.mark.gpu
def test_one_sequence_gradient_is_bitwise_run_to_run_on_the_gpu():
  """On a GPU the scatter's adds are atomic; with one sequence every id has one row to add,
  so the gradient is the same bits on every call (several sequences sharing an id: not)."""
  rng = np.random.default_rng(4)
  vocab, hidden = 1000, 256
  ids = jnp.asarray(np.minimum(rng.zipf(1.2, (1, 8192)), vocab) - 1, jnp.int32)
  cotangent = jnp.asarray(rng.standard_normal((1, 8192, hidden)), jnp.bfloat16)
  grad = jax.jit(lambda t, c: jax.vjp(lambda t: embedding_lookup(t, ids), t)[1](c)[0])
  table = jnp.zeros((vocab, hidden), jnp.bfloat16)
  first = grad(table, cotangent)
  for _ in range(5):
    np.testing.assert_array_equal(grad(table, cotangent), first)


def test_bfloat16_gradient_of_a_frequent_id_rounds_once():
  """A quarter of 4 x 4,096 tokens share one id (the byte corpus's spaces). Summed in float32
  per sequence, its bfloat16 gradient is within about one rounding of the exact sum (against
  ~10% error measured here from jnp.take's bfloat16 scatter-add on XLA:CPU)."""
  rng = np.random.default_rng(0)
  batch, seq, vocab, hidden = 4, 4096, 300, 64
  p = np.ones(256)
  p[32] = 300
  ids = jnp.asarray(rng.choice(256, (batch, seq), p=p / p.sum()), jnp.int32)
  cotangent = jnp.asarray(rng.standard_normal((batch, seq, hidden)) * 1e-3, jnp.bfloat16)
  exact = np.zeros((vocab, hidden))
  np.add.at(exact, np.asarray(ids).ravel(), np.asarray(cotangent, np.float64).reshape(-1, hidden))
  table = jnp.zeros((vocab, hidden), jnp.bfloat16)
  got = jax.jit(jax.vjp(lambda t: embedding_lookup(t, ids), table)[1])(cotangent)[0]
  assert got.dtype == jnp.bfloat16
  err = np.abs(np.asarray(got, np.float64) - exact)
  assert err[32].max() <= 2 * 2.0 ** -8 * np.abs(exact[32]).max(), err[32].max()
  assert err.max() <= 2.0 ** -7 * np.abs(exact).max(), err.max()


def test_batch_sharded_over_eight_devices_matches_one_device():
  """Under jit with the batch sharded over 8 CPU devices (each sequence sorted on its own
  device), the same gradient as unsharded, with no more collectives than jnp.take's."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))  # as the example's
  rng = np.random.default_rng(1)
  vocab, hidden = 40, 8
  ids = jnp.asarray(np.minimum(rng.zipf(1.3, (8, 200)), vocab - 1), jnp.int32)
  table = jnp.asarray(rng.standard_normal((vocab, hidden)), jnp.float32)
  cotangent = jnp.asarray(rng.standard_normal((8, 200, hidden)), jnp.float32)
  grad = jax.jit(lambda t, i, c: jax.vjp(lambda t: embedding_lookup(t, i), t)[1](c)[0])
  sharded = grad(table, jax.device_put(ids, NamedSharding(mesh, P("data"))),
                 jax.device_put(cotangent, NamedSharding(mesh, P("data"))))
  np.testing.assert_allclose(sharded, grad(table, ids, cotangent), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(sharded, _take_grad(table, ids, cotangent), rtol=1e-5, atol=1e-5)
  # No cotangent or id gathered across devices: the same collectives as jnp.take's gradient.
  args = (table, jax.device_put(ids, NamedSharding(mesh, P("data"))),
          jax.device_put(cotangent, NamedSharding(mesh, P("data"))))

  def collectives(lookup):
    text = jax.jit(lambda t, i, c: jax.vjp(lambda t: lookup(t, i), t)[1](c)[0]).lower(
        *args).compile().as_text()
    return {op: text.count(f" {op}(") for op in ("all-gather", "all-reduce", "all-to-all",
                                                   "collective-permute", "reduce-scatter")}

  ours = collectives(embedding_lookup)
  assert ours["all-gather"] == 0 and ours == collectives(
      lambda t, i: jnp.take(t, i, axis=0)), ours


def test_model_embedding_gradient_matches_nnx_embed(monkeypatch):
  """Qwen3Moe's embedding (tiny config, float32) goes through embedding_lookup, and the loss and
  every gradient are those of the model with nnx.Embed's own call in its place."""
  from jax_megamoe.models import Qwen3Moe, get_config, qwen3
  model = Qwen3Moe(get_config("tiny"), rngs=nnx.Rngs(0), dtype=jnp.float32, backend="reference")
  graphdef, params = nnx.split(model, nnx.Param)
  ids = jnp.asarray(np.random.default_rng(2).integers(0, 64, (2, 33)), jnp.int32)

  calls = []
  monkeypatch.setattr(qwen3, "embedding_lookup",
                      lambda t, i: calls.append(1) or embedding_lookup(t, i))

  def loss(p, nnx_embed=False):
    m = nnx.merge(graphdef, p)
    if nnx_embed:  # nnx.Embed's own call (promote_dtype, jnp.take) on the traced parameter
      monkeypatch.setattr(qwen3, "embedding_lookup", lambda t, i: m.embed(i))
    return jnp.mean(jnp.square(m(ids)))

  got_loss, got = jax.value_and_grad(loss)(params)
  assert calls, "Qwen3Moe did not call embedding_lookup"
  want_loss, want = jax.value_and_grad(functools.partial(loss, nnx_embed=True))(params)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("table_shape,ids,match", [
    ((10, 4), np.zeros((3,), np.int32), "ids must be an integer \\[batch, seq\\]"),
    ((10, 4), np.zeros((2, 3), np.float32), "ids must be an integer \\[batch, seq\\]"),
    ((10,), np.zeros((2, 3), np.int32), "table must be a float \\[vocab, hidden\\]")])
def test_errors_name_the_argument(table_shape, ids, match):
  with pytest.raises(ValueError, match=match):
    embedding_lookup(jnp.zeros(table_shape), jnp.asarray(ids))

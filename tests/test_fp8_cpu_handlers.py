"""The blockwise-FP8 ops of jax_megamoe.backends.cuda_fp8 through their CPU FFI handlers (the
same contracts as the CUDA ones): quantisation bit for bit against jax_megamoe.fp8 (rows,
weights for the forward and the dgrad, the group-blocked weight-gradient operands), the GEMMs on
quantised operands (forward/dgrad and the K-grouped wgrad) against the emulation, the fused
SwiGLU (and SwiGLU backward) + quantisation, FP8 rows read in place with a row stride, and the
FP8 MLP forward and gradients. Runs in CI; the CUDA twins run in tests/test_grouped_mlp_ffi.py
on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_megamoe import _ffi, fp8
from jax_megamoe.backends import cuda_fp8
from moe_oracles import rel_err

pytestmark = pytest.mark.skipif(
    not all(_ffi.has_target(t, "cpu") for t in cuda_fp8.TARGETS),
    reason="not run: the native extension (with the FP8 CPU handlers) is not built")

CPU = jax.devices("cpu")[0]


@pytest.fixture(autouse=True)
def _on_the_cpu():
  """These are tests of the CPU handlers: on a GPU machine too they run on the CPU (with the
  default device there, the CUDA kernels would run against CPU-exact expectations; their CUDA
  twins, with their own tolerances, are in tests/test_grouped_mlp_ffi.py)."""
  with jax.default_device(CPU):
    yield


def _rows(seed, n, k):
  """Rows of very different magnitudes (so block scales differ), a zero row, an e4m3-saturating
  outlier and a value in e4m3's subnormal range after scaling."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, k)) * np.exp(2 * rng.standard_normal((n, 1)))
  x[1] = 0.0
  x[2, 5] = 1e4
  x[3, :128] = np.linspace(-1, 1, 128) * 1e-3
  x[3, 7] = 1.0
  return jnp.asarray(x, jnp.bfloat16)


def _group_sizes(rng, e, total):
  cuts = np.sort(rng.integers(0, total + 1, size=e - 1))
  sizes = np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int32)
  sizes[0] = 0  # an empty expert
  sizes[-1] += total - sizes.sum()
  return jnp.asarray(sizes)


def _dequantized_rows(rows):
  return np.asarray(cuda_fp8.dequantize_rows(rows, jnp.float32))


def _bytes(q):
  return np.asarray(jax.lax.bitcast_convert_type(q, jnp.uint8))


def _spec(pow2):
  return fp8.get_recipe("fp8_pow2" if pow2 else "fp8")


# Weight-gradient groups: empty, one row, not a multiple of 128, exactly 128, more than two
# blocks, empty; the rows past their sum (WGRAD_PAD) are padding.
WGRAD_SIZES = [0, 1, 37, 128, 300, 0]
WGRAD_PAD = 9


def _wgrad_groups():
  """(group_sizes, row offsets o_g, padded column offsets p_g) of WGRAD_SIZES."""
  sizes = np.asarray(WGRAD_SIZES)
  rows = np.concatenate([[0], np.cumsum(sizes)])
  cols = np.concatenate([[0], np.cumsum(-(-sizes // 128) * 128)])
  return jnp.asarray(sizes, jnp.int32), rows, cols


def _wgrad_rows(seed, c):
  """_rows over WGRAD_SIZES' rows, with outliers in the padding rows that must not leak into
  the last group's blocks."""
  x = np.array(_rows(seed, sum(WGRAD_SIZES) + WGRAD_PAD, c).astype(jnp.float32))
  x[-WGRAD_PAD:] = 3e4
  return jnp.asarray(x, jnp.bfloat16)


def _dequantized_wgrad(op, columns):
  """WgradOperand -> float32 [C, columns]: column l scaled by scale[l // 128] (the columns past
  the groups' are unspecified, not read)."""
  q = np.asarray(op.q[:, :columns].astype(jnp.float32))
  return q * np.repeat(np.asarray(op.scale[:columns // 128]), 128, axis=0).T


@pytest.mark.parametrize("pow2", [False, True])
def test_quantize_rows_and_weights_bit_exact(pow2):
  spec = _spec(pow2)
  x = _rows(1, 37, 384)
  rows = jax.jit(lambda a: cuda_fp8.quantize_rows(a, pow2=pow2))(x)
  # An all-zero block must not give a NaN (a denormal scale flushed to 0 once made 0 / 0).
  assert np.all(np.isfinite(_dequantized_rows(rows))) and np.all(np.asarray(rows.scale) > 0)
  np.testing.assert_array_equal(_dequantized_rows(rows), np.asarray(fp8.quantize_activation(x, spec)))
  w = jnp.asarray(np.random.default_rng(2).standard_normal((3, 256, 384)) * 0.05, jnp.bfloat16)
  blocks = jax.jit(lambda a: cuda_fp8.quantize_weights(a, pow2=pow2))(w)
  assert blocks.q.shape == (3, 384, 256) and blocks.scale.shape == (3, 2, 3)
  deq = np.swapaxes(np.asarray(blocks.q.astype(jnp.float32)), 1, 2) * np.repeat(
      np.repeat(np.asarray(blocks.scale), 128, axis=1), 128, axis=2)
  np.testing.assert_array_equal(deq, np.asarray(fp8.quantize_weight(w, spec)))
  if pow2:
    s = np.asarray(rows.scale)
    assert np.all(np.exp2(np.round(np.log2(s))) == s)


def test_grouped_gemm_quantized_matches_emulation_and_reads_strided_rows():
  spec = fp8.get_recipe("fp8")
  rng = np.random.default_rng(3)
  n, k, p, e = 70, 256, 128, 4
  gs = _group_sizes(rng, e, 61)
  a = _rows(4, n, k)
  b = jnp.asarray(rng.standard_normal((e, k, p)) * 0.05, jnp.bfloat16)
  a_rows = cuda_fp8.quantize_rows(a)
  d = np.asarray(jax.jit(cuda_fp8.grouped_gemm_quantized)(a_rows, gs, cuda_fp8.quantize_weights(b))
                 .astype(jnp.float32))
  want = np.asarray(jax.lax.ragged_dot(fp8.quantize_activation(a, spec),
                                       fp8.quantize_weight(b, spec), gs,
                                       precision=jax.lax.Precision.HIGHEST))
  total = int(np.sum(np.asarray(gs)))
  assert np.all(d[total:] == 0)
  assert rel_err(d[:total], want[:total]) < 5e-3
  # The same rows packed as the EP dispatch moves them, read in place (row stride > K).
  strided = cuda_fp8.unpack_rows(cuda_fp8.pack_rows(a_rows), k)
  assert strided.q.shape[1] > k
  d_strided = jax.jit(cuda_fp8.grouped_gemm_quantized)(strided, gs, cuda_fp8.quantize_weights(b))
  np.testing.assert_array_equal(np.asarray(d_strided.astype(jnp.float32)), d)


@pytest.mark.parametrize("pow2", [False, True])
def test_swiglu_quantize_fuses_swiglu_and_row_quantisation(pow2):
  rng = np.random.default_rng(5)
  n, f, e = 50, 256, 3
  gs = _group_sizes(rng, e, 41)
  gate_up = jnp.asarray(rng.standard_normal((n, 2 * f)) * 2, jnp.bfloat16)
  h, rows = jax.jit(lambda g, s: cuda_fp8.swiglu_quantize(g, s, pow2=pow2))(gate_up, gs)
  total = int(np.sum(np.asarray(gs)))
  g32 = np.asarray(gate_up.astype(jnp.float32))
  want = (g32[:, :f] / (1 + np.exp(-g32[:, :f])) * g32[:, f:]).astype(np.float32)
  got = np.asarray(h.astype(jnp.float32))
  np.testing.assert_allclose(got[:total], want[:total], rtol=1e-2, atol=1e-6)
  assert np.all(got[total:] == 0)
  again = cuda_fp8.quantize_rows(h, pow2=pow2)
  np.testing.assert_array_equal(
      np.asarray(jax.lax.bitcast_convert_type(rows.q[:total], jnp.uint8)),
      np.asarray(jax.lax.bitcast_convert_type(again.q[:total], jnp.uint8)))
  np.testing.assert_array_equal(np.asarray(rows.scale[:total]), np.asarray(again.scale[:total]))


@pytest.mark.parametrize("pow2", [False, True])
def test_quantize_weights_dgrad_is_the_same_blocks_untransposed(pow2):
  w = jnp.asarray(np.random.default_rng(2).standard_normal((3, 256, 384)) * 0.05, jnp.bfloat16)
  fwd = cuda_fp8.quantize_weights(w, pow2=pow2)
  dgrad = jax.jit(lambda a: cuda_fp8.quantize_weights(a, pow2=pow2, dgrad=True))(w)
  assert dgrad.q.shape == (3, 256, 384) and dgrad.scale.shape == (3, 3, 2)
  # scale[g, pb, kb] is that of w's block (kb, pb).
  scale = np.swapaxes(np.repeat(np.repeat(np.asarray(dgrad.scale), 128, axis=1), 128, axis=2), 1, 2)
  deq = np.asarray(dgrad.q.astype(jnp.float32)) * scale
  np.testing.assert_array_equal(deq, np.asarray(fp8.quantize_weight(w, _spec(pow2))))
  np.testing.assert_array_equal(_bytes(dgrad.q), np.swapaxes(_bytes(fwd.q), 1, 2))
  np.testing.assert_array_equal(np.asarray(dgrad.scale), np.swapaxes(np.asarray(fwd.scale), 1, 2))
  # What the FP8 MLP's backward uses instead of quantising w again: the same bits.
  moved = cuda_fp8.dgrad_operand(fwd)
  np.testing.assert_array_equal(_bytes(moved.q), _bytes(dgrad.q))
  np.testing.assert_array_equal(np.asarray(moved.scale), np.asarray(dgrad.scale))


def test_fp8_mlp_step_quantises_each_weight_once():
  """Forward and backward of the FP8 MLP quantise each weight once (the backward's dgrad GEMMs
  read the forward's blocks transposed) and keep no bf16 weight for the backward."""
  n, hdim, f, e = 40, 128, 128, 2
  gs = jnp.asarray([25, 15], jnp.int32)
  args = (jnp.zeros((n, hdim), jnp.bfloat16), jnp.zeros((e, hdim, 2 * f), jnp.bfloat16),
          jnp.zeros((e, f, hdim), jnp.bfloat16))

  def loss(x, wgu, wd):
    return jnp.sum(cuda_fp8.grouped_mlp(x, gs, wgu, wd).astype(jnp.float32))

  text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*args))
  assert text.count(cuda_fp8.QUANTIZE_WEIGHTS_TARGET) == 2, text.count(
      cuda_fp8.QUANTIZE_WEIGHTS_TARGET)
  blocks = cuda_fp8.quantize_expert_weights(args[1], args[2])
  residuals = jax.tree.leaves(cuda_fp8._grouped_mlp_fwd(args[0], gs, args[1], args[2], blocks,
                                                        False)[1])
  assert not any(r.shape in (args[1].shape, args[2].shape) and r.dtype == jnp.bfloat16
                 for r in residuals)


@pytest.mark.parametrize("remat, quantisations", [("full", 2), ("nothing_saveable", 4)])
def test_fp8_mlp_under_remat_quantises_each_weight_once_with_the_models_policies(
    remat, quantisations):
  """A rematerialised FP8 MLP under the models' remat policy ("full", which saves the named
  weight blocks: fp8.QUANTIZED_WEIGHTS_NAME) quantises each weight once per step, where plain
  nothing_saveable quantises it again in the recomputed forward; the gradients are the same
  bit for bit (the same blocks), and as without remat."""
  from jax_megamoe.models import REMAT_POLICIES
  rng = np.random.default_rng(8)
  n, hdim, f, e = 40, 128, 128, 2
  gs = jnp.asarray([25, 15], jnp.int32)
  args = (jnp.asarray(rng.standard_normal((n, hdim)), jnp.bfloat16),
          jnp.asarray(rng.standard_normal((e, hdim, 2 * f)) / 11, jnp.bfloat16),
          jnp.asarray(rng.standard_normal((e, f, hdim)) / 11, jnp.bfloat16))
  policy = (REMAT_POLICIES[remat] if remat in REMAT_POLICIES
            else getattr(jax.checkpoint_policies, remat))

  def loss(x, wgu, wd):
    return jnp.sum(cuda_fp8.grouped_mlp(jnp.sin(x), gs, wgu, wd).astype(jnp.float32) ** 2)

  step = jax.grad(jax.checkpoint(loss, policy=policy), argnums=(0, 1, 2))
  text = str(jax.make_jaxpr(step)(*args))
  assert text.count(cuda_fp8.QUANTIZE_WEIGHTS_TARGET) == quantisations
  got = jax.jit(step)(*args)
  want = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("pow2", [False, True])
def test_quantize_wgrad_operand_blocks_rows_inside_groups(pow2):
  gs, rows, cols = _wgrad_groups()
  x = _wgrad_rows(7, 256)
  op = jax.jit(lambda a, s: cuda_fp8.quantize_wgrad_operand(a, s, pow2=pow2))(x, gs)
  length = cuda_fp8.padded_length(x.shape[0], gs.shape[0])
  assert op.q.shape == (256, length) and op.scale.shape == (length // 128, 256)
  deq, q = _dequantized_wgrad(op, cols[-1]), _bytes(op.q)
  want = np.asarray(fp8.quantize_grouped_rows(x, gs, _spec(pow2)))
  for g, n in enumerate(WGRAD_SIZES):
    np.testing.assert_array_equal(deq[:, cols[g]:cols[g] + n].T, want[rows[g]:rows[g] + n])
    assert np.all(q[:, cols[g] + n:cols[g + 1]] == 0), f"group {g}'s padding columns"
  used = np.asarray(op.scale)[:cols[-1] // 128]
  assert np.all(used > 0)
  if pow2:
    assert np.all(np.exp2(np.round(np.log2(used))) == used)
  # with_rows: the same operand, plus x's 1x128 rows as quantize_rows makes them.
  rows_q, op2 = jax.jit(lambda a, s: cuda_fp8.quantize_wgrad_operand(a, s, pow2=pow2,
                                                                     with_rows=True))(x, gs)
  np.testing.assert_array_equal(_bytes(op2.q[:, :cols[-1]]), q[:, :cols[-1]])
  alone = cuda_fp8.quantize_rows(x, pow2=pow2)
  valid = rows[-1]
  np.testing.assert_array_equal(_bytes(rows_q.q[:valid]), _bytes(alone.q[:valid]))
  np.testing.assert_array_equal(np.asarray(rows_q.scale[:valid]), np.asarray(alone.scale[:valid]))


def _gather_rows(x, source):
  """x's rows by source (zeros where source < 0), stored: what quantize_wgrad_operand(source=)
  reads without storing."""
  return jnp.where((source >= 0)[:, None], jnp.take(x, jnp.maximum(source, 0), axis=0),
                   jnp.zeros((), x.dtype))


def _assert_same_operand(got, want, columns, label):
  np.testing.assert_array_equal(_bytes(got.q[:, :columns]), _bytes(want.q[:, :columns]),
                                err_msg=label)
  np.testing.assert_array_equal(np.asarray(got.scale[:columns // 128]),
                                np.asarray(want.scale[:columns // 128]), err_msg=label)


@pytest.mark.parametrize("pow2", [False, True])
def test_wgrad_operand_of_gathered_rows_is_that_of_the_rows_stored(pow2):
  """source: row r of the operand is x[source[r]] (zeros where -1), bit for bit the operand of
  those rows stored, with_rows too; x has fewer rows than the operand, tokens repeat."""
  gs, rows, cols = _wgrad_groups()
  n = rows[-1] + WGRAD_PAD
  x = _rows(21, 150, 256)
  rng = np.random.default_rng(22)
  source = rng.integers(0, 150, size=n).astype(np.int32)
  source[rng.random(n) < 0.2] = -1
  source[rows[2]] = -1  # a whole one-row group of zeros
  source = jnp.asarray(source)
  call = jax.jit(lambda a, src, s: cuda_fp8.quantize_wgrad_operand(
      a, s, pow2=pow2, with_rows=True, source=src))
  got_rows, got = call(x, source, gs)
  want_rows, want = cuda_fp8.quantize_wgrad_operand(_gather_rows(x, source), gs, pow2=pow2,
                                                    with_rows=True)
  _assert_same_operand(got, want, cols[-1], "gathered")
  valid = rows[-1]
  np.testing.assert_array_equal(_bytes(got_rows.q[:valid]), _bytes(want_rows.q[:valid]))
  np.testing.assert_array_equal(np.asarray(got_rows.scale[:valid]),
                                np.asarray(want_rows.scale[:valid]))


@pytest.mark.parametrize("pow2", [False, True])
def test_swiglu_wgrad_operand_is_that_of_h(pow2):
  """swiglu_wgrad_operand(gate_up) is bit for bit quantize_wgrad_operand of swiglu_quantize's
  h, which it never stores."""
  gs, rows, cols = _wgrad_groups()
  n, f = rows[-1] + WGRAD_PAD, 256
  gate_up = _rows(23, n, 2 * f)
  got = jax.jit(lambda g, s: cuda_fp8.swiglu_wgrad_operand(g, s, pow2=pow2))(gate_up, gs)
  h, _ = cuda_fp8.swiglu_quantize(gate_up, gs, pow2=pow2)
  assert got.q.shape == (f, cuda_fp8.padded_length(n, gs.shape[0]))
  _assert_same_operand(got, cuda_fp8.quantize_wgrad_operand(h, gs, pow2=pow2), cols[-1], "h")


@pytest.mark.parametrize("pow2", [False, True])
def test_wgrad_operand_of_fp8_rows_is_that_of_their_dequantised_rows(pow2):
  """x a QuantizedRows, read as dispatched (q with a row stride: the packed rows carry their
  scales after the values): bit for bit the operand of dequantize_rows(x) stored, with_rows too."""
  gs, rows, cols = _wgrad_groups()
  n = rows[-1] + WGRAD_PAD
  packed = cuda_fp8.pack_rows(cuda_fp8.quantize_rows(_rows(25, n, 256), pow2=pow2))
  fp8_rows = cuda_fp8.unpack_rows(packed, 256)
  assert fp8_rows.q.shape[1] > 256  # read with a stride
  call = jax.jit(lambda r, s: cuda_fp8.quantize_wgrad_operand(r, s, pow2=pow2, with_rows=True))
  got_rows, got = call(fp8_rows, gs)
  want_rows, want = cuda_fp8.quantize_wgrad_operand(cuda_fp8.dequantize_rows(fp8_rows), gs,
                                                    pow2=pow2, with_rows=True)
  _assert_same_operand(got, want, cols[-1], "dequantised")
  valid = rows[-1]
  np.testing.assert_array_equal(_bytes(got_rows.q[:valid]), _bytes(want_rows.q[:valid]))
  np.testing.assert_array_equal(np.asarray(got_rows.scale[:valid]),
                                np.asarray(want_rows.scale[:valid]))


def test_wgrad_operand_sources_name_the_bad_argument():
  gs, rows, _ = _wgrad_groups()
  x = _wgrad_rows(24, 128)
  n = x.shape[0]
  with pytest.raises(ValueError, match=r"source must be \[N\] int32, got \(\d+,\) float32"):
    cuda_fp8.quantize_wgrad_operand(x, gs, source=jnp.zeros((n,), jnp.float32))
  with pytest.raises(ValueError, match=r"source must be \[N\] int32, got \(\d+, 1\) int32"):
    cuda_fp8.quantize_wgrad_operand(x, gs, source=jnp.zeros((n, 1), jnp.int32))
  with pytest.raises(Exception, match=rf"source\[3\] = {n} is past x's {n} rows"):
    jax.block_until_ready(cuda_fp8.quantize_wgrad_operand(
        x, gs, source=jnp.arange(n, dtype=jnp.int32).at[3].set(n)))
  with pytest.raises(ValueError, match=r"gate_up must be \[N, 2F\] with F a multiple of 128"):
    cuda_fp8.swiglu_wgrad_operand(x, gs)
  fp8_rows = cuda_fp8.quantize_rows(x)
  with pytest.raises(ValueError, match=r"source gathers bf16 rows; x is a QuantizedRows"):
    cuda_fp8.quantize_wgrad_operand(fp8_rows, gs, source=jnp.zeros((n,), jnp.int32))
  with pytest.raises(Exception, match=rf"x_scale must be \[N={n}, C/128\] with C <= 128"):
    jax.block_until_ready(cuda_fp8.quantize_wgrad_operand(
        cuda_fp8.QuantizedRows(fp8_rows.q, jnp.ones((n, 2), jnp.float32)), gs))


@pytest.mark.parametrize("pow2", [False, True])
def test_swiglu_backward_quantize_gives_dgate_up_both_ways(pow2):
  """dgate_up (never stored) as 1x128 rows and as a wgrad operand: close to the SwiGLU's vjp
  (e4m3 rounding), and bit for bit quantize_wgrad_operand(dgate_up, with_rows=True) where
  dgate_up is exact (gate = 0: sigmoid 1/2, so dgate = dh * up / 2 and dup = 0)."""
  gs, rows, cols = _wgrad_groups()
  n, f = rows[-1] + WGRAD_PAD, 128
  rng = np.random.default_rng(8)
  dh = jnp.asarray(rng.standard_normal((n, f)), jnp.bfloat16)
  gate_up = jnp.asarray(rng.standard_normal((n, 2 * f)) * 2, jnp.bfloat16)
  call = jax.jit(lambda d, g, s: cuda_fp8.swiglu_backward_quantize(d, g, s, pow2=pow2))
  got_rows, got_op = call(dh, gate_up, gs)
  f32 = lambda a: a.astype(jnp.float32)
  _, vjp = jax.vjp(lambda gu: jax.nn.silu(gu[:, :f]) * gu[:, f:], f32(gate_up))
  want = np.asarray(vjp(f32(dh))[0])[:rows[-1]]
  rel = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b)
  assert rel(_dequantized_rows(got_rows)[:rows[-1]], want) < 4e-2
  deq = _dequantized_wgrad(got_op, cols[-1])
  by_rows = np.concatenate([deq[:, cols[g]:cols[g] + m].T for g, m in enumerate(WGRAD_SIZES)])
  assert rel(by_rows, want) < 4e-2

  gate_up0 = gate_up.at[:, :f].set(0)
  d, g, u = f32(dh), f32(gate_up0[:, :f]), f32(gate_up0[:, f:])
  exact = jnp.concatenate([d * u / 2, d * g / 2], axis=1).astype(jnp.bfloat16)  # -0 where d < 0
  got_rows, got_op = call(dh, gate_up0, gs)
  want_rows, want_op = cuda_fp8.quantize_wgrad_operand(exact, gs, pow2=pow2, with_rows=True)
  valid = rows[-1]
  np.testing.assert_array_equal(_bytes(got_rows.q[:valid]), _bytes(want_rows.q[:valid]))
  np.testing.assert_array_equal(np.asarray(got_rows.scale[:valid]),
                                np.asarray(want_rows.scale[:valid]))
  np.testing.assert_array_equal(_bytes(got_op.q[:, :cols[-1]]), _bytes(want_op.q[:, :cols[-1]]))
  np.testing.assert_array_equal(np.asarray(got_op.scale[:cols[-1] // 128]),
                                np.asarray(want_op.scale[:cols[-1] // 128]))


def _assert_bf16_close(got, want, label, rtol=2 ** -8):
  """got (bf16) is want rounded to bf16 (half an ulp: 2^-8 relative), give or take fp32
  summation order (a little absolute, where terms cancel)."""
  np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-5 * np.max(np.abs(want)),
                             err_msg=label)


def test_grouped_wgrad_quantized_is_the_product_of_the_dequantised_operands():
  gs, _, cols = _wgrad_groups()
  a = cuda_fp8.quantize_wgrad_operand(_wgrad_rows(9, 128), gs)
  b = cuda_fp8.quantize_wgrad_operand(_wgrad_rows(10, 256), gs)
  d = np.asarray(jax.jit(cuda_fp8.grouped_wgrad_quantized)(a, gs, b).astype(jnp.float32))
  assert d.shape == (len(WGRAD_SIZES), 128, 256)
  da, db = (_dequantized_wgrad(o, cols[-1]).astype(np.float64) for o in (a, b))
  for g, n in enumerate(WGRAD_SIZES):
    if n == 0:
      assert np.all(d[g] == 0), f"empty group {g}"
    else:
      span = slice(cols[g], cols[g] + n)
      _assert_bf16_close(d[g], da[:, span] @ db[:, span].T, f"group {g}")


@pytest.mark.parametrize("recipe", ["fp8", "fp8_pow2"])
def test_wgrad_ops_give_the_emulated_weight_gradient(recipe):
  """quantize_wgrad_operand + grouped_wgrad_quantized = dw of fp8.ragged_dot's backward."""
  spec, pow2 = fp8.get_recipe(recipe), recipe == "fp8_pow2"
  gs, _, _ = _wgrad_groups()
  x, dy = _wgrad_rows(11, 128), _wgrad_rows(12, 256)
  w = jnp.zeros((len(WGRAD_SIZES), 128, 256), jnp.bfloat16)  # dw in bf16 too
  _, vjp = jax.vjp(lambda w: fp8.ragged_dot(x, w, gs, spec), w)
  want = np.asarray(vjp(dy.astype(jnp.float32))[0].astype(jnp.float32))
  operand = lambda a: cuda_fp8.quantize_wgrad_operand(a, gs, pow2=pow2)
  got = np.asarray(cuda_fp8.grouped_wgrad_quantized(operand(x), gs, operand(dy))
                   .astype(jnp.float32))
  # Both rounded to bf16 (0.02% of them a different way: fp32 sums in another order): 1 ulp.
  _assert_bf16_close(got, want, recipe, rtol=2 ** -7)
  assert np.all(got[[0, 5]] == 0)


def test_grouped_wgrad_rejects_a_bad_scale_shape_by_name():
  gs, _, _ = _wgrad_groups()
  a = cuda_fp8.quantize_wgrad_operand(_wgrad_rows(13, 128), gs)
  bad = cuda_fp8.WgradOperand(a.q, a.scale[:-1])
  with pytest.raises(Exception, match=r"a_scale has shape \[\d+, 128\], expected"):
    jax.block_until_ready(cuda_fp8.grouped_wgrad_quantized(bad, gs, a))


def test_backward_wrappers_name_the_bad_argument():
  gs, _, _ = _wgrad_groups()
  x = _wgrad_rows(14, 128)
  with pytest.raises(ValueError, match=r"group_sizes must be \[E\] int32.*float32"):
    cuda_fp8.quantize_wgrad_operand(x, gs.astype(jnp.float32))
  with pytest.raises(ValueError, match=r"x axis 1 must be a multiple of 128.*\(\d+, 96\)"):
    cuda_fp8.quantize_wgrad_operand(x[:, :96], gs)
  with pytest.raises(ValueError, match=r"gate_up must be \[N=\d+, 2F=256\], got \(\d+, 384\)"):
    cuda_fp8.swiglu_backward_quantize(x, jnp.zeros((x.shape[0], 384), jnp.bfloat16), gs)


@pytest.mark.parametrize("recipe", ["fp8", "fp8_pow2"])
def test_fp8_mlp_forward_and_gradients_match_the_recipe(recipe):
  """cuda_fp8.grouped_mlp (CPU handlers: FP8 forward, and cuda_fp8.mlp_backward, every
  backward GEMM in FP8 too) against the recipe's definition (fp8.ragged_dot, forward and
  backward). The oracle stores gate_up in bf16 as the module does (and so rounds its gradient to
  bf16): with gate_up kept in fp32 instead, the two differ by 1-2e-2 (e4m3 roundings flipped by
  a bf16 ulp), too close to FP8's own error (~6e-2 from bf16) for the check to mean much; with
  it they agree to < 1e-4 (fp32 summation order; y bit for bit)."""
  spec = fp8.get_recipe(recipe)
  rng = np.random.default_rng(6)
  n, hdim, f, e = 60, 256, 128, 4
  gs = _group_sizes(rng, e, 53)
  x = jnp.asarray(rng.standard_normal((n, hdim)), jnp.bfloat16)
  wgu = jnp.asarray(rng.standard_normal((e, hdim, 2 * f)) / 16, jnp.bfloat16)
  wd = jnp.asarray(rng.standard_normal((e, f, hdim)) / 11, jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((n, hdim)), jnp.bfloat16)

  def oracle(x, wgu, wd):
    gu = fp8.ragged_dot(x, wgu, gs, spec).astype(x.dtype).astype(jnp.float32)
    hid = (jax.nn.silu(gu[:, :f]) * gu[:, f:]).astype(x.dtype)
    y = fp8.ragged_dot(hid, wd, gs, spec)
    return jnp.where((jnp.arange(n) < jnp.sum(gs))[:, None], y, 0.0).astype(x.dtype)

  def ours(x, wgu, wd):
    return cuda_fp8.grouped_mlp(x, gs, wgu, wd, pow2=recipe == "fp8_pow2")

  results = {}
  for name, fn in (("ours", ours), ("oracle", oracle)):
    y, vjp = jax.vjp(fn, x, wgu, wd)
    results[name] = (y, *vjp(dy))
  f32 = lambda a: np.asarray(a.astype(jnp.float32))
  for label, a, b in zip(("y", "dx", "dw_gate_up", "dw_down"), results["ours"], results["oracle"]):
    assert rel_err(f32(a), f32(b)) < 1e-3, label
  total = int(np.sum(np.asarray(gs)))
  assert np.all(f32(results["ours"][0])[total:] == 0)

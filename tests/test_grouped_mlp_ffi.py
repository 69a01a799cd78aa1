"""The grouped SwiGLU MLP through the FFI handlers against the pure-JAX reference.

CPU tests reach the CPU handler (same contract, plain loops) through jax.ffi.ffi_call; GPU tests
(marked gpu, skipped with a reason without the CUDA build and an sm_90 GPU) run the CUDA kernels.
Inputs are fresh random values (never zeros); group sizes include 0 and sizes that are not a
multiple of any tile; padding rows must come back exactly 0 and every valid row finite.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_megamoe as jm
from jax_megamoe import _ffi
from jax_megamoe.backends import cuda, cuda_bf16, cuda_fp8, reference

pytestmark = pytest.mark.skipif(
    not _ffi.has_target(cuda_bf16.FWD_TARGET, "cpu"),
    reason="not run: the native extension (with the grouped MLP CPU handler) is not built")


def rel_err(a, b) -> float:
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def random_group_sizes(rng, e: int, total: int) -> np.ndarray:
  """`total` rows over `e` groups, at least one group empty when e > 1, random otherwise."""
  cuts = np.sort(rng.integers(0, total + 1, size=e - 1))
  sizes = np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int32)
  if e > 1 and (sizes == 0).sum() == 0:
    g = int(rng.integers(0, e))
    other = (g + 1) % e
    sizes[other] += sizes[g]
    sizes[g] = 0
  return sizes


def make_inputs(seed: int, n: int, h: int, f: int, e: int, valid: int, dtype):
  rng = np.random.default_rng(seed)
  sizes = random_group_sizes(rng, e, valid)
  x = rng.standard_normal((n, h), np.float32)
  wgu = rng.standard_normal((e, h, 2 * f), np.float32) / np.sqrt(h)
  wd = rng.standard_normal((e, f, h), np.float32) / np.sqrt(f)
  dy = rng.standard_normal((n, h), np.float32)
  cast = lambda a: jnp.asarray(a, dtype)
  return cast(x), jnp.asarray(sizes), cast(wgu), cast(wd), cast(dy)


def loss_and_grads(fn, x, gs, wgu, wd, dy):
  def loss(x, wgu, wd):
    y = fn(x, gs, wgu, wd)
    return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y
  (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(x, wgu, wd)
  return y, grads


def check_against_reference(fn, x, gs, wgu, wd, dy, tol):
  y, (dx, dwgu, dwd) = loss_and_grads(fn, x, gs, wgu, wd, dy)
  # The oracle in float32 (same operands, upcast): the kernel's rounding is what is measured.
  f32 = lambda a: a.astype(jnp.float32)
  y_ref, (dx_ref, dwgu_ref, dwd_ref) = loss_and_grads(
      reference.grouped_mlp, f32(x), gs, f32(wgu), f32(wd), f32(dy))
  total = int(np.sum(np.asarray(gs)))
  y = np.asarray(y.astype(jnp.float32))
  assert y.dtype == np.float32
  assert np.all(y[total:] == 0.0), "padding rows of y must be exactly zero"
  assert np.all(np.isfinite(y[:total])), "every valid row of y must be finite"
  dx = np.asarray(dx.astype(jnp.float32))
  assert np.all(dx[total:] == 0.0), "padding rows of dx must be exactly zero"
  errs = {
      "y": rel_err(y[:total], np.asarray(y_ref)[:total]),
      "dx": rel_err(dx, dx_ref),
      "dw_gate_up": rel_err(dwgu.astype(jnp.float32), dwgu_ref),
      "dw_down": rel_err(dwd.astype(jnp.float32), dwd_ref),
  }
  for name, err in errs.items():
    assert err < tol, f"{name}: relative error {err:.3g} >= {tol} (all: {errs})"
  sizes = np.asarray(gs)
  for g in np.flatnonzero(sizes == 0):
    assert np.all(np.asarray(dwgu[g]) == 0), f"empty expert {g}: dw_gate_up must be written 0"
    assert np.all(np.asarray(dwd[g]) == 0), f"empty expert {g}: dw_down must be written 0"
  return errs


# ----------------------------------------------------------------------------------------------
# CPU handler (CI): the binding and the contract.

@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("seed", [0, 1])
def test_cpu_handler_matches_reference(dtype, tol, seed):
  with jax.default_device(jax.devices("cpu")[0]):
    x, gs, wgu, wd, dy = make_inputs(seed, n=37, h=16, f=24, e=5, valid=29, dtype=dtype)
    check_against_reference(cuda_bf16.grouped_mlp, x, gs, wgu, wd, dy, tol)


def test_cpu_handler_one_row_and_all_padding():
  with jax.default_device(jax.devices("cpu")[0]):
    x, _, wgu, wd, dy = make_inputs(3, n=4, h=8, f=8, e=3, valid=1, dtype=jnp.float32)
    gs = jnp.asarray([0, 1, 0], jnp.int32)
    check_against_reference(cuda_bf16.grouped_mlp, x, gs, wgu, wd, dy, 1e-5)
    gs = jnp.zeros((3,), jnp.int32)
    y = cuda_bf16.grouped_mlp(x, gs, wgu, wd)
    assert np.all(np.asarray(y) == 0)


def test_cpu_handler_rejects_bad_shapes_by_name():
  with jax.default_device(jax.devices("cpu")[0]):
    x, gs, wgu, wd, _ = make_inputs(4, n=8, h=8, f=8, e=2, valid=8, dtype=jnp.float32)
    with pytest.raises(ValueError, match="w_down"):
      cuda_bf16.grouped_mlp(x, gs, wgu, wd[:, :4])
    with pytest.raises(ValueError, match="group_sizes"):
      cuda_bf16.grouped_mlp(x, gs.astype(jnp.float32), wgu, wd)


@pytest.mark.parametrize("weights_sharded", [True, False])
def test_cpu_handler_inside_shard_map_gradients(weights_sharded):
  """The custom_vjp inside shard_map: ffi_call results get the operands' varying-axes type, and
  a replicated weight's gradient is summed over the devices (as the reference's is)."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  cpus = jax.devices("cpu")[:2]
  mesh = jax.make_mesh((2,), ("e",), devices=cpus)
  x, _, wgu, wd, _ = make_inputs(8, 32, 16, 8, 4, 30, jnp.float32)
  gs = jnp.asarray([4, 0, 11, 3], jnp.int32)
  sharded = NamedSharding(mesh, P("e"))
  x, gs = jax.device_put(x, sharded), jax.device_put(gs, sharded)
  w_spec = P("e") if weights_sharded else P()
  if not weights_sharded:
    wgu, wd = wgu[:2], wd[:2]
  wgu, wd = jax.device_put(wgu, NamedSharding(mesh, w_spec)), jax.device_put(wd, NamedSharding(mesh, w_spec))

  def grads(mlp):
    f = jax.shard_map(mlp, mesh=mesh, in_specs=(P("e"), P("e"), w_spec, w_spec),
                      out_specs=P("e"))
    loss = lambda x, wgu, wd: jnp.sum(f(x, gs, wgu, wd) ** 2)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, wgu, wd)

  for a, b in zip(grads(cuda_bf16.grouped_mlp), grads(reference.grouped_mlp)):
    assert rel_err(a, b) < 1e-5


def test_launch_counts_name_the_dgrad_core_and_the_cpu_handler_does_not_count():
  x, gs, wgu, wd, dy = make_inputs(3, 40, 256, 256, 4, 33, jnp.float32)
  before = _ffi.launch_counts()
  assert set(before) == {"moe_dgrad_core", "fused_l2_rows_by_tma", "fused_l1_n_major"}, before
  assert all(isinstance(v, int) and v >= 0 for v in before.values()), before
  with jax.default_device(jax.devices("cpu")[0]):
    loss_and_grads(cuda_bf16.grouped_mlp, x, gs, wgu, wd, dy)
  assert _ffi.launch_counts() == before


def test_cuda_backend_reason_is_stated():
  reason = cuda.unavailable_reason("fp8")
  if reason is None:  # a GPU with the CUDA build: the only place the fp8 path may run
    assert jm.cuda_available()
  else:
    assert "fp8" in reason or "GPU" in reason or "CUDA" in reason or "built" in reason


# ----------------------------------------------------------------------------------------------
# CUDA kernels (device).

def poison_device_memory(nbytes: int):
  """Fills and frees device memory with NaN so that unwritten outputs that reuse it show up."""
  junk = [jnp.full((nbytes // 4,), jnp.nan, jnp.float32) for _ in range(4)]
  jax.block_until_ready(junk)
  del junk


GPU_CASES = [
    # n, h, f, e, valid
    (1000, 256, 384, 8, 937),     # sizes not a multiple of any tile, padding rows
    (4096, 512, 256, 16, 4096),   # no padding, many groups (one empty)
    (1, 128, 128, 4, 1),          # one row
    (300, 384, 192, 1, 200),      # one group
    (3000, 256, 128, 64, 2900),   # 64 groups: the wgrad default switches to the ping-pong tiles
    # H and F multiples of 256: the backward's dgrads on the tile engine's dgrad core
    # (ffi/heuristics/moe_dgrad_core.h); the second case above is one too.
    (1000, 512, 256, 8, 937),
    (1, 256, 256, 4, 1),
    (3000, 256, 512, 64, 2900),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES)
def test_cuda_matches_reference_bf16(case):
  n, h, f, e, valid = case
  x, gs, wgu, wd, dy = make_inputs(hash(case) % 1000, n, h, f, e, valid, jnp.bfloat16)
  poison_device_memory(64 << 20)
  before = dgrad_core_launches()
  errs = check_against_reference(cuda.grouped_mlp, x, gs, wgu, wd, dy, 1e-2)
  print(case, errs)
  if "MEGAMOE_DGRAD_CORE" not in os.environ:  # the default path, so the test names which ran
    assert (dgrad_core_launches() > before) == takes_dgrad_core(h, f), (
        f"dgrad core launched: {dgrad_core_launches() - before}, expected by the rule: "
        f"{takes_dgrad_core(h, f)}")


@pytest.mark.gpu
def test_cuda_all_padding_and_empty_experts():
  x, _, wgu, wd, dy = make_inputs(7, 64, 128, 128, 4, 64, jnp.bfloat16)
  gs = jnp.zeros((4,), jnp.int32)
  poison_device_memory(16 << 20)
  y, (dx, dwgu, dwd) = loss_and_grads(cuda.grouped_mlp, x, gs, wgu, wd, dy)
  for a in (y, dx, dwgu, dwd):
    assert np.all(np.asarray(a.astype(jnp.float32)) == 0)


@pytest.mark.gpu
def test_cuda_bitwise_deterministic():
  x, gs, wgu, wd, dy = make_inputs(11, 2048, 512, 384, 8, 1999, jnp.bfloat16)
  first = loss_and_grads(cuda.grouped_mlp, x, gs, wgu, wd, dy)
  poison_device_memory(64 << 20)
  second = loss_and_grads(cuda.grouped_mlp, x, gs, wgu, wd, dy)
  for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                  np.asarray(b.astype(jnp.float32)))


def dgrad_core_launches() -> int:
  return _ffi.launch_counts()["moe_dgrad_core"]


def takes_dgrad_core(h: int, f: int) -> bool:
  """ffi/heuristics/moe_dgrad_core.h's default: H, F multiples of 256, w_gate_up <= 16 MiB."""
  return h % 256 == 0 and f % 256 == 0 and 2 * f * h * 2 <= 16 << 20


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(1000, 512, 256, 8, 937), (2500, 768, 512, 16, 2311)])
def test_cuda_dgrad_core_against_the_cutlass_path(case, monkeypatch):
  """The backward with its dgrads on the tile engine's dgrad core (MEGAMOE_DGRAD_CORE=1) and on
  CUTLASS + the SwiGLU-backward kernel (=0): the launch count says which path each took, both
  are within the reference's tolerance, the core is bitwise run to run, and the gradients are
  bit for bit those of the CUTLASS path: both GEMMs run the same wgmma (m64n256k16, A and B
  K-major) over K in the same order with the same bf16 rounding, and the SwiGLU backward is the
  same math (the harness checks it bit for bit). Each path starts from cleared caches, so that
  the handler runs (XLA may replay a recorded CUDA graph without it). A bad value is refused."""
  n, h, f, e, valid = case
  x, gs, wgu, wd, dy = make_inputs(hash(case) % 1000, n, h, f, e, valid, jnp.bfloat16)
  grads = {}
  for core in ("1", "0"):
    monkeypatch.setenv("MEGAMOE_DGRAD_CORE", core)
    jax.clear_caches()
    poison_device_memory(64 << 20)
    before = dgrad_core_launches()
    errs = check_against_reference(cuda.grouped_mlp, x, gs, wgu, wd, dy, 1e-2)
    print(case, "core" if core == "1" else "cutlass", errs)
    grads[core] = loss_and_grads(cuda.grouped_mlp, x, gs, wgu, wd, dy)[1]
    launched = dgrad_core_launches() - before
    if core == "1":
      assert launched >= 1, "MEGAMOE_DGRAD_CORE=1 did not launch the dgrad core"
    else:
      assert launched == 0, f"MEGAMOE_DGRAD_CORE=0 launched the dgrad core {launched} times"
  monkeypatch.setenv("MEGAMOE_DGRAD_CORE", "1")
  jax.clear_caches()
  poison_device_memory(64 << 20)
  again = loss_and_grads(cuda.grouped_mlp, x, gs, wgu, wd, dy)[1]
  f32 = lambda a: np.asarray(a.astype(jnp.float32))
  for a, b in zip(grads["1"], again):
    np.testing.assert_array_equal(f32(a), f32(b))
  for name, a, b in zip(("dx", "dw_gate_up", "dw_down"), grads["1"], grads["0"]):
    differ = int(np.sum(f32(a).view(np.uint32) != f32(b).view(np.uint32)))
    assert differ == 0, f"{name}: {differ} elements differ between the dgrad core and CUTLASS"
  monkeypatch.setenv("MEGAMOE_DGRAD_CORE", "yes")  # a bad value is refused by name
  jax.clear_caches()
  with pytest.raises(Exception, match=r"MEGAMOE_DGRAD_CORE must be 0 or 1"):
    jax.block_until_ready(loss_and_grads(cuda.grouped_mlp, x, gs, wgu, wd, dy))


@pytest.mark.gpu
def test_cuda_float32_falls_back_to_reference():
  x, gs, wgu, wd, dy = make_inputs(5, 64, 64, 64, 4, 50, jnp.float32)
  errs = check_against_reference(cuda.grouped_mlp, x, gs, wgu, wd, dy, 1e-5)
  print(errs)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", [0, 1, 2])
def test_cuda_grouped_gemm_kinds(kind):
  """Each grouped GEMM on its own (the blocks the fused kernel reuses)."""
  rng = np.random.default_rng(20 + kind)
  n, k, p, e = 777, 256, 384, 6
  sizes = random_group_sizes(rng, e, 700)
  gs = jnp.asarray(sizes)
  a = jnp.asarray(rng.standard_normal((n, k)), jnp.bfloat16)
  if kind == 0:
    b = jnp.asarray(rng.standard_normal((e, k, p)), jnp.bfloat16)
    ref = jax.lax.ragged_dot(a.astype(jnp.float32), b.astype(jnp.float32), gs)
  elif kind == 1:
    b = jnp.asarray(rng.standard_normal((e, p, k)), jnp.bfloat16)
    ref = jax.lax.ragged_dot(a.astype(jnp.float32), jnp.swapaxes(b, 1, 2).astype(jnp.float32), gs)
  else:
    b = jnp.asarray(rng.standard_normal((n, p)), jnp.bfloat16)
    offs = np.concatenate([[0], np.cumsum(sizes)])
    a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
    ref = np.stack([a32[offs[g]:offs[g + 1]].T @ b32[offs[g]:offs[g + 1]] for g in range(e)])
  poison_device_memory(16 << 20)
  d = cuda_bf16.grouped_gemm(a, gs, b, kind=kind)
  d = np.asarray(d.astype(jnp.float32))
  ref = np.asarray(ref, np.float32)
  total = int(sizes.sum())
  if kind < 2:
    assert np.all(d[total:] == 0)
    d, ref = d[:total], ref[:total]
  assert rel_err(d, ref) < 1e-2


# ----------------------------------------------------------------------------------------------
# Blockwise FP8 (recipe "fp8" / "fp8_pow2") against the pure-JAX emulation (jax_megamoe.fp8).

from jax_megamoe import fp8  # noqa: E402


@pytest.mark.gpu
@pytest.mark.parametrize("pow2", [False, True])
def test_fp8_quantisation_and_gemm_match_emulation(pow2):
  spec = fp8.get_recipe("fp8_pow2" if pow2 else "fp8")
  rng = np.random.default_rng(30 + pow2)
  n, k, p, e = 700, 384, 256, 5
  sizes = random_group_sizes(rng, e, 613)
  gs = jnp.asarray(sizes)
  # Rows of different magnitudes so that the per-block scales differ.
  a = jnp.asarray(rng.standard_normal((n, k)) * np.exp(rng.standard_normal((n, 1))), jnp.bfloat16)
  b = jnp.asarray(rng.standard_normal((e, k, p)) * 0.05, jnp.bfloat16)
  poison_device_memory(16 << 20)
  d, (a_q, a_s, b_q, b_s) = cuda_fp8.grouped_gemm_fp8(a, gs, b, pow2=pow2, return_quantized=True)
  # Quantised operands, bit for bit: dequantise and compare with the emulation, run on the CPU
  # (IEEE division there; XLA:GPU may divide approximately).
  cpu = jax.devices("cpu")[0]
  a_deq = a_q.astype(jnp.float32) * jnp.repeat(a_s, 128, axis=1)
  b_deq = jnp.swapaxes(b_q.astype(jnp.float32), 1, 2) * jnp.repeat(
      jnp.repeat(b_s, 128, axis=1), 128, axis=2)
  with jax.default_device(cpu):
    a_emu = fp8.quantize_activation(jax.device_put(a, cpu), spec)
    b_emu = fp8.quantize_weight(jax.device_put(b, cpu), spec)
  np.testing.assert_array_equal(np.asarray(a_deq), np.asarray(a_emu))
  np.testing.assert_array_equal(np.asarray(b_deq), np.asarray(b_emu))
  if pow2:
    s = np.asarray(a_s)
    assert np.all(np.exp2(np.round(np.log2(s))) == s), "pow2 scales must be powers of two"
  ref = jax.lax.ragged_dot(fp8.quantize_activation(a, spec), fp8.quantize_weight(b, spec), gs,
                           precision=jax.lax.Precision.HIGHEST)
  total = int(sizes.sum())
  d = np.asarray(d.astype(jnp.float32))
  assert np.all(d[total:] == 0)
  err = rel_err(d[:total], np.asarray(ref)[:total])
  assert err < 5e-3, err


@pytest.mark.gpu
@pytest.mark.parametrize("pow2", [False, True])
def test_fp8_swiglu_quantize_matches_swiglu_then_quantize(pow2):
  """The fused SwiGLU + 1x128 quantisation equals, bit for bit on the rows in use, the bf16
  MLP's SwiGLU followed by quantize_rows; padding rows of h are zero."""
  x, gs, wgu, wd, _ = make_inputs(33, 900, 256, 384, 6, 811, jnp.bfloat16)
  _, gate_up, hidden = jax.jit(cuda_bf16.forward)(x, gs, wgu, wd)  # SwiGLU of the bf16 kernels
  poison_device_memory(32 << 20)
  h, rows = jax.jit(lambda g, s: cuda_fp8.swiglu_quantize(g, s, pow2=pow2))(gate_up, gs)
  want = jax.jit(lambda a: cuda_fp8.quantize_rows(a, pow2=pow2))(hidden)
  total = int(np.sum(np.asarray(gs)))
  bf16_bits = lambda a: np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint16))
  e4m3_bits = lambda a: np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))
  np.testing.assert_array_equal(bf16_bits(h[:total]), bf16_bits(hidden[:total]))
  assert np.all(np.asarray(h[total:].astype(jnp.float32)) == 0)
  np.testing.assert_array_equal(e4m3_bits(rows.q[:total]), e4m3_bits(want.q[:total]))
  np.testing.assert_array_equal(np.asarray(rows.scale[:total]), np.asarray(want.scale[:total]))


def _group_columns(op: cuda_fp8.WgradOperand, sizes) -> np.ndarray:
  """A WgradOperand dequantised back to rows [sum(sizes), C] (group by group), and asserts that
  each group's padding columns are zero bytes."""
  used = int((-(-np.asarray(sizes) // 128) * 128).sum())  # columns past the groups: unspecified
  q = np.asarray(op.q[:, :used].astype(jnp.float32))
  s = np.repeat(np.asarray(op.scale[:used // 128]), 128, axis=0).T  # [C, used]
  deq = q * s
  rows, col = [], 0
  for n in sizes:
    n = int(n)
    rows.append(deq[:, col:col + n].T)
    pad = -n % 128
    assert np.all(q[:, col + n:col + n + pad] == 0), "a group's padding columns must be 0"
    col += n + pad
  return np.concatenate(rows, axis=0)


@pytest.mark.gpu
@pytest.mark.parametrize("pow2", [False, True])
def test_fp8_wgrad_operands_read_in_place_equal_the_stored_rows(pow2):
  """The wgrad operands the FP8 backwards quantise without storing their rows
  (cuda_fp8.quantize_wgrad_operand(source=): x's rows gathered; of a QuantizedRows: FP8 rows
  as dispatched, dequantised; swiglu_wgrad_operand: h from gate_up) are bit for bit those of
  the rows stored (jnp.take, dequantize_rows, swiglu_quantize's h), with_rows too; source with
  -1 entries, repeats, and a whole group of them; odd group sizes."""
  rng = np.random.default_rng(70 + pow2)
  sizes = np.array([0, 1, 300, 128, 0, 77, 257], np.int32)
  n, tokens, c, f = int(sizes.sum()) + 13, 200, 384, 256
  gs = jnp.asarray(sizes)
  x = jnp.asarray(rng.standard_normal((tokens, c)) * np.exp(rng.standard_normal((tokens, 1))),
                  jnp.bfloat16)
  source = rng.integers(0, tokens, size=n).astype(np.int32)
  source[rng.random(n) < 0.2] = -1
  source[1] = -1  # group 1's only row
  source = jnp.asarray(source)
  gate_up = jnp.asarray(rng.standard_normal((n, 2 * f)) * 2, jnp.bfloat16)
  poison_device_memory(32 << 20)
  gathered_rows, gathered = jax.jit(lambda a, src, s: cuda_fp8.quantize_wgrad_operand(
      a, s, pow2=pow2, with_rows=True, source=src))(x, source, gs)
  swiglu = jax.jit(lambda g, s: cuda_fp8.swiglu_wgrad_operand(g, s, pow2=pow2))(gate_up, gs)
  fp8_rows = cuda_fp8.unpack_rows(cuda_fp8.pack_rows(cuda_fp8.quantize_rows(gate_up, pow2=pow2)),
                                  2 * f)  # as dispatched: q with a row stride
  deq_rows, deq = jax.jit(lambda r, s: cuda_fp8.quantize_wgrad_operand(
      r, s, pow2=pow2, with_rows=True))(fp8_rows, gs)
  stored = jnp.where((source >= 0)[:, None], jnp.take(x, jnp.maximum(source, 0), axis=0), 0)
  want_rows, want = cuda_fp8.quantize_wgrad_operand(stored.astype(jnp.bfloat16), gs, pow2=pow2,
                                                    with_rows=True)
  h, _ = cuda_fp8.swiglu_quantize(gate_up, gs, pow2=pow2)
  want_h = cuda_fp8.quantize_wgrad_operand(h, gs, pow2=pow2)
  want_deq_rows, want_deq = cuda_fp8.quantize_wgrad_operand(cuda_fp8.dequantize_rows(fp8_rows),
                                                            gs, pow2=pow2, with_rows=True)
  used = int((-(-sizes // 128) * 128).sum())  # columns past the groups: unspecified
  total = int(sizes.sum())
  bits = lambda t: np.asarray(jax.lax.bitcast_convert_type(t, jnp.uint8))
  for label, got, ref in (("gathered", gathered, want), ("swiglu", swiglu, want_h),
                          ("dequantised", deq, want_deq)):
    np.testing.assert_array_equal(bits(got.q[:, :used]), bits(ref.q[:, :used]), err_msg=label)
    np.testing.assert_array_equal(np.asarray(got.scale[:used // 128]),
                                  np.asarray(ref.scale[:used // 128]), err_msg=label)
  np.testing.assert_array_equal(bits(gathered_rows.q[:total]), bits(want_rows.q[:total]))
  np.testing.assert_array_equal(np.asarray(gathered_rows.scale[:total]),
                                np.asarray(want_rows.scale[:total]))
  np.testing.assert_array_equal(bits(deq_rows.q[:total]), bits(want_deq_rows.q[:total]))
  np.testing.assert_array_equal(np.asarray(deq_rows.scale[:total]),
                                np.asarray(want_deq_rows.scale[:total]))
  assert np.any(bits(swiglu.q[:, :used])) and np.any(bits(gathered.q[:, :used]))


@pytest.mark.gpu
@pytest.mark.parametrize("pow2", [False, True])
def test_fp8_backward_operands_and_wgrad_match_emulation(pow2):
  """The backward's FP8 operands bit for bit against the emulation (weights for dy @ w^T; rows
  in 128x1 blocks inside each group, transposed and group-padded), and the K-grouped FP8 wgrad
  against the product of the dequantised operands; empty groups get exact zeros."""
  spec = fp8.get_recipe("fp8_pow2" if pow2 else "fp8")
  rng = np.random.default_rng(60 + pow2)
  sizes = np.array([0, 1, 300, 128, 0, 77, 257], np.int32)  # 0, 1, > 2 blocks, not a multiple
  n, ca, cb, k = int(sizes.sum()) + 13, 256, 384, 256
  gs = jnp.asarray(sizes)
  scale_rows = np.exp(rng.standard_normal((n, 1)))
  a = jnp.asarray(rng.standard_normal((n, ca)) * scale_rows, jnp.bfloat16)
  b = jnp.asarray(rng.standard_normal((n, cb)) * scale_rows[::-1], jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((len(sizes), k, cb)) * 0.05, jnp.bfloat16)
  poison_device_memory(32 << 20)
  ops = jax.jit(lambda a, b, s: (cuda_fp8.quantize_wgrad_operand(a, s, pow2=pow2),
                                 cuda_fp8.quantize_wgrad_operand(b, s, pow2=pow2)))(a, b, gs)
  dw = jax.jit(cuda_fp8.grouped_wgrad_quantized)(ops[0], gs, ops[1])
  w_fwd = cuda_fp8.quantize_weights(w, pow2=pow2)
  w_dgrad = cuda_fp8.quantize_weights(w, pow2=pow2, dgrad=True)
  cpu = jax.devices("cpu")[0]
  with jax.default_device(cpu):
    a_emu = np.asarray(fp8.quantize_grouped_rows(jax.device_put(a, cpu), gs, spec))
    b_emu = np.asarray(fp8.quantize_grouped_rows(jax.device_put(b, cpu), gs, spec))
    w_emu = np.asarray(fp8.quantize_weight(jax.device_put(w, cpu), spec))
  total = int(sizes.sum())
  np.testing.assert_array_equal(_group_columns(ops[0], sizes), a_emu[:total])
  np.testing.assert_array_equal(_group_columns(ops[1], sizes), b_emu[:total])
  # with_rows: the same operand, and the 1x128 rows of quantize_rows, from one read.
  rows_b, op_b = jax.jit(lambda b, s: cuda_fp8.quantize_wgrad_operand(b, s, pow2=pow2,
                                                                      with_rows=True))(b, gs)
  np.testing.assert_array_equal(_group_columns(op_b, sizes), b_emu[:total])
  alone = cuda_fp8.quantize_rows(b, pow2=pow2)
  e4m3 = lambda t: np.asarray(jax.lax.bitcast_convert_type(t, jnp.uint8))
  np.testing.assert_array_equal(e4m3(rows_b.q[:total]), e4m3(alone.q[:total]))
  np.testing.assert_array_equal(np.asarray(rows_b.scale[:total]), np.asarray(alone.scale[:total]))
  # dgrad weights: w's layout, the same bytes as the forward's transposed ones.
  bits = lambda t: np.asarray(jax.lax.bitcast_convert_type(t, jnp.uint8))
  np.testing.assert_array_equal(bits(w_dgrad.q), np.swapaxes(bits(w_fwd.q), 1, 2))
  w_deq = np.asarray(w_dgrad.q.astype(jnp.float32)) * np.repeat(np.repeat(
      np.swapaxes(np.asarray(w_dgrad.scale), 1, 2), 128, axis=1), 128, axis=2)
  np.testing.assert_array_equal(w_deq, w_emu)
  dw = np.asarray(dw.astype(jnp.float32))
  start = 0
  for g, m in enumerate(sizes):
    want = a_emu[start:start + m].T.astype(np.float64) @ b_emu[start:start + m].astype(np.float64)
    if m == 0:
      assert np.all(dw[g] == 0), f"empty group {g} must get zeros"
    else:
      assert rel_err(dw[g], want) < 5e-3, (g, rel_err(dw[g], want))
    start += m


@pytest.mark.gpu
@pytest.mark.parametrize("pow2", [False, True])
def test_fp8_swiglu_backward_quantize(pow2):
  """dgate_up (the SwiGLU backward, never stored) as 1x128 rows and as a wgrad operand: close
  to the vjp (e4m3 rounding), and bit for bit quantize_wgrad_operand(dgate_up, with_rows=True)
  where dgate_up is exact (gate = 0: sigmoid 1/2, so dgate = dh * up / 2, dup = dh * 0)."""
  rng = np.random.default_rng(35)
  sizes = np.array([0, 1, 300, 128, 0, 77, 257], np.int32)
  n, f = int(sizes.sum()) + 11, 384
  gs = jnp.asarray(sizes)
  dh = jnp.asarray(rng.standard_normal((n, f)), jnp.bfloat16)
  gate_up = jnp.asarray(rng.standard_normal((n, 2 * f)) * 2, jnp.bfloat16)
  call = jax.jit(lambda d, g, s: cuda_fp8.swiglu_backward_quantize(d, g, s, pow2=pow2))
  poison_device_memory(32 << 20)
  rows, op = call(dh, gate_up, gs)
  total = int(sizes.sum())
  f32 = lambda a: np.asarray(a, np.float32)
  g, u, d = f32(gate_up[:, :f]), f32(gate_up[:, f:]), f32(dh)
  s = 1 / (1 + np.exp(-g))
  want = np.concatenate([d * u * s * (1 + g * (1 - s)), d * g * s], axis=1)[:total]
  deq_rows = f32(rows.q[:total].astype(jnp.float32)) * np.repeat(f32(rows.scale[:total]), 128, 1)
  assert rel_err(deq_rows, want) < 4e-2
  assert rel_err(_group_columns(op, sizes), want) < 4e-2

  gate_up0 = gate_up.at[:, :f].set(0)
  d, g, u = jnp.asarray(d), jnp.asarray(f32(gate_up0[:, :f])), jnp.asarray(u)
  exact = jnp.concatenate([d * u / 2, d * g / 2], axis=1).astype(jnp.bfloat16)  # -0 where d < 0
  rows, op = call(dh, gate_up0, gs)
  want_rows, want_op = cuda_fp8.quantize_wgrad_operand(exact, gs, pow2=pow2, with_rows=True)
  bits = lambda t: np.asarray(jax.lax.bitcast_convert_type(t, jnp.uint8))
  used = int((-(-sizes // 128) * 128).sum())
  np.testing.assert_array_equal(bits(rows.q[:total]), bits(want_rows.q[:total]))
  np.testing.assert_array_equal(f32(rows.scale[:total]), f32(want_rows.scale[:total]))
  np.testing.assert_array_equal(bits(op.q[:, :used]), bits(want_op.q[:, :used]))
  np.testing.assert_array_equal(f32(op.scale[:used // 128]), f32(want_op.scale[:used // 128]))


def fp8_oracle_mlp(recipe):
  """The recipe's definition in pure JAX: every GEMM in FP8, forward and backward, gradients
  straight through the rounding (fp8.ragged_dot), SwiGLU in fp32, gate_up and h stored in the
  compute dtype as the kernels store them (so their gradients are rounded alike)."""
  spec = fp8.get_recipe(recipe)

  def mlp(x, gs, wgu, wd):
    f = wd.shape[1]
    gu = fp8.ragged_dot(x, wgu, gs, spec).astype(x.dtype).astype(jnp.float32)
    h = (jax.nn.silu(gu[:, :f]) * gu[:, f:]).astype(x.dtype)
    y = fp8.ragged_dot(h, wd, gs, spec)
    valid = jnp.arange(x.shape[0]) < jnp.sum(gs)
    return jnp.where(valid[:, None], y, 0.0).astype(x.dtype)
  return mlp


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fp8", "fp8_pow2"])
def test_fp8_mlp_matches_emulation(recipe):
  x, gs, wgu, wd, dy = make_inputs(41, 1000, 256, 384, 8, 911, jnp.bfloat16)
  poison_device_memory(64 << 20)
  fn = lambda x, gs, wgu, wd: cuda.grouped_mlp(x, gs, wgu, wd, recipe=recipe)
  y, (dx, dwgu, dwd) = loss_and_grads(fn, x, gs, wgu, wd, dy)
  # The oracle on the CPU: exact division, and no XLA:GPU excess-precision rewrites.
  cpu = jax.devices("cpu")[0]
  with jax.default_device(cpu):
    on_cpu = [jax.device_put(a, cpu) for a in (x, gs, wgu, wd, dy)]
    y_o, (dx_o, dwgu_o, dwd_o) = loss_and_grads(fp8_oracle_mlp(recipe), *on_cpu)
    y_ref = reference.grouped_mlp(*on_cpu[:4], recipe=recipe)
  total = int(np.sum(np.asarray(gs)))
  y = np.asarray(y.astype(jnp.float32))
  assert np.all(y[total:] == 0) and np.all(np.isfinite(y[:total]))
  errs = {"y vs reference": rel_err(y[:total], np.asarray(y_ref.astype(jnp.float32))[:total]),
          "y": rel_err(y[:total], np.asarray(y_o.astype(jnp.float32))[:total]),
          "dx": rel_err(dx.astype(jnp.float32), dx_o.astype(jnp.float32)),
          "dw_gate_up": rel_err(dwgu.astype(jnp.float32), dwgu_o.astype(jnp.float32)),
          "dw_down": rel_err(dwd.astype(jnp.float32), dwd_o.astype(jnp.float32))}
  print(recipe, errs)
  for name, err in errs.items():
    assert err < 2e-2, f"{name}: {err:.3g} (all: {errs})"


# ----------------------------------------------------------------------------------------------
# Wired into jax_megamoe.moe (backend "cuda"), one GPU and expert-parallel over two.

def _moe_inputs(seed, tokens=512, hidden=256, ffn=128, experts=8, top_k=2, dtype=jnp.bfloat16):
  import jax_megamoe as jm
  ks = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(ks[0], (tokens, hidden), jnp.float32).astype(dtype)
  w, ids, _ = jm.route(jax.random.normal(ks[1], (tokens, experts)), top_k)
  wgu = (jax.random.normal(ks[2], (experts, hidden, 2 * ffn)) / hidden ** 0.5).astype(dtype)
  wd = (jax.random.normal(ks[3], (experts, ffn, hidden)) / ffn ** 0.5).astype(dtype)
  return x, ids, w, wgu, wd


def _moe_value_and_grads(mesh, backend, x, ids, w, wgu, wd):
  import jax_megamoe as jm

  def loss(x, w, wgu, wd):
    y = jm.moe(x, ids, w, wgu, wd, mesh=mesh, backend=backend)
    return jnp.sum(y.astype(jnp.float32) ** 2), y
  (_, y), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(x, w, wgu, wd)
  return y, g


@pytest.mark.gpu
def test_moe_cuda_backend_matches_reference_one_gpu():
  x, ids, w, wgu, wd = _moe_inputs(50)
  y, g = _moe_value_and_grads(None, "cuda", x, ids, w, wgu, wd)
  y_r, g_r = _moe_value_and_grads(None, "reference", x, ids, w, wgu, wd)
  assert rel_err(y.astype(jnp.float32), y_r.astype(jnp.float32)) < 1e-2
  for a, b in zip(g, g_r):
    assert rel_err(a.astype(jnp.float32), b.astype(jnp.float32)) < 2e-2


@pytest.mark.multigpu
def test_moe_cuda_backend_expert_parallel_two_gpus():
  from jax.sharding import AxisType
  gpus = jax.devices("gpu")[:2]
  mesh = jax.make_mesh((2,), ("expert",), axis_types=(AxisType.Auto,), devices=gpus)
  x, ids, w, wgu, wd = _moe_inputs(51)
  y, g = _moe_value_and_grads(mesh, "cuda", x, ids, w, wgu, wd)
  # The kernel's contract: the same exchange with the reference MLP (2026-11-30 on 2 x H200,
  # before this comparison was split out, EP cuda vs the single-device reference had the right
  # forward but dx off by 111%: see the report; either the kernel under EP or the ragged
  # exchange's backward).
  y_r, g_r = _moe_value_and_grads(mesh, "reference", x, ids, w, wgu, wd)
  y_1, g_1 = _moe_value_and_grads(None, "reference", x, ids, w, wgu, wd)
  f32 = lambda a: a.astype(jnp.float32)
  errs = {"y": rel_err(f32(y), f32(y_r)),
          **{f"d{n}": rel_err(f32(a), f32(b)) for n, a, b in zip(("x", "w", "wgu", "wd"), g, g_r)},
          "reference EP vs 1 device y": rel_err(f32(y_r), f32(y_1)),
          **{f"reference EP vs 1 device d{n}": rel_err(f32(a), f32(b))
             for n, a, b in zip(("x", "w", "wgu", "wd"), g_r, g_1)}}
  print(errs)
  for name, err in errs.items():
    assert err < 2e-2, f"{name}: {err:.3g} (all: {errs})"


@pytest.mark.multigpu
@pytest.mark.parametrize("recipe", ["fp8", "fp8_pow2"])
def test_moe_cuda_fp8_rows_dispatched_in_fp8_two_gpus(recipe):
  """Recipe fp8 under EP: rows quantised on the sender travel in FP8 (e4m3 + scales). The
  forward must equal, bit for bit, the path that dispatches bf16 rows and quantises them on the
  receiver (same rows, same blocks); gradients agree with it and with the reference emulation."""
  from jax.sharding import AxisType
  import jax_megamoe as jm
  from jax_megamoe.backends import cuda_ep
  gpus = jax.devices("gpu")[:2]
  mesh = jax.make_mesh((2,), ("expert",), axis_types=(AxisType.Auto,), devices=gpus)
  # Routing skewed onto expert 0 for a third of the tokens; H=384 (an odd count of 128-blocks).
  x, ids, w, wgu, wd = _moe_inputs(52, tokens=510, hidden=384, ffn=256, experts=8, top_k=2)
  ids = ids.at[::3, 0].set(0).at[::3, 1].set(5)

  def run(layer):
    def loss(x, w, wgu, wd):
      y = layer(x, ids, w, wgu, wd)
      return jnp.sum(y.astype(jnp.float32) ** 2), y
    (_, y), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        x, w, wgu, wd)
    return y, g

  def ep(fp8_dispatch):
    mlp = cuda.expert_mlp(recipe, x.dtype, x.shape[1], wd.shape[1])
    return lambda *a: cuda_ep.expert_parallel_moe(*a, mesh=mesh, mlp=mlp,
                                                  fp8_dispatch=fp8_dispatch)

  poison_device_memory(64 << 20)
  y8, g8 = run(ep(True))
  y16, g16 = run(ep(False))
  reference = lambda *a: jm.moe(*a, mesh=mesh, backend="reference", recipe=recipe)
  y_ref, g_ref = run(reference)
  # The expert rank holds x only as FP8 rows, so dW_gate_up = x_q^T dG: its oracle is the
  # reference run on x rounded as the sender rounds it (the other gradients use no x).
  spec = fp8.get_recipe(recipe)
  _, g_ref_xq = run(lambda x, *a: reference(fp8.quantize_activation(x, spec).astype(x.dtype), *a))
  np.testing.assert_array_equal(np.asarray(y8.astype(jnp.float32)),
                                np.asarray(y16.astype(jnp.float32)))
  f32 = lambda a: a.astype(jnp.float32)
  names = ("dx", "dtopk_weights", "dw_gate_up", "dw_down")
  want = (g_ref[0], g_ref[1], g_ref_xq[2], g_ref[3])
  # Same forward, so the gradients that do not read x are bit for bit those of the bf16 rows.
  for n, a, b in zip(names, g8, g16):
    if n != "dw_gate_up":
      np.testing.assert_array_equal(np.asarray(f32(a)), np.asarray(f32(b)), err_msg=n)
  errs = {"y vs reference": rel_err(f32(y8), f32(y_ref)),
          "dw_gate_up vs bf16 rows": rel_err(f32(g8[2]), f32(g16[2])),
          **{f"{n} vs reference": rel_err(f32(a), f32(b)) for n, a, b in zip(names, g8, want)}}
  print(recipe, errs)
  assert all(np.isfinite(v) for v in errs.values()), errs
  # dW_gate_up from FP8 rows: x rounded twice (1x128 on the sender, then 128x1 for the wgrad)
  # instead of once; measured 4.3e-2 (fp8) and 0 (fp8_pow2: power-of-two scales make the
  # second rounding exact) on 2 x H200.
  for name, err in errs.items():
    limit = 6e-2 if name == "dw_gate_up vs bf16 rows" else 2e-2
    assert err < limit, f"{name}: {err:.3g} (all: {errs})"


# A child's forward of the cuda grouped MLP (bf16 or fp8) on small inputs: prints "ran" or the
# error's text.
_CHILD = """
import sys
import jax, jax.numpy as jnp, numpy as np
from jax_megamoe.backends import cuda
rng = np.random.default_rng(0)
e, n, h, f = 4, 256, 256, 128
x = jnp.asarray(rng.standard_normal((n, h)), jnp.bfloat16)
gs = jnp.asarray([64, 64, 64, 64], jnp.int32)
wgu = jnp.asarray(rng.standard_normal((e, h, 2 * f)) / 16, jnp.bfloat16)
wd = jnp.asarray(rng.standard_normal((e, f, h)) / 16, jnp.bfloat16)
recipe = None if sys.argv[1] == "bf16" else sys.argv[1]
try:
  jax.block_until_ready(cuda.grouped_mlp(x, gs, wgu, wd, recipe=recipe))
  print("ran")
except Exception as ex:  # the refusal, by name
  print(str(ex))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("name, value, recipe", [
    ("MEGAMOE_GROUPED_GEMM_VARIANT", "fprop:7", "bf16"),
    ("MEGAMOE_GROUPED_GEMM_VARIANT", "1", "bf16"),
    ("MEGAMOE_FP8_GEMM_VARIANT", "9", "fp8"),
])
def test_gemm_variant_overrides_run_or_refuse(name, value, recipe):
  """The GEMM variant overrides (ffi/heuristics/gemm_variants.h) are read once per process, so
  each case runs in a child: a valid value runs, a mistyped one fails the GEMM's call naming the
  variable (until session 36 it was ignored and the default ran). The parser's every case:
  tests/test_env_overrides.py, on the CPU."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("MEGAMOE_")}
  env.update({name: value, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
  child = subprocess.run([sys.executable, "-c", _CHILD, recipe], env=env, capture_output=True,
                         text=True, timeout=300)
  out, why = child.stdout, child.stdout + child.stderr[-2000:]
  if value == "1":
    assert out.strip().splitlines()[-1:] == ["ran"], why
  else:
    assert f"{name} must be" in out and f"got '{value}'" in out, why

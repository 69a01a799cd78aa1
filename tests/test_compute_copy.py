"""The bf16 compute copy of the weights (issue 15): models.compute_copy gives each parameter
the dtype the model computes it in, the example's train step reads the copy in its forward and
writes it from the updated float32 master. The step computes the same loss as the step without
it, its optimizer sees the same gradients but for the LM head's (made in float32, rounded once
to bf16), the copy follows its master, and the gradient collectives keep their dtypes.

Runs the example's step in this process (8 virtual CPUs; the sharded tests lay a
data=2 x expert=4 mesh over them)."""

from __future__ import annotations

import collections
import json
import os
import re
import sys
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.extend.core import Var

from jax_megamoe.models import FLOAT32_PARAMS, Qwen3Moe, compute_copy, get_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import data as data_lib  # noqa: E402
import train_qwen3_moe as example  # noqa: E402
from jaxpr_helpers import sub_jaxprs

sys.path.pop(0)

# Shape-only primitives: a parameter passed through them is still that parameter.
_LAYOUT_OPS = {"transpose", "reshape", "squeeze", "expand_dims", "broadcast_in_dim", "copy"}
HEAD = ("lm_head", "kernel")  # its gradient is summed in float32 (chunked_cross_entropy)


def _tiny(dtype="bfloat16", **overrides):
  config = get_config("tiny", **overrides)
  model = Qwen3Moe(config, rngs=nnx.Rngs(0), dtype=dtype, backend="reference")
  return config, *nnx.split(model, nnx.Param)


def _flat(state):
  return {path: v.get_value() for path, v in nnx.to_flat_state(state)}


def _batch(config, step=1, batch=2, seq=32):
  sampler = data_lib.BatchSampler(data_lib.load_tokens(None, config.vocab_size), batch, seq, 0)
  return tuple(jnp.asarray(a) for a in sampler(step))


def _converted_inputs(fn, *args) -> set[int]:
  """Indices of the flattened inputs of fn(*args) that it converts to another dtype anywhere
  (sub-jaxprs of scans, custom VJPs, shard_maps and remat included)."""
  found = set()

  def visit(jaxpr, origin):
    for eqn in jaxpr.eqns:
      sources = {origin[v] for v in eqn.invars if isinstance(v, Var) and v in origin}
      if eqn.primitive.name == "convert_element_type":
        found.update(sources)
      elif eqn.primitive.name in _LAYOUT_OPS and sources:
        origin[eqn.outvars[0]] = next(iter(sources))
      for sub in sub_jaxprs(eqn.params):
        if len(sub.invars) == len(eqn.invars):  # operands map onto the body's inputs
          visit(sub, {s: origin[v] for s, v in zip(sub.invars, eqn.invars)
                      if isinstance(v, Var) and v in origin})

  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  visit(jaxpr, {v: i for i, v in enumerate(jaxpr.invars)})
  return found


def test_copy_dtypes_follow_the_rule():
  _, _, params = _tiny(router_bias_update_rate=0.01)
  copy = compute_copy(params, jnp.bfloat16)
  assert jax.tree.structure(copy) == jax.tree.structure(params)
  for path, value in _flat(copy).items():
    want = jnp.float32 if path[-1] in FLOAT32_PARAMS else jnp.bfloat16
    assert value.dtype == want, path
    np.testing.assert_array_equal(value, _flat(params)[path].astype(want))
  assert {p[-1] for p in _flat(copy) if _flat(copy)[p].dtype == jnp.float32} == {
      "router", "selection_bias"}
  for value in _flat(compute_copy(params, jnp.float32)).values():
    assert value.dtype == jnp.float32


@pytest.mark.parametrize("tied", [False, True])
def test_the_rule_is_what_the_model_casts(tied):
  """The example's step converts exactly the master weights the copy rounds (nothing else),
  and with the copy converts none of its inputs: every cast of a weight moved into the copy."""
  config, graphdef, params = _tiny(router_bias_update_rate=0.01, tie_word_embeddings=tied)
  tx = optax.adam(1e-3)
  step = example.make_train_step(graphdef, tx, 1e-2, 1e-3, 8)  # chunked: a scan over the head
  inputs, targets = _batch(config)
  plain = example.train_state(params, tx.init(params))
  # The step's first inputs are the master weights, in the order of their paths.
  assert [id(x) for x in jax.tree.leaves(plain)[:len(_flat(params))]] == [
      id(x) for x in _flat(params).values()]
  rounded = {i for i, p in enumerate(_flat(params)) if p[-1] not in FLOAT32_PARAMS}
  assert _converted_inputs(step, plain, inputs, targets) == rounded
  with_copy = example.train_state(params, tx.init(params), jnp.bfloat16)
  assert _converted_inputs(step, with_copy, inputs, targets) == set()


def _gradient_recorder() -> optax.GradientTransformation:
  """An optimizer that does not move the weights and keeps the gradients it was given."""
  return optax.GradientTransformation(
      lambda params: jax.tree.map(jnp.zeros_like, params),
      lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads))


@pytest.mark.parametrize("ce_chunk", [0, 8])
def test_step_one_loss_is_bitwise_and_only_the_heads_gradient_rounds(ce_chunk):
  config, graphdef, params = _tiny()
  tx = _gradient_recorder()
  step = jax.jit(example.make_train_step(graphdef, tx, 1e-2, 1e-3, ce_chunk))
  inputs, targets = _batch(config)
  plain, plain_m = step(example.train_state(params, tx.init(params)), inputs, targets)
  copy, copy_m = step(example.train_state(params, tx.init(params), jnp.bfloat16), inputs,
                      targets)
  for key in ("loss", "ce", "aux", "z", "expert_load"):  # the forward is the same function
    np.testing.assert_array_equal(copy_m[key], plain_m[key], err_msg=key)
  # What the optimizer saw, in float32: the copy's gradients are the plain step's rounded to
  # bf16, and all but the LM head's come out of bf16 GEMMs anyway (bitwise equal).
  plain_g, copy_g = _flat(plain.opt_state), _flat(copy.opt_state)
  for path, g in plain_g.items():
    assert copy_g[path].dtype == jnp.float32, path
    want = g if path[-1] in FLOAT32_PARAMS else g.astype(jnp.bfloat16).astype(jnp.float32)
    np.testing.assert_array_equal(copy_g[path], want, err_msg=str(path))
  differ = {p for p in plain_g if not np.array_equal(plain_g[p], copy_g[p])}
  assert differ == {HEAD}, differ


def test_a_few_steps_follow_the_master_path_and_the_copy_its_master():
  """Not bitwise after the first update: the LM head's rounded gradient (and, through the clip's
  global norm, every update a little) moves the weights apart, the next forwards and their
  routing carry it on. Measured on CPU: the losses agree to 1.2e-5 (relative) over 4 steps and
  each weight's total update to 1.2% (expert weights; 0.03% after 3 steps)."""
  steps = 4
  config, graphdef, params = _tiny()
  tx, _ = example.make_optimizer(types.SimpleNamespace(
      lr=3e-3, steps=100, warmup_steps=0, min_lr_ratio=0.1, weight_decay=0.1, clip_norm=1.0))
  step = jax.jit(example.make_train_step(graphdef, tx, 1e-2, 1e-3, 0))
  init = {path: np.asarray(v) for path, v in _flat(params).items()}
  plain = example.train_state(params, tx.init(params))
  copy = example.train_state(params, tx.init(params), jnp.bfloat16)
  for s in range(1, steps + 1):
    inputs, targets = _batch(config, s)
    plain, plain_m = step(plain, inputs, targets)
    copy, copy_m = step(copy, inputs, targets)
    if s == 1:
      assert float(copy_m["loss"]) == float(plain_m["loss"])
    np.testing.assert_allclose(copy_m["loss"], plain_m["loss"], rtol=1e-4)
    for path, master in _flat(copy.params).items():
      c = _flat(copy.compute)[path]
      np.testing.assert_array_equal(c, master.astype(c.dtype), err_msg=str(path))
  for path, master in _flat(copy.params).items():
    moved, moved_plain = master - init[path], _flat(plain.params)[path] - init[path]
    assert np.linalg.norm(moved - moved_plain) < 0.05 * np.linalg.norm(moved_plain), path


def _sharded_step(copy: bool):
  args = example.parse_flags(["t", "--num-layers", "1", "--batch", "8", "--seq-len", "32",
                              "--mesh", "data=2,expert=4"])
  config = get_config("tiny", num_layers=1)
  mesh = example.make_mesh(args.mesh, config.num_experts)
  args, _ = example.resolve_defaults(args, config, mesh)
  assert args.compute_copy  # the bf16 default
  graphdef, params = example.build_params(args, config, mesh, jnp.bfloat16)
  tx, _ = example.make_optimizer(args)
  state = example.train_state(params, example.init_optimizer_state(tx, params, mesh),
                              jnp.bfloat16 if copy else None)
  step, batch_sharding = example.jit_train_step(graphdef, tx, state, mesh, aux_coef=1e-2,
                                                z_coef=1e-3, ce_chunk=0)
  return config, state, step, batch_sharding


def test_the_sharded_step_donates_the_whole_state_and_keeps_its_layout():
  config, state, step, batch_sharding = _sharded_step(copy=True)
  for master, c in zip(jax.tree.leaves(state.params), jax.tree.leaves(state.compute)):
    assert c.sharding == master.sharding
  shardings = jax.tree.map(lambda x: x.sharding, state)
  put = lambda a: jax.device_put(a, batch_sharding)  # noqa: E731
  inputs, targets = (put(a) for a in _batch(config, batch=8))
  with warnings.catch_warnings():
    warnings.simplefilter("error", UserWarning)  # "Some donated buffers were not usable"
    new, _ = step(state, inputs, targets)
  assert all(x.is_deleted() for x in jax.tree.leaves(state))
  assert jax.tree.map(lambda x: x.sharding, new) == shardings


_COLLECTIVE = re.compile(r"= (.+?) (all-reduce|reduce-scatter|all-gather)(?:-start)?\(")


def _partitioned_collectives(step, state, batch_sharding, dump_dir) -> collections.Counter:
  """(kind, dtype) of each collective right after XLA's SPMD partitioner: XLA:CPU later
  promotes bf16 collectives to float32, so the compiled CPU module would hide the dtypes a GPU
  runs them in."""
  x = jax.ShapeDtypeStruct((8, 32), jnp.int32, sharding=batch_sharding)
  step.lower(state, x, x).compile(compiler_options={
      "xla_dump_to": str(dump_dir), "xla_dump_hlo_pass_re": "spmd-partitioning"})
  (path,) = [p for p in os.listdir(dump_dir)
             if "jit_train_step" in p and p.endswith("after_spmd-partitioning."
                                                     "before_control-dep-rewriter.txt")]
  counts = collections.Counter()
  with open(os.path.join(dump_dir, path)) as f:
    for line in f:
      if m := _COLLECTIVE.search(line):
        for dtype in set(re.findall(r"\b(bf16|f32|s32)\[", m.group(1))):
          counts[m.group(2), dtype] += 1
  return counts


def test_gradient_collectives_keep_their_dtypes(tmp_path):
  """Under FSDP + EP the copy moves no gradient reduction to bf16 (the weights' gradients are
  reduced in bf16 with or without it, coming out of bf16 GEMMs; the router's and the LM head's
  in float32); it only lets the expert weights' FSDP all-gathers move bf16 instead of
  float32."""
  got = {}
  for copy in (False, True):
    _, state, step, batch_sharding = _sharded_step(copy)
    got[copy] = _partitioned_collectives(step, state, batch_sharding, tmp_path / str(copy))
  reductions = lambda c: {k: n for k, n in c.items() if k[0] != "all-gather"}  # noqa: E731
  assert reductions(got[True]) == reductions(got[False])
  assert got[False]["all-reduce", "f32"] and got[False]["all-reduce", "bf16"]
  gathers = lambda c, dtype: c["all-gather", dtype]  # noqa: E731
  assert gathers(got[True], "f32") < gathers(got[False], "f32")
  assert (gathers(got[True], "f32") + gathers(got[True], "bf16")
          == gathers(got[False], "f32") + gathers(got[False], "bf16"))


@pytest.mark.parametrize("argv,dtype,want,note", [
    ([], "bfloat16", True, False),
    (["--nocompute-copy"], "bfloat16", False, False),
    (["--compute-copy=false"], "bfloat16", False, False),
    ([], "float32", False, False),
    (["--compute-copy"], "float32", False, True),
])
def test_flag_default_follows_the_dtype(argv, dtype, want, note):
  args = example.parse_flags(["train", "--dtype", dtype, *argv])
  config = get_config("tiny")
  mesh = example.make_mesh(None, config.num_experts)
  resolved, notes = example.resolve_defaults(args, config, mesh)
  assert resolved.compute_copy is want
  assert any("--compute-copy does nothing" in n for n in notes) == note


def test_init_from_makes_the_copy_from_the_imported_weights(tmp_path):
  from test_hf_import_errors import make_checkpoint  # a hand-written HF checkpoint, numpy only

  hf = make_checkpoint(tmp_path / "hf")
  ids = tmp_path / "ids.npy"
  np.save(ids, np.random.default_rng(0).integers(0, 16, 4096).astype(np.int32))  # vocab 16
  curves = {}
  for flag in ("--compute-copy", "--nocompute-copy"):
    out = tmp_path / flag
    summary = example.train(example.parse_flags([
        "train", "--init-from", str(hf), "--data", str(ids), "--steps", "2", "--batch", "8",
        "--seq-len", "16", "--mesh", "data=2,expert=4", "--checkpoint-every", "0",
        "--no-progress", "--out", str(out)]))
    with open(out / "losses.json") as f:
      curves[flag] = json.load(f)
    assert summary["steps"] == 2
  assert curves["--compute-copy"]["args"]["compute_copy"] is True
  assert curves["--compute-copy"]["loss"][0] == curves["--nocompute-copy"]["loss"][0]

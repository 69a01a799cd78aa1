"""examples/train_qwen3_moe.py never loses good training state and never goes on silently:
verified checkpoints (a corrupt one is named and skipped, a good one never deleted for it), the
non-finite guard, expert-parallel kernel errors, resume edge cases, metrics exactly once, and
the absl command line (every historical flag name and default kept, bad values named).

Runs train() in this process (8 virtual CPUs, data=2 x expert=4, one decoder layer): no
subprocess start-up per run."""

import json
import os
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from absl import flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import checkpoints as checkpoints_lib  # noqa: E402
import train_qwen3_moe as example  # noqa: E402

sys.path.pop(0)

# The in-process runs lay a data=2 x expert=4 mesh over the 8 virtual CPUs of conftest.py.
pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu" or jax.device_count() < 8,
                                reason="not run: needs the 8 virtual CPU devices")

SMALL = ["--num-layers", "1", "--steps", "12", "--batch", "8", "--seq-len", "32", "--lr",
         "1e-2", "--log-every", "4", "--mesh", "data=2,expert=4", "--no-progress",
         "--checkpoint-every", "3"]


def run(out, *extra):
  return example.train(example.parse_flags(["train", "--out", str(out), *SMALL, *extra]))


def losses(out):
  with open(os.path.join(out, "losses.json")) as f:
    return json.load(f)


def metric_steps(out):
  with open(os.path.join(out, "metrics.jsonl")) as f:
    return [json.loads(line)["step"] for line in f]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """One uninterrupted 12-step run, checkpoints every 3 steps. Records, at every save, which
  metrics rows were already on disk."""
  out = tmp_path_factory.mktemp("straight")
  rows_at_save = {}
  original = checkpoints_lib.Checkpoints.save

  def recording_save(self, step, state):
    rows_at_save[step] = metric_steps(out)
    return original(self, step, state)

  checkpoints_lib.Checkpoints.save = recording_save
  try:
    run(out)
  finally:
    checkpoints_lib.Checkpoints.save = original
  return out, rows_at_save


def copy_run(straight_out, tmp_path, name="run"):
  shutil.copytree(straight_out, tmp_path / name)
  return tmp_path / name


def flip(path, offset, count=1):
  data = bytearray(path.read_bytes())
  for i in range(offset, offset + count):
    data[i % len(data)] ^= 0x10
  path.write_bytes(bytes(data))


def data_files(step_dir):
  return sorted(p for p in step_dir.rglob("*") if p.is_file() and "/d/" in str(p)
                and "ocdbt" in str(p))


# --- checkpoints: sealed, verified, kept -----------------------------------------------------

def test_checkpoints_are_sealed_and_only_the_newest_two_kept(straight):
  out, _ = straight
  ckpt = out / "checkpoints"
  assert sorted(os.listdir(ckpt), key=int) == ["9", "12"]  # 3 and 6 removed once 9, 12 sealed
  for step in ("9", "12"):
    assert checkpoints_lib.verify(str(ckpt / step)) is None
    manifest = json.loads((ckpt / step / checkpoints_lib.MANIFEST).read_text())
    assert manifest["step"] == int(step) and len(manifest["files"]) > 3


def test_metrics_row_is_on_disk_before_its_checkpoint(straight):
  """An interrupt just after checkpoint N commits must not lose metrics row N."""
  _, rows_at_save = straight
  assert sorted(rows_at_save) == [3, 6, 9, 12]
  for step, rows in rows_at_save.items():
    assert rows == list(range(1, step + 1)), (step, rows)


@pytest.mark.parametrize("damage,match", [
    (lambda d: flip(data_files(d)[0], 1000), "does not match its checksum"),
    (lambda d: flip(data_files(d)[-1], 200, count=64), "does not match its checksum"),
    (lambda d: data_files(d)[0].write_bytes(data_files(d)[0].read_bytes()[:-9]),
     r"has \d+ bytes, \d+ when it was written"),
    (lambda d: data_files(d)[0].unlink(), "is missing"),
    (lambda d: (d / "default" / "stray").write_text("x"), "stray is not in its checksums.json"),
    (lambda d: (d / checkpoints_lib.MANIFEST).unlink(), "checksums.json does not exist"),
    (lambda d: (d / checkpoints_lib.MANIFEST).write_text("{"), "checksums.json is damaged"),
])
def test_verify_names_the_damaged_file(straight, tmp_path, damage, match):
  step_dir = copy_run(straight[0], tmp_path) / "checkpoints" / "12"
  damage(step_dir)
  problem = checkpoints_lib.verify(str(step_dir))
  assert problem is not None and str(step_dir) in problem
  assert re.search(match, problem), problem


def test_corrupt_latest_checkpoint_is_named_and_skipped(straight, tmp_path, capsys):
  """64 flipped bytes in a data file of the newest checkpoint used to resume into NaN losses,
  save a NaN checkpoint and delete the last good one. Now: named, moved aside, the run goes on
  from the one before and reproduces the uninterrupted losses."""
  out = copy_run(straight[0], tmp_path)
  bad_file = data_files(out / "checkpoints" / "12")[0]
  flip(bad_file, 100, count=64)
  capsys.readouterr()
  run(out, "--resume", "--steps", "12")
  printed = capsys.readouterr().out
  assert (f"checkpoint step 12 is not usable: {bad_file} does not match its checksum"
          in printed), printed
  assert "falling back to step 9" in printed and "resumed from step 9" in printed
  assert sorted(os.listdir(out / "checkpoints"), key=int) == ["9", "12"]
  assert checkpoints_lib.verify(str(out / "checkpoints" / "12")) is None  # the redone one
  assert os.listdir(out / "rejected_checkpoints") == ["12"]  # kept, not deleted
  assert losses(out)["ce"] == pytest.approx(losses(straight[0])["ce"], rel=1e-6)
  assert metric_steps(out) == list(range(1, 13))


def test_no_intact_checkpoint_stops_and_changes_nothing(straight, tmp_path):
  out = copy_run(straight[0], tmp_path)
  for step in ("9", "12"):
    flip(data_files(out / "checkpoints" / step)[0], 10)
  with pytest.raises(checkpoints_lib.CheckpointError,
                     match=r"no checkpoint in .* is intact.*step 12: .*does not match.*"
                           r"step 9: .*Nothing was changed"):
    run(out, "--resume")
  assert sorted(os.listdir(out / "checkpoints"), key=int) == ["9", "12"]
  assert not (out / "rejected_checkpoints").exists()


def test_checkpoint_of_another_model_is_a_clear_error(straight, tmp_path):
  out = copy_run(straight[0], tmp_path)
  with pytest.raises(checkpoints_lib.CheckpointError,
                     match=r"step 12 .* matches its checksums but could not be restored into "
                           r"this model: .*--num-layers"):
    run(out, "--resume", "--num-layers", "2", "--steps", "15")


def test_a_state_with_nan_is_never_saved(tmp_path):
  ckpts = checkpoints_lib.Checkpoints(str(tmp_path / "checkpoints"), every=1)
  state = {"params": {"w": jax.numpy.array([1.0, np.nan])}, "step": jax.numpy.array(3)}
  with pytest.raises(checkpoints_lib.CheckpointError,
                     match=r"not saving step 5: 1 arrays .* NaN or Inf, e.g. \['params'\]\['w'\]"):
    ckpts.save(5, state)
  ckpts.close()
  assert ckpts.steps() == []


# --- the non-finite guard and expert-parallel kernel errors ----------------------------------

def test_nonfinite_step_stops_before_its_update_and_any_save(tmp_path):
  """lr 1e30 makes step 2's gradient NaN: the run stops naming step 2 (it used to finish with
  exit 0), the update was not applied, checkpoint 1 stays the newest and holds finite values."""
  out = tmp_path / "nan"
  with pytest.raises(example.RunError,
                     match=r"step 2: the loss is .* and the gradient norm nan \(not finite\); "
                           r"the step's update was not applied .* newest checkpoint is step 1"):
    run(out, "--lr", "1e30", "--warmup-steps", "0", "--checkpoint-every", "1")
  assert checkpoints_lib.Checkpoints(str(out / "checkpoints"), every=1).steps() == [1]
  assert checkpoints_lib.verify(str(out / "checkpoints" / "1")) is None
  assert metric_steps(out) == [1, 2]


@pytest.mark.parametrize("dtype,copy", [("float32", False), ("bfloat16", True)])
def test_nonfinite_loss_never_reaches_the_state(dtype, copy):
  """The jitted step itself returns its input state (master weights, optimizer state and the
  compute copy alike) when the loss or gradient is NaN."""
  import optax
  from flax import nnx
  from jax_megamoe.models import Qwen3Moe, get_config

  model = Qwen3Moe(get_config("tiny", num_layers=1), rngs=nnx.Rngs(0), dtype=dtype)
  graphdef, params = nnx.split(model, nnx.Param)
  tx = optax.adam(1e-3)
  state = example.train_state(params, tx.init(params), dtype if copy else None)
  assert (state.compute is not None) == copy
  before = jax.tree.map(np.asarray, state)
  step = jax.jit(example.make_train_step(graphdef, tx, 0.0, float("nan"), 0))
  tokens = jax.numpy.zeros((2, 8), jax.numpy.int32)
  new_state, metrics = step(state, tokens, tokens)
  assert np.isnan(metrics["loss"])
  assert jax.tree.structure(new_state) == jax.tree.structure(before)
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(new_state)):
    np.testing.assert_array_equal(a, b)


class _FailedWorkspace:
  """Stands in for a symmetric workspace whose kernel timed out waiting for a peer."""

  def check(self):
    raise RuntimeError("jax_megamoe symmetric workspace: rank 1 timed out in dispatch")


def test_ep_kernel_error_stops_before_the_checkpoint(tmp_path, monkeypatch):
  from jax_megamoe import symmetric
  monkeypatch.setitem(symmetric._cache, ("fake",), _FailedWorkspace())
  assert example.ep_workspace_errors() == [
      "jax_megamoe symmetric workspace: rank 1 timed out in dispatch"]
  out = tmp_path / "ep"
  with pytest.raises(example.RunError, match=r"step 2: an expert-parallel kernel reported an "
                                             r"error.* it was not saved: .*rank 1 timed out"):
    run(out, "--steps", "4", "--checkpoint-every", "2")
  assert checkpoints_lib.Checkpoints(str(out / "checkpoints"), every=2).steps() == []


def test_ep_workspaces_note_counts_nvlink_workspaces_across_processes(monkeypatch):
  """The run's last line names the NVLink EP workspaces it used, and how many span processes
  (what the two-process GPU test asserts); one-rank and virtual workspaces are not NVLink
  exchanges; none: nothing is added."""
  import types

  from jax_megamoe import symmetric
  ws = lambda ranks, multi, virtual=False, fused_rows=0: types.SimpleNamespace(  # noqa: E731
      num_ranks=ranks, multiprocess=multi, virtual=virtual, fused_rows=fused_rows)
  monkeypatch.setattr(symmetric, "_cache", {})
  monkeypatch.setattr(symmetric, "_retired", [])
  assert example.ep_workspaces_note() == ""
  symmetric._cache.update({("a",): ws(2, True, fused_rows=64), ("b",): ws(1, False),
                           ("c",): ws(4, False, True)})
  symmetric._retired.append(ws(2, False))
  assert example.ep_workspaces_note() == (
      "; NVLink EP workspaces 2 (1 across processes, 1 for the fused kernel)")


# --- resume edge cases and metrics -----------------------------------------------------------

def test_the_compute_copy_is_remade_not_saved(straight, tmp_path):
  """Checkpoints hold the master weights and the optimizer state only: a checkpoint of a run
  with the compute copy (the bf16 default) resumes without it too, continuing the curve within
  the copy's rounding of the LM head's gradient. (Resumed with the copy, remade from the
  checkpoint, a run reproduces its uninterrupted losses:
  test_corrupt_latest_checkpoint_is_named_and_skipped.)"""
  out = copy_run(straight[0], tmp_path)
  shutil.rmtree(out / "checkpoints" / "12")
  run(out, "--resume", "--nocompute-copy")
  resumed, uninterrupted = losses(out), losses(straight[0])
  assert resumed["args"]["compute_copy"] is False and uninterrupted["args"]["compute_copy"]
  assert resumed["ce"][:9] == uninterrupted["ce"][:9]
  assert resumed["ce"] == pytest.approx(uninterrupted["ce"], rel=1e-3)


def test_checkpoints_store_calibrated_selection_statistics(tmp_path, monkeypatch):
  """With --router-selection-norm balance every checkpoint stores the routers' selection
  statistics measured at its own parameters on the inputs of the latest
  --calibration-batches steps (what model.eval() routes with), sharded as the model's."""
  from flax import nnx
  saved, calibrations = {}, []
  original_save, original_calibrate = (checkpoints_lib.Checkpoints.save,
                                       example.calibrate_selection_stats)

  def recording_save(self, step, state):
    saved[step] = state["params"]
    return original_save(self, step, state)

  def recording_calibrate(graphdef, params, batches):
    batches = [np.asarray(b) for b in batches]
    calibrations.append((graphdef, batches))
    return original_calibrate(graphdef, params, batches)

  monkeypatch.setattr(checkpoints_lib.Checkpoints, "save", recording_save)
  monkeypatch.setattr(example, "calibrate_selection_stats", recording_calibrate)
  run(tmp_path, "--steps", "6", "--router-selection-norm", "balance",
      "--calibration-batches", "2")
  assert sorted(saved) == [3, 6] and len(calibrations) == 2
  graphdef, batches = calibrations[-1]
  assert len(batches) == 2 and not np.array_equal(batches[0], batches[1])
  model = nnx.merge(graphdef, saved[6])
  moe = [layer.mlp for layer in model.layers if layer.is_moe]
  # Training mode: the batches' own statistics. Jitted, as there: eagerly the bf16 forward
  # rounds otherwise, and the offsets (solved iteratively) move by ~1e-3.
  stats_of = jax.jit(lambda p, b: nnx.merge(graphdef, p)(b, return_aux=True)[1].selection_stats)
  want = np.mean([np.asarray(stats_of(saved[6], b)) for b in batches], axis=0)
  for row, mlp in enumerate(moe):
    assert mlp.selection_std[...].sharding.is_fully_replicated
    for j, name in enumerate(("selection_mean", "selection_std", "selection_offset")):
      np.testing.assert_allclose(np.asarray(getattr(mlp, name)[...]), want[row, j],
                                 rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(mlp.selection_std[...]), 1.0)


@pytest.mark.parametrize("extra", [["--resume"], ["--resume", "--stop-at", "9"],
                                   ["--resume", "--steps", "5"]])
def test_resume_with_nothing_left_to_run(straight, tmp_path, capsys, extra):
  out = copy_run(straight[0], tmp_path)
  before = (out / "losses.json").read_bytes()
  summary = run(out, *extra)
  assert summary["nothing_to_do"] and summary["resumed_from"] == 12
  assert "nothing to do: the newest checkpoint is step 12" in capsys.readouterr().out
  assert (out / "losses.json").read_bytes() == before


def test_fresh_run_into_a_directory_with_checkpoints_is_refused(straight, tmp_path):
  out = copy_run(straight[0], tmp_path)
  before = (out / "metrics.jsonl").read_bytes()
  with pytest.raises(example.RunError, match=r"already holds checkpoints \(steps \[9, 12\]\).*"
                                             r"pass --resume"):
    run(out)
  assert (out / "metrics.jsonl").read_bytes() == before


def test_read_metrics_keeps_each_step_once(tmp_path):
  path = tmp_path / "metrics.jsonl"
  rows = [{"step": s, "loss": float(s)} for s in (1, 2, 3, 3, 4, 5, 6, 7)]
  rows[3]["loss"] = 30.0  # step 3 written twice (an earlier segment): the later one wins
  path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 8, "lo')
  printed = []
  got = example.read_metrics(str(path), 6, printed.append)
  assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6] and got[2]["loss"] == 30.0
  assert any("line 9 is not JSON" in p for p in printed)
  path.write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] != 2))
  printed.clear()
  assert [r["step"] for r in example.read_metrics(str(path), 3, printed.append)] == [1, 3]
  assert any("no rows for 1 of steps 1..3 (first 2)" in p for p in printed)


# --- the command line ------------------------------------------------------------------------

# Every flag of the argparse version with its default (a changed name or default breaks runs).
# Issue 15 changed two on purpose: --attention auto (cuDNN flash attention where it runs) and
# --ce-chunk unset (chunked above 1 GiB of logits per device); both old values still work.
HISTORICAL_DEFAULTS = {
    "--config": "tiny", "--num-layers": None, "--backend": "auto", "--recipe": None,
    "--dtype": "bfloat16", "--steps": 150, "--batch": 16, "--seq-len": 128, "--lr": 3e-3,
    "--warmup-steps": None, "--min-lr-ratio": 0.1, "--weight-decay": 0.1, "--clip-norm": 1.0,
    "--aux-loss-coef": None, "--z-loss-coef": 1e-3, "--ce-chunk": None, "--remat": "none",
    "--attention": "auto", "--init-from": None, "--data": None, "--mesh": None,
    "--out": "runs/qwen3_moe", "--checkpoint-every": 100, "--resume": False, "--stop-at": None,
    "--seed": 0, "--log-every": 25, "--peak-tflops": None, "--no-progress": False,
    "--compute-copy": None,  # new (issue 15): None = on with bfloat16, off with float32
    # New (issue 15, balance): None = the config's selection bias (off); byte tokens as before.
    "--router-bias-rate": None, "--router-bias-rule": None, "--tokenizer": "bytes",
    # New (session 23): None = the config's (Qwen3's routing).
    "--router-selection-norm": None,
    # New (session 25): calibration of the stored selection statistics.
    "--calibration-batches": 8,
}


def test_every_historical_flag_keeps_its_name_and_default():
  args = vars(example.parse_flags(["train"]))
  assert {f"--{k.replace('_', '-')}": v for k, v in args.items()} == HISTORICAL_DEFAULTS
  dashed = example.parse_flags(["train", "--seq-len", "64", "--stop-at=3", "--no-progress",
                                "--mesh", "data=1,expert=8", "--recipe", "fp8"])
  underscored = example.parse_flags(["train", "--seq_len=64", "--stop_at", "3", "--no_progress",
                                     "--mesh=data=1,expert=8", "--recipe=fp8"])
  assert vars(dashed) == vars(underscored)
  assert (dashed.seq_len, dashed.stop_at, dashed.no_progress, dashed.recipe) == (64, 3, True,
                                                                                "fp8")


@pytest.mark.parametrize("argv,match", [
    (["--log-every", "0"], "--log_every=0: 0 is not a positive integer"),
    (["--stop-at", "0"], "--stop_at=0"),
    (["--stop-at=-2"], "--stop_at=-2"),
    (["--mesh", "data=-2,expert=-4"], "--mesh must look like data=2,expert=4"),
    (["--mesh", "data=2"], "--mesh must look like"),
    (["--clip-norm", "-1"], "--clip_norm must be a finite number > 0"),
    (["--lr", "nan"], "--lr must be a finite number >= 0"),
    (["--weight-decay", "inf"], "--weight_decay must be a finite number"),
    (["--ce-chunk", "48"], "--ce-chunk must be 0 or divide --seq-len"),
    (["--checkpoint-every", "-1"], "--checkpoint_every=-1"),
    (["--steps", "0"], "--steps=0"),
    (["--recipe", "int4"], "--recipe=int4"),
    (["stray"], "unexpected arguments"),
])
def test_bad_flags_are_named(argv, match):
  with pytest.raises(flags.Error, match=match):
    example.parse_flags(["train", *argv])


def test_command_line_reports_bad_flags_and_stops(tmp_path):
  script = os.path.join(ROOT, "examples", "train_qwen3_moe.py")
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  result = subprocess.run([sys.executable, script, "--out", str(tmp_path), "--log-every", "0"],
                          capture_output=True, text=True, timeout=300, env=env)
  assert result.returncode == 1
  assert "--log_every=0: 0 is not a positive integer" in result.stderr
  assert not os.listdir(tmp_path)

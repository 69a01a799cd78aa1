"""Verified training checkpoints for the example: orbax saves, each sealed with a checksum of
every file it wrote, verified before it is restored.

  <out>/checkpoints/<step>/                 one orbax checkpoint of {params, opt_state}
  <out>/checkpoints/<step>/checksums.json   sha256 and size of each of its files
  <out>/rejected_checkpoints/<step>/        a checkpoint that failed verification, moved aside

Saving is asynchronous (orbax); once a save has committed, a background thread hashes its files
and writes checksums.json, and only then removes checkpoints older than the newest `keep`
sealed ones, so a checkpoint is never removed in favour of one that is not yet known to be
whole. A state holding NaN or Inf is refused before it is written.

On restore the newest checkpoint whose files all match their checksums is used. A newer one
that does not match (a flipped bit, a truncated or missing file, no checksums.json because the
run stopped before they were written) is reported, naming the step and the file, and moved to
rejected_checkpoints/ (never deleted); when none matches, nothing is moved and CheckpointError
says what was found. Orbax is imported only when a checkpoint is saved or restored.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

MANIFEST = "checksums.json"
_CHUNK = 8 << 20


class CheckpointError(RuntimeError):
  """A checkpoint could not be written or used; the message names the step, the file and why."""


def file_checksums(directory: str) -> dict[str, dict[str, Any]]:
  """{relative path: {"bytes", "sha256"}} of every file under `directory` but the manifest."""
  return {rel: {"bytes": os.path.getsize(os.path.join(directory, rel)),
                "sha256": _sha256(os.path.join(directory, rel))}
          for rel in sorted(_file_names(directory))}


def _sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(_CHUNK):
      digest.update(chunk)
  return digest.hexdigest()


def write_manifest(directory: str, step: int) -> None:
  """Seals a committed checkpoint directory (atomically: written aside, then renamed)."""
  manifest = {"step": step, "algorithm": "sha256", "files": file_checksums(directory)}
  tmp = os.path.join(directory, MANIFEST + ".tmp")
  with open(tmp, "w") as f:
    json.dump(manifest, f, indent=1)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, os.path.join(directory, MANIFEST))


def verify(directory: str) -> str | None:
  """None when every file of the checkpoint matches checksums.json; else what is wrong,
  naming the file."""
  manifest_path = os.path.join(directory, MANIFEST)
  if not os.path.exists(manifest_path):
    return (f"{manifest_path} does not exist (the run stopped before the checksums were "
            f"written, or an older version of this script wrote the checkpoint), so it cannot "
            f"be verified")
  try:
    with open(manifest_path) as f:
      listed = json.load(f)["files"]
    listed = {str(k): (int(v["bytes"]), str(v["sha256"])) for k, v in listed.items()}
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    return f"{manifest_path} is damaged ({type(e).__name__}: {e})"
  present = _file_names(directory)
  extra = sorted(present - set(listed))
  if extra:
    return (f"{os.path.join(directory, extra[0])} is not in its {MANIFEST} (added after it "
            f"was written)")
  for rel, (size, digest) in listed.items():
    path = os.path.join(directory, rel)
    if rel not in present:
      return f"{path} is missing"
    if os.path.getsize(path) != size:
      return f"{path} has {os.path.getsize(path)} bytes, {size} when it was written"
    if _sha256(path) != digest:
      return f"{path} does not match its checksum (its contents changed after it was written)"
  return None


def _file_names(directory: str) -> set[str]:
  names = set()
  for root, _, files in os.walk(directory):
    names.update(os.path.relpath(os.path.join(root, n), directory) for n in files)
  names.discard(MANIFEST)
  return names


@jax.jit
def _all_finite(arrays: list) -> list:
  return [jnp.all(jnp.isfinite(x)) for x in arrays]


def nonfinite_leaves(state: Any) -> list[str]:
  """Paths of the floating-point leaves of `state` that hold a NaN or an Inf."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(state)
  floats = [(path, x) for path, x in leaves if jnp.issubdtype(x.dtype, jnp.inexact)]
  finite = jax.device_get(_all_finite([x for _, x in floats]))
  return [jax.tree_util.keystr(path) for (path, _), ok in zip(floats, finite) if not ok]


class Checkpoints:
  """The checkpoints of one run directory (see the module doc)."""

  def __init__(self, directory: str, *, every: int, keep: int = 2,
               log: Callable[[str], None] = print):
    self.directory = os.path.abspath(directory)
    self.rejected_directory = os.path.join(os.path.dirname(self.directory),
                                           "rejected_checkpoints")
    self.every, self.keep, self.log = every, keep, log
    self.is_primary = jax.process_index() == 0
    self._manager = None
    self._newest_saved: int | None = None  # this run's last save (it may still be writing)
    self._sealer: threading.Thread | None = None
    self._sealer_error: BaseException | None = None

  # --- what is on disk ------------------------------------------------------------------------

  def steps(self) -> list[int]:
    """Committed checkpoints, oldest first (orbax commits a step by renaming its directory to
    the bare step number)."""
    if not os.path.isdir(self.directory):
      return []
    return sorted(int(n) for n in os.listdir(self.directory)
                  if n.isdigit() and os.path.isdir(os.path.join(self.directory, n)))

  def newest_step(self) -> int | None:
    """The newest checkpoint on disk or being written by this run."""
    return max([*self.steps(), *([self._newest_saved] if self._newest_saved else [])],
               default=None)

  def step_directory(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def _sealed_steps(self) -> list[int]:
    return [s for s in self.steps()
            if os.path.exists(os.path.join(self.step_directory(s), MANIFEST))]

  # --- restore ---------------------------------------------------------------------------------

  def latest_intact_step(self) -> int | None:
    """The newest checkpoint whose files match their checksums (None when there is none at
    all). Newer ones that do not match are reported and moved to rejected_checkpoints/; when
    checkpoints exist but none matches, CheckpointError (and nothing is moved)."""
    steps = self.steps()
    if not steps:
      return None
    problems, chosen = {}, None
    if self.is_primary:
      for step in reversed(steps):
        problem = verify(self.step_directory(step))
        if problem is None:
          chosen = step
          break
        problems[step] = problem
    chosen = _broadcast_step(chosen)
    if chosen is None:
      found = "; ".join(f"step {s}: {p}" for s, p in problems.items()) or "see process 0"
      raise CheckpointError(
          f"no checkpoint in {self.directory} is intact, nothing to resume from ({found}). "
          f"Nothing was changed; move the directory away (or pick another --out) to start over")
    for step, problem in problems.items():
      destination = self._reject(step)
      self.log(f"checkpoint step {step} is not usable: {problem}. Moved it to {destination}; "
               f"falling back to step {chosen}")
    _barrier("megamoe_example_checkpoints_rejected")
    return chosen

  def restore(self, step: int, like: dict) -> dict:
    """Checkpoint `step` (one latest_intact_step chose), laid out like `like`."""
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like)
    ocp = _orbax()
    try:
      return self._orbax_manager().restore(step, args=ocp.args.StandardRestore(abstract))
    except Exception as e:  # orbax/tensorstore errors: one line, not their whole cascade
      raise CheckpointError(
          f"checkpoint step {step} ({self.step_directory(step)}) matches its checksums but "
          f"could not be restored into this model: {_first_line(e)} (was it written with "
          f"other --config, --num-layers or --init-from?). Nothing was changed") from None

  def _reject(self, step: int) -> str:
    destination = os.path.join(self.rejected_directory, str(step))
    n = 1
    while os.path.exists(destination):
      destination = os.path.join(self.rejected_directory, f"{step}.{n}")
      n += 1
    if self.is_primary:
      os.makedirs(self.rejected_directory, exist_ok=True)
      shutil.move(self.step_directory(step), destination)
    return destination

  # --- save ------------------------------------------------------------------------------------

  def due(self, step: int, last: bool) -> bool:
    return self.every > 0 and (step % self.every == 0 or last)

  def save(self, step: int, state: dict) -> None:
    """Starts saving `state` as checkpoint `step` (returns before it is written); it is sealed
    with its checksums once committed. Refuses a state with NaN or Inf values."""
    self._wait_for_sealer()
    bad = nonfinite_leaves(state)
    if bad:
      raise CheckpointError(
          f"not saving step {step}: {len(bad)} arrays of the state hold NaN or Inf, e.g. "
          f"{', '.join(bad[:3])}; the newest checkpoint stays step {self.newest_step()}")
    ocp = _orbax()
    if not self._orbax_manager().save(step, args=ocp.args.StandardSave(state)):
      raise CheckpointError(f"orbax did not save step {step} (a checkpoint of a later step "
                            f"exists in {self.directory}?)")
    self._newest_saved = step
    self._sealer = threading.Thread(target=self._seal, args=(step,), name=f"seal-{step}")
    self._sealer.start()

  def _seal(self, step: int) -> None:
    """Background: waits for the commit, writes checksums.json, then removes old checkpoints."""
    try:
      self._manager.wait_until_finished()
      directory = self.step_directory(step)
      if self.is_primary:
        if not os.path.isdir(directory):
          raise CheckpointError(f"checkpoint step {step} was not committed to {directory} (see "
                                f"orbax's log)")
        write_manifest(directory, step)
        self._remove_older_than_kept()
    except BaseException as e:  # reported by the next save() or close()
      self._sealer_error = e

  def _remove_older_than_kept(self) -> None:
    sealed = self._sealed_steps()
    if len(sealed) < self.keep:
      return
    oldest_kept = sealed[-self.keep]
    for step in self.steps():
      if step < oldest_kept:
        shutil.rmtree(self.step_directory(step))

  def _wait_for_sealer(self) -> None:
    if self._sealer is not None:
      self._sealer.join()
      self._sealer = None
    if self._sealer_error is not None:
      error, self._sealer_error = self._sealer_error, None
      if isinstance(error, CheckpointError):
        raise error
      raise CheckpointError(f"writing a checkpoint failed: {_first_line(error)}") from error

  def close(self) -> None:
    """Waits until the last checkpoint is written and sealed."""
    try:
      self._wait_for_sealer()
    finally:
      if self._manager is not None:
        self._manager.close()
        self._manager = None

  def _orbax_manager(self):
    if self._manager is None:
      ocp = _orbax()
      # max_to_keep=None: old checkpoints are removed here, after the new one is sealed
      # (orbax would remove them as soon as a save finishes, even a failed one).
      self._manager = ocp.CheckpointManager(
          self.directory, options=ocp.CheckpointManagerOptions(
              max_to_keep=None, create=True, cleanup_tmp_directories=True))
    return self._manager


def _orbax():
  import orbax.checkpoint as ocp
  return ocp


def _first_line(error: BaseException) -> str:
  text = str(error).strip() or type(error).__name__
  return text.splitlines()[0][:500].rstrip(":")


def _broadcast_step(step: int | None) -> int | None:
  """Process 0's choice, on every process (-1 stands for none)."""
  if jax.process_count() == 1:
    return step
  from jax.experimental import multihost_utils
  value = int(multihost_utils.broadcast_one_to_all(np.int64(-1 if step is None else step)))
  return None if value < 0 else value


def _barrier(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)

"""CUDA IPC handles of symmetric workspaces, exchanged between processes through a key-value store.

A workspace is usually created while `moe` is traced (inside `jax.jit`), where a host collective
such as `multihost_utils.process_allgather` cannot run (it needs concrete arrays, not tracers).
jax.distributed's key-value store -- the coordination service every process of a run is already
connected to -- is plain host RPC: it works inside a trace, and every wait on it is bounded. A
process only talks to the processes of its own EP groups: a group inside one process needs no
exchange at all (e.g. a data=2, expert=1 mesh over two processes).

Keys of the n-th workspace this process creates over EP group G (G: the group's device ids in rank
order joined by '-'; n is counted per group, so processes that create the same workspaces in the
same order agree on it):

  jax_megamoe/ep_ws/<G>/<n>/share/<device id>   that device's record: process, rank, workspace
                                                spec, CUDA IPC handle -- or the error that stopped
                                                its process before it had one
  jax_megamoe/ep_ws/<G>/<n>/ready/<device id>   its process mapped every peer (or why it could not)
  jax_megamoe/ep_ws/<G>/<n>/closed/<device id>  its process unmapped its peers (close)

Each process checks its peers' records against its own: a different size is an error (the kernels
would disagree on the layout); a different workspace id (the processes created other workspaces
before this one, so their compiled programs differ) is a warning, or an error with
`strict_ids`. A peer that never publishes makes the wait end after `timeout_s` with a message that
names it. Keys stay in the store for the life of the run (a few hundred bytes per device and
workspace).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
import warnings
from typing import Protocol

from jax_megamoe import env_overrides

KEY_PREFIX = "jax_megamoe/ep_ws"
TIMEOUT_ENV = "MEGAMOE_EP_HANDSHAKE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0  # processes reach their first trace minutes apart at worst (data, compile)


class KeyValueStore(Protocol):
  """What the exchange needs of a store: set a new key, wait (bounded) for one."""

  def set(self, key: str, value: str) -> None: ...

  def get(self, key: str, timeout_s: float) -> str:
    """The key's value once it is set; raises TimeoutError after timeout_s."""


class DistributedStore:
  """jax.distributed's key-value store. The client is looked up at every call, so one that
  `jax.distributed.shutdown()` closed is never used (a clear RuntimeError instead)."""

  @staticmethod
  def _client():
    # jax 0.10.2 and 0.11.2 have no public spelling of the client (jax.distributed exports
    # initialize, is_initialized and shutdown only); jax's own checkpointing uses this one.
    from jax._src import distributed
    client = distributed.global_state.client
    if client is None:
      raise RuntimeError(
          "jax_megamoe symmetric workspace: this EP group spans several processes, but "
          "jax.distributed is not initialised (or was shut down): the processes' CUDA IPC "
          "handles are exchanged through its key-value store")
    return client

  def set(self, key: str, value: str) -> None:
    self._client().key_value_set(key, value)

  def get(self, key: str, timeout_s: float) -> str:
    client = self._client()
    try:
      return client.blocking_key_value_get(key, max(1, int(timeout_s * 1000)))
    except Exception as e:  # jax.errors.JaxRuntimeError; its class moved between versions
      if "DEADLINE_EXCEEDED" in str(e):
        raise TimeoutError(str(e)) from None
      raise


def timeout_from_env(timeout_s: float | None) -> float:
  """timeout_s, else MEGAMOE_EP_HANDSHAKE_TIMEOUT_S, else 300 s; must be > 0."""
  if timeout_s is None:
    timeout_s = env_overrides.positive_seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)
  if not timeout_s > 0:
    raise ValueError(f"handshake_timeout_s must be > 0 seconds, got {timeout_s}")
  return float(timeout_s)


@dataclasses.dataclass(frozen=True)
class WorkspaceSpec:
  """What every rank of a workspace must agree on (and the id its programs carry)."""
  workspace_id: int
  num_ranks: int
  max_tokens: int
  hidden: int
  top_k: int
  elem_bytes: int
  comm_blocks: int  # the receivers wait on one signal per sending block
  fused_rows: int = 0  # rows of the fused kernel's pool (0: no fused regions)

  def layout_differences(self, other: WorkspaceSpec) -> list[str]:
    return [f"{f.name}={getattr(other, f.name)} (here {getattr(self, f.name)})"
            for f in dataclasses.fields(self)
            if f.name != "workspace_id" and getattr(self, f.name) != getattr(other, f.name)]


class Sequences:
  """How many workspaces this process created per EP group: the <n> of the keys."""

  def __init__(self):
    self._lock = threading.Lock()
    self._next: dict[tuple[int, ...], int] = {}

  def take(self, group: tuple[int, ...]) -> int:
    with self._lock:
      n = self._next.get(group, 0)
      self._next[group] = n + 1
      return n


@dataclasses.dataclass(frozen=True)
class GroupExchange:
  """This process's part in the handshake of one workspace over one EP group that spans
  processes."""
  devices: tuple[int, ...]    # device ids, rank order
  processes: tuple[int, ...]  # process index of each rank
  sequence: int
  process_index: int          # this process

  @property
  def local_ranks(self) -> list[int]:
    return [r for r, p in enumerate(self.processes) if p == self.process_index]

  @property
  def remote_ranks(self) -> list[int]:
    return [r for r, p in enumerate(self.processes) if p != self.process_index]

  def key(self, phase: str, rank: int) -> str:
    group = "-".join(map(str, self.devices))
    return f"{KEY_PREFIX}/{group}/{self.sequence}/{phase}/{self.devices[rank]}"

  def describe(self, rank: int) -> str:
    return (f"process {self.processes[rank]} (device {self.devices[rank]}, rank {rank} of EP "
            f"group {self.devices})")

  def workspace_name(self) -> str:
    return f"workspace #{self.sequence} of EP group {self.devices}"


def plan(groups, process_index: int, sequences: Sequences) -> list[GroupExchange]:
  """The exchanges this process takes part in: its EP groups that span processes (rows of
  `groups`, [num_groups, R] devices with .id and .process_index). Takes a sequence number per
  such group: call once per workspace, on every process, in the same order."""
  out = []
  for row in groups:
    procs = tuple(int(d.process_index) for d in row)
    if process_index not in procs or all(p == process_index for p in procs):
      continue
    devices = tuple(int(d.id) for d in row)
    out.append(GroupExchange(devices, procs, sequences.take(devices), process_index))
  return out


def _record(**fields) -> str:
  return json.dumps(fields, sort_keys=True)


def _wait(store: KeyValueStore, ex: GroupExchange, phase: str, rank: int, deadline: float,
          timeout_s: float, what: str) -> dict:
  key = ex.key(phase, rank)
  try:
    value = store.get(key, max(0.001, deadline - time.monotonic()))
  except TimeoutError:
    raise RuntimeError(
        f"jax_megamoe symmetric workspace: {ex.describe(rank)} did not {what} "
        f"{ex.workspace_name()} within {timeout_s:g} s ({TIMEOUT_ENV}; key {key}). Every process "
        f"of an EP group must create the same workspaces in the same order (trace the same moe "
        f"layers, or call symmetric.create_workspace on every process); a process that died or "
        f"is stuck before this point looks the same.") from None
  except Exception as e:  # e.g. the coordination service reports that a process died
    raise RuntimeError(f"jax_megamoe symmetric workspace: waiting for {ex.describe(rank)} to "
                       f"{what} {ex.workspace_name()} failed (key {key}): {e}") from e
  try:
    return json.loads(value)
  except ValueError:
    raise RuntimeError(f"jax_megamoe symmetric workspace: key {key} holds {value[:80]!r}, not a "
                       f"record of this version of jax_megamoe") from None


def publish_shares(store: KeyValueStore, exchanges: list[GroupExchange], spec: WorkspaceSpec,
                   handles: dict[int, bytes]) -> None:
  """Publishes this process's CUDA IPC handle of each of its devices (handles by device id)."""
  visible = os.environ.get("CUDA_VISIBLE_DEVICES")
  for ex in exchanges:
    for r in ex.local_ranks:
      store.set(ex.key("share", r), _record(
          process=ex.process_index, device=ex.devices[r], rank=r, spec=dataclasses.asdict(spec),
          handle=handles[ex.devices[r]].hex(), error=None, cuda_visible_devices=visible))


def publish_failure(store: KeyValueStore, exchanges: list[GroupExchange], message: str) -> None:
  """Tells the peers why this process gave up on the workspace, under every key of this
  handshake it has not set yet (best effort: they fail at once instead of after the timeout)."""
  for ex in exchanges:
    for r in ex.local_ranks:
      for phase in ("share", "ready"):
        try:
          store.set(ex.key(phase, r), _record(process=ex.process_index, device=ex.devices[r],
                                              rank=r, error=message))
        except Exception:  # already set, or the store is gone: the peers' timeout still holds
          pass


def collect_shares(store: KeyValueStore, exchanges: list[GroupExchange], spec: WorkspaceSpec,
                   timeout_s: float, strict_ids: bool = False) -> dict[int, bytes]:
  """Waits for every remote peer's record (at most timeout_s in all) and checks it against
  `spec`; returns their CUDA IPC handles by device id."""
  deadline = time.monotonic() + timeout_s
  handles: dict[int, bytes] = {}
  for ex in exchanges:
    for r in ex.remote_ranks:
      rec = _wait(store, ex, "share", r, deadline, timeout_s, "publish its share of")
      who = ex.describe(r)
      if rec.get("error"):
        raise RuntimeError(f"jax_megamoe symmetric workspace: {who} could not create its share "
                           f"of {ex.workspace_name()}: {rec['error']}")
      if rec.get("device") != ex.devices[r] or rec.get("rank") != r:
        raise RuntimeError(f"jax_megamoe symmetric workspace: the record under "
                           f"{ex.key('share', r)} is for device {rec.get('device')}, rank "
                           f"{rec.get('rank')}")
      theirs = WorkspaceSpec(**rec["spec"])
      differences = spec.layout_differences(theirs)
      if differences:
        raise RuntimeError(
            f"jax_megamoe symmetric workspace: {who} created {ex.workspace_name()} with "
            f"{', '.join(differences)}: the processes traced different programs, or created "
            f"workspaces in a different order. Create the same workspaces in the same order on "
            f"every process.")
      if theirs.workspace_id != spec.workspace_id:
        message = (f"jax_megamoe symmetric workspace: {ex.workspace_name()} has id "
                   f"{spec.workspace_id} in this process (process {ex.process_index}) but id "
                   f"{theirs.workspace_id} in {who}: the processes created different workspaces "
                   f"before it, so their compiled programs differ (each carries its own id)")
        if strict_ids:
          raise RuntimeError(message + "; with jax_share_binary_between_hosts one process's "
                             "program runs everywhere, so the ids must agree")
        warnings.warn(message, RuntimeWarning, stacklevel=3)
      handles[ex.devices[r]] = bytes.fromhex(rec["handle"])
  return handles


def publish_ready(store: KeyValueStore, exchanges: list[GroupExchange]) -> None:
  for ex in exchanges:
    for r in ex.local_ranks:
      store.set(ex.key("ready", r), _record(process=ex.process_index, device=ex.devices[r],
                                            rank=r, error=None))


def wait_ready(store: KeyValueStore, exchanges: list[GroupExchange], timeout_s: float) -> None:
  """Waits until every remote peer mapped its peers (raises with the peer's error if one could
  not): after this no process of the group gives up on the workspace while the others use it."""
  deadline = time.monotonic() + timeout_s
  for ex in exchanges:
    for r in ex.remote_ranks:
      rec = _wait(store, ex, "ready", r, deadline, timeout_s, "finish connecting")
      if rec.get("error"):
        raise RuntimeError(f"jax_megamoe symmetric workspace: {ex.describe(r)} could not map "
                           f"its peers of {ex.workspace_name()}: {rec['error']}")


def publish_closed(store: KeyValueStore, exchanges: list[GroupExchange]) -> None:
  """This process unmapped its peers' memory and runs no kernel of the workspace any more."""
  for ex in exchanges:
    for r in ex.local_ranks:
      store.set(ex.key("closed", r), _record(process=ex.process_index, device=ex.devices[r],
                                             rank=r, error=None))


def wait_closed(store: KeyValueStore, exchanges: list[GroupExchange],
                timeout_s: float) -> list[str]:
  """Waits (at most timeout_s in all) for every remote peer to close; returns the peers that did
  not (empty: this process may free its memory, no peer can write into it any more)."""
  deadline = time.monotonic() + timeout_s
  missing = []
  for ex in exchanges:
    for r in ex.remote_ranks:
      try:
        store.get(ex.key("closed", r), max(0.001, deadline - time.monotonic()))
      except TimeoutError:
        missing.append(ex.describe(r))
  return missing

"""Stand-ins for the workspace C ABI and the key-value store, so the handshake of
jax_megamoe.symmetric runs on CPU: FakeWorkspaceLib records what the real
megamoe_ep_ws_* functions would be asked (same arguments, ctypes buffers included) and hands out
recognisable CUDA IPC handles; FakeStore is an in-memory, thread-safe KeyValueStore."""

from __future__ import annotations

import ctypes
import dataclasses
import threading

HANDLE_BYTES = 64


def fake_handle(process: int, ordinal: int, ws_id: int) -> bytes:
  return f"p{process}d{ordinal}ws{ws_id}".encode().ljust(HANDLE_BYTES, b"\0")


class FakeWorkspaceLib:
  """One process's native workspace registry. fail={"alloc"|"connect": message} makes that call
  fail as the real one would (return 1, message in the buffer)."""

  def __init__(self, process: int, first_id: int = 1, fail: dict[str, str] | None = None):
    self.process, self.next_id, self.fail = process, first_id, dict(fail or {})
    self.lock = threading.Lock()
    self.created, self.freed, self.closed_peers = [], [], []
    self.connects = []  # (ws_id, ordinal, peer_rank, peer_ordinal, handle or None)

  def _failed(self, name, msg, length) -> int:
    if name not in self.fail:
      return 0
    if msg is not None:
      ctypes.memmove(msg, self.fail[name].encode()[:length - 1] + b"\0",
                     min(length, len(self.fail[name]) + 1))
    return 1

  def megamoe_ep_ws_new(self, num_ranks, max_tokens, hidden, top_k, elem_bytes, fused_rows,
                        comm_blocks, timeout_s, out_id, msg, length):
    with self.lock:
      out_id._obj.value = self.next_id
      self.created.append(self.next_id)
      self.next_id += 1
    return 0

  def megamoe_ep_ws_alloc(self, ws_id, ordinal, rank, ipc_out, msg, length):
    if self._failed("alloc", msg, length):
      return 1
    ctypes.memmove(ipc_out, fake_handle(self.process, ordinal, ws_id), HANDLE_BYTES)
    return 0

  def megamoe_ep_ws_connect(self, ws_id, ordinal, peer_rank, peer_ordinal, handle, msg, length):
    if peer_ordinal < 0 and self._failed("connect", msg, length):
      return 1
    with self.lock:
      self.connects.append((ws_id, ordinal, peer_rank, peer_ordinal,
                            None if handle is None else bytes(handle)))
    return 0

  def megamoe_ep_ws_finalize(self, ws_id, msg, length):
    return 0

  def megamoe_ep_ws_error(self, ws_id, msg, length):
    return 0

  def megamoe_ep_ws_close_peers(self, ws_id, msg, length):
    self.closed_peers.append(ws_id)
    return 0

  def megamoe_ep_ws_free(self, ws_id, msg, length):
    self.freed.append(ws_id)
    return 0


class FakeStore:
  """An in-memory KeyValueStore (set once, wait for a key with a timeout)."""

  def __init__(self):
    self.values: dict[str, str] = {}
    self.cv = threading.Condition()

  def set(self, key: str, value: str) -> None:
    with self.cv:
      if key in self.values:
        raise RuntimeError(f"ALREADY_EXISTS: key {key} already exists")
      self.values[key] = value
      self.cv.notify_all()

  def get(self, key: str, timeout_s: float) -> str:
    with self.cv:
      if not self.cv.wait_for(lambda: key in self.values, timeout_s):
        raise TimeoutError(f"DEADLINE_EXCEEDED: {key}")
      return self.values[key]


class UnusableStore:
  """A store that must not be touched (layouts that need no exchange)."""

  def set(self, key, value):
    raise AssertionError(f"the store was used: set {key}")

  def get(self, key, timeout_s):
    raise AssertionError(f"the store was used: get {key}")


@dataclasses.dataclass(frozen=True)
class FakeDevice:
  id: int
  process_index: int
  local_hardware_id: int = 0
  platform: str = "gpu"


@dataclasses.dataclass
class FakeMesh:
  devices: object  # numpy object array of FakeDevice
  axis_names: tuple[str, ...]

"""The multi-process handshake of symmetric workspaces, on CPU: simulated processes (threads, each
with its own fake native registry and process index) create and close workspaces through one
in-memory key-value store. Covers which layouts need an exchange, mismatches, missing or failing
peers, and close without a collective."""

import concurrent.futures
import os
import sys
import threading
import time
import warnings

import numpy as np
import pytest

from fake_workspace_lib import (FakeDevice, FakeMesh, FakeStore, FakeWorkspaceLib, UnusableStore,
                                fake_handle)
from jax_megamoe import ipc_exchange, symmetric
from subprocesses import TESTS, free_port, run_all

SIZES = dict(max_tokens=32, hidden=64, top_k=2, dtype="float32", comm_blocks=8, timeout_s=1.0)


class Processes:
  """Runs one function per simulated process, concurrently, each seeing its own process index,
  native library and workspace counters through symmetric's hooks."""

  def __init__(self, monkeypatch, libs):
    self.libs = libs
    self.local = threading.local()
    self.sequences = {p: ipc_exchange.Sequences() for p in libs}
    local = self.local
    monkeypatch.setattr(symmetric, "_library", lambda: local.lib)
    monkeypatch.setattr(symmetric, "_this_process", lambda: local.process)

    class PerProcessSequences:
      def take(_, group):
        return self.sequences[local.process].take(group)

    monkeypatch.setattr(symmetric, "_sequences", PerProcessSequences())

  def run(self, fns: dict):
    """fns: {process: fn()} -> {process: result or the exception it raised}."""
    def call(process, fn):
      self.local.process, self.local.lib = process, self.libs[process]
      try:
        return fn()
      except Exception as e:  # returned, so each process's outcome can be checked
        return e

    with concurrent.futures.ThreadPoolExecutor(len(fns)) as pool:
      futures = {p: pool.submit(call, p, fn) for p, fn in fns.items()}
      return {p: f.result(timeout=60) for p, f in futures.items()}


def _mesh(device_rows, axis_names):
  devices = np.empty((len(device_rows), len(device_rows[0])), object)
  for i, row in enumerate(device_rows):
    for j, (dev_id, process) in enumerate(row):
      devices[i, j] = FakeDevice(dev_id, process, local_hardware_id=dev_id % 2)
  return FakeMesh(devices, axis_names)


def _create(mesh, store, **kw):
  return lambda: symmetric.create_workspace(mesh, "expert", store=store, **(SIZES | kw))


def test_ep_group_across_processes_exchanges_handles_and_closes(monkeypatch):
  procs = Processes(monkeypatch, {0: FakeWorkspaceLib(0), 1: FakeWorkspaceLib(1)})
  mesh = _mesh([[(0, 0), (1, 1)]], ("data", "expert"))  # data=1, expert=2, one GPU per process
  store = FakeStore()
  ws = procs.run({p: _create(mesh, store) for p in (0, 1)})
  for p in (0, 1):
    assert isinstance(ws[p], symmetric.SymmetricWorkspace), ws[p]
    assert ws[p].multiprocess and ws[p].id == 1
    peer = 1 - p
    # The peer's handle, opened through IPC (peer ordinal -1), on this process's device.
    assert procs.libs[p].connects == [(1, p % 2, peer, -1, fake_handle(peer, peer % 2, 1))]
  assert sorted(k.rsplit("/", 2)[1] for k in store.values) == ["ready"] * 2 + ["share"] * 2
  assert all(k.startswith("jax_megamoe/ep_ws/0-1/0/") for k in store.values)

  start = time.monotonic()
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # freeing must not fall back to "kept allocated"
    out = procs.run({p: ws[p].close for p in (0, 1)})
  assert out == {0: None, 1: None}
  assert time.monotonic() - start < 5
  for p in (0, 1):
    assert ws[p].closed and procs.libs[p].freed == [1] and procs.libs[p].closed_peers == [1]


def test_groups_inside_processes_need_no_exchange(monkeypatch):
  """data=2, expert=1 over two processes (only data parallelism crosses processes), and
  data=2, expert=2 over 2 processes x 2 GPUs with each EP group inside one process: the store
  is never touched, whatever the other groups of the mesh do."""
  procs = Processes(monkeypatch, {0: FakeWorkspaceLib(0), 1: FakeWorkspaceLib(1)})
  for rows in ([[(0, 0)], [(1, 1)]], [[(0, 0), (1, 0)], [(2, 1), (3, 1)]]):
    mesh = _mesh(rows, ("data", "expert"))
    ws = procs.run({p: _create(mesh, UnusableStore()) for p in (0, 1)})
    for p in (0, 1):
      assert isinstance(ws[p], symmetric.SymmetricWorkspace), ws[p]
      assert not ws[p].multiprocess
    procs.run({p: ws[p].close for p in (0, 1)})
  # The 2 x 2 case connects each GPU to its neighbour in the same process by peer access.
  assert procs.libs[0].connects == [(2, 0, 1, 1, None), (2, 1, 0, 0, None)]
  assert procs.libs[1].freed == [1, 2]


def test_two_gpus_per_process_with_ep_across_processes(monkeypatch):
  """EP groups (0, 2) and (1, 3): each process exchanges over both of its groups."""
  procs = Processes(monkeypatch, {0: FakeWorkspaceLib(0), 1: FakeWorkspaceLib(1)})
  mesh = _mesh([[(0, 0), (1, 0)], [(2, 1), (3, 1)]], ("expert", "data"))
  store = FakeStore()
  ws = procs.run({p: _create(mesh, store) for p in (0, 1)})
  assert all(w.multiprocess for w in ws.values()), ws
  groups = sorted({k.split("/")[2] for k in store.values})
  assert groups == ["0-2", "1-3"]
  assert sorted(c[4] for c in procs.libs[0].connects) == [fake_handle(1, 0, 1),
                                                         fake_handle(1, 1, 1)]
  # A second workspace of the same mesh is #1 of each group on both processes.
  ws2 = procs.run({p: _create(mesh, store, max_tokens=64) for p in (0, 1)})
  assert all(isinstance(w, symmetric.SymmetricWorkspace) for w in ws2.values()), ws2
  assert any(k.startswith("jax_megamoe/ep_ws/0-2/1/share/") for k in store.values)


def test_mismatched_sizes_are_reported_and_freed(monkeypatch):
  procs = Processes(monkeypatch, {0: FakeWorkspaceLib(0), 1: FakeWorkspaceLib(1)})
  mesh = _mesh([[(0, 0), (1, 1)]], ("data", "expert"))
  store = FakeStore()
  out = procs.run({0: _create(mesh, store, max_tokens=32),
                   1: _create(mesh, store, max_tokens=64)})
  assert isinstance(out[0], RuntimeError)
  assert "process 1 (device 1, rank 1 of EP group (0, 1)) created workspace #0" in str(out[0])
  assert "max_tokens=64 (here 32)" in str(out[0])
  assert "max_tokens=32 (here 64)" in str(out[1])
  assert procs.libs[0].freed == [1] and procs.libs[1].freed == [1]


def test_missing_peer_ends_the_wait_with_its_name(monkeypatch):
  procs = Processes(monkeypatch, {0: FakeWorkspaceLib(0)})
  mesh = _mesh([[(0, 0), (1, 1)]], ("data", "expert"))
  start = time.monotonic()
  out = procs.run({0: _create(mesh, FakeStore(), handshake_timeout_s=0.3)})
  assert time.monotonic() - start < 5
  message = str(out[0])
  assert isinstance(out[0], RuntimeError), out[0]
  assert ("process 1 (device 1, rank 1 of EP group (0, 1)) did not publish its share of "
          "workspace #0 of EP group (0, 1) within 0.3 s (MEGAMOE_EP_HANDSHAKE_TIMEOUT_S") in message
  assert procs.libs[0].freed == [1]


@pytest.mark.parametrize("stage", ["alloc", "connect"])
def test_a_failing_peer_stops_the_others_at_once(monkeypatch, stage):
  procs = Processes(monkeypatch, {0: FakeWorkspaceLib(0),
                                  1: FakeWorkspaceLib(1, fail={stage: "cuda says no"})})
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
  mesh = _mesh([[(0, 0), (1, 1)]], ("data", "expert"))
  store = FakeStore()
  start = time.monotonic()
  out = procs.run({p: _create(mesh, store, handshake_timeout_s=30) for p in (0, 1)})
  assert time.monotonic() - start < 10  # not the 30 s timeout
  assert "cuda says no" in str(out[1]) and "cuda says no" in str(out[0])
  what = "could not create its share" if stage == "alloc" else "could not map its peers"
  assert f"process 1 (device 1, rank 1 of EP group (0, 1)) {what}" in str(out[0])
  if stage == "connect":  # the hint for per-process CUDA_VISIBLE_DEVICES
    assert "local_device_ids" in str(out[1]) and "CUDA_VISIBLE_DEVICES=1" in str(out[1])
  assert procs.libs[0].freed == [1] and procs.libs[1].freed == [1]


def test_different_workspace_ids_warn_or_raise(monkeypatch):
  """Process 1 created another workspace before: same layout, different id."""
  procs = Processes(monkeypatch, {0: FakeWorkspaceLib(0), 1: FakeWorkspaceLib(1, first_id=5)})
  mesh = _mesh([[(0, 0), (1, 1)]], ("data", "expert"))
  store = FakeStore()
  with pytest.warns(RuntimeWarning, match="has id") as record:
    out = procs.run({p: _create(mesh, store, handshake_timeout_s=10) for p in (0, 1)})
  messages = sorted(str(w.message) for w in record)
  assert "has id 1 in this process (process 0) but id 5 in process 1" in messages[0]
  assert "has id 5 in this process (process 1) but id 1 in process 0" in messages[1]
  assert all(isinstance(w, symmetric.SymmetricWorkspace) for w in out.values()), out
  monkeypatch.setattr(symmetric, "_programs_shared_between_processes", lambda: True)
  out = procs.run({p: _create(mesh, store, handshake_timeout_s=10) for p in (0, 1)})
  assert "jax_share_binary_between_hosts" in str(out[0]) and "ids must agree" in str(out[1])


def test_close_never_waits_forever_nor_frees_under_a_live_peer(monkeypatch):
  procs = Processes(monkeypatch, {0: FakeWorkspaceLib(0), 1: FakeWorkspaceLib(1)})
  mesh = _mesh([[(0, 0), (1, 1)]], ("data", "expert"))
  store = FakeStore()
  ws = procs.run({p: _create(mesh, store) for p in (0, 1)})
  start = time.monotonic()
  with pytest.warns(RuntimeWarning, match=r"process 1 \(device 1.*did not close it within 0.2 s"):
    procs.run({0: lambda: ws[0].close(timeout_s=0.2)})
  assert time.monotonic() - start < 5
  assert ws[0].closed and procs.libs[0].freed == []  # kept: process 1 may still write into it
  procs.run({1: lambda: ws[1].close(timeout_s=5)})  # process 0 already said it closed
  assert procs.libs[1].freed == [1]


def test_processes_closing_in_different_orders_do_not_wait_on_each_other(monkeypatch):
  procs = Processes(monkeypatch, {0: FakeWorkspaceLib(0), 1: FakeWorkspaceLib(1)})
  mesh = _mesh([[(0, 0), (1, 1)]], ("data", "expert"))
  store = FakeStore()
  a = procs.run({p: _create(mesh, store) for p in (0, 1)})
  b = procs.run({p: _create(mesh, store, hidden=128) for p in (0, 1)})
  start = time.monotonic()
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    procs.run({0: lambda: symmetric._close([a[0], b[0]], 3.0),
               1: lambda: symmetric._close([b[1], a[1]], 3.0)})
  assert time.monotonic() - start < 2.5
  assert sorted(procs.libs[0].freed) == [1, 2] and sorted(procs.libs[1].freed) == [1, 2]


def test_handshake_timeout_setting(monkeypatch):
  monkeypatch.setenv("MEGAMOE_EP_HANDSHAKE_TIMEOUT_S", "12.5")
  assert ipc_exchange.timeout_from_env(None) == 12.5
  assert ipc_exchange.timeout_from_env(3) == 3.0
  monkeypatch.setenv("MEGAMOE_EP_HANDSHAKE_TIMEOUT_S", "soon")
  with pytest.raises(ValueError, match="MEGAMOE_EP_HANDSHAKE_TIMEOUT_S must be a positive "
                                       "number of seconds, got 'soon'"):
    ipc_exchange.timeout_from_env(None)
  with pytest.raises(ValueError, match="handshake_timeout_s must be > 0 seconds, got 0"):
    ipc_exchange.timeout_from_env(0)


def test_distributed_store_needs_jax_distributed():
  with pytest.raises(RuntimeError, match="jax.distributed is not initialised"):
    ipc_exchange.DistributedStore().get("anything", 0.1)


def test_two_real_processes_exchange_inside_jit_through_jax_distributed():
  """jax.distributed on CPU (2 processes x 1 device): workspace_for called while jax.jit traces,
  the handles through jax's key-value store, data=2, expert=1 without exchange, close_all."""
  port = free_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
             PYTHONPATH=os.pathsep.join([str(TESTS), str(TESTS.parent),
                                         os.environ.get("PYTHONPATH", "")]))
  env.pop("XLA_FLAGS", None)  # one CPU device per process
  procs, outs = run_all([[sys.executable, "-m", "ipc_exchange_worker", str(i), str(port)]
                         for i in range(2)], [env, env], timeout=180, cwd=str(TESTS))
  for i, (p, out) in enumerate(zip(procs, outs)):
    assert p.returncode == 0 and f"IPC-EXCHANGE-OK {i}" in out, f"process {i}:\n{out[-4000:]}"


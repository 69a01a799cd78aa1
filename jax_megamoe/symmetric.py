"""Symmetric workspaces for expert-parallel dispatch/combine over NVLink.

One workspace serves every expert-parallel (EP) group of a mesh: each GPU of a group gets one
`cudaMalloc` allocation of identical layout (see `workspace_bytes`), zeroed, mapped on every other
GPU of its group -- through peer access when one process drives the GPUs (JAX's default on a
host), through CUDA IPC handles exchanged over jax.distributed's key-value store when a group
spans processes (one process per GPU; jax_megamoe.ipc_exchange). Kernels find their GPU's view by
(workspace id, device ordinal): the id travels into the compiled program as a static int64
attribute of the custom calls, the rank of a GPU is its position along the expert axis of the mesh.

Lifecycle: `create_workspace` up front (the allocation happens where you choose), or let
`jax_megamoe.backends.cuda_ep` create one while tracing (`workspace_for`, cached per mesh and
size); both work in every process model, inside or outside `jax.jit`. Use it from any number of
compiled programs, `close()` when no program that uses it will run again. A workspace is never
resized: a larger problem gets a new one. With several processes, every process of an EP group
must create (and close) the same workspaces in the same order -- as SPMD programs that trace the
same layers do; a mismatch is reported, a missing peer ends the wait after a timeout with its name.
Memory per GPU, R ranks, T max tokens per rank, H hidden, k top-k, b bytes per element:
  2 * R * T * H * b      (dispatch-shaped and combine-shaped row pools)
+ 3 * R * T * k * 4      (routing ids, weights, per-slot scalars)
+ 512                    (signal counters)
e.g. R=2, T=16384, H=2048, k=8, bf16: 256 MiB + 3 MiB; R=8, H=4096: 2 GiB.

Receive slots are (source rank, token): a token travels at most once to each rank, so the pools
cannot overflow for any routing; `max_tokens` is checked against the shapes at trace time.
"""

from __future__ import annotations

import ctypes
import dataclasses
import numbers
import os
import threading
import time
import warnings
from typing import Any

import numpy as np

from jax_megamoe import env_overrides, ipc_exchange

MAX_RANKS = 8
SIGNAL_BYTES = 512  # sizeof(megamoe::ep::SignalArea)
FUSED_SIGNAL_BYTES = 512  # sizeof(megamoe::ep::FusedSignals)
FUSED_MAX_EXPERTS = 1024  # kFusedMaxExperts
FUSED_BLOCK_M = 128  # kFusedBlockM
IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
# Blocks of the send/receive kernels. 264 (two per SM) was faster for combine (0.375 vs 0.474 ms
# at H=2048) but fills every SM of an H200 with blocks that may spin on a peer: a collective XLA
# runs on another stream at the same time could then find no room. 128 leaves room on each SM.
DEFAULT_COMM_BLOCKS = 128
DEFAULT_TIMEOUT_S = 60.0


def _require_positive_int(caller: str, name: str, value) -> int:
  """value as an int, or a ValueError naming `caller` and `name` (bools and floats refused)."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
    raise ValueError(f"{caller}: {name} must be a positive int, got {value!r}")
  return int(value)


def send_settings(comm_blocks: int | None, timeout_s: float | None,
                  caller: str) -> tuple[int, float]:
  """A workspace's (comm_blocks, timeout_s), validated: the arguments where given, else
  MEGAMOE_EP_COMM_BLOCKS / MEGAMOE_EP_TIMEOUT_S, else DEFAULT_COMM_BLOCKS / DEFAULT_TIMEOUT_S
  (every workspace, real or virtual, decides them here)."""
  if comm_blocks is None:
    comm_blocks = env_overrides.positive_int("MEGAMOE_EP_COMM_BLOCKS", DEFAULT_COMM_BLOCKS,
                                             "a positive number of thread blocks")
  else:
    comm_blocks = _require_positive_int(caller, "comm_blocks", comm_blocks)
  if timeout_s is None:
    timeout_s = env_overrides.positive_seconds("MEGAMOE_EP_TIMEOUT_S", DEFAULT_TIMEOUT_S)
  elif not (isinstance(timeout_s, numbers.Real) and 0 < timeout_s < float("inf")):
    raise ValueError(f"{caller}: timeout_s must be a positive number of seconds, got "
                     f"{timeout_s!r}")
  return int(comm_blocks), float(timeout_s)


def _align(value: int, alignment: int = 256) -> int:
  return (value + alignment - 1) // alignment * alignment


def workspace_layout(num_ranks: int, max_tokens: int, hidden: int, top_k: int,
                     elem_bytes: int, fused_rows: int = 0) -> dict[str, int]:
  """Byte offsets of one rank's workspace (mirror of ffi/comm/symmetric_memory.h)."""
  slots = num_ranks * max_tokens
  fused = fused_rows > 0
  mblocks = -(-fused_rows // FUSED_BLOCK_M) + FUSED_MAX_EXPERTS if fused else 0
  layout = {"signals": 0}
  off = _align(SIGNAL_BYTES)
  for name, size in (("meta_ids", slots * top_k * 4), ("meta_w", slots * top_k * 4),
                     ("pool_d", slots * hidden * elem_bytes), ("meta_c", slots * top_k * 4),
                     ("pool_c", slots * hidden * elem_bytes),
                     ("fsig", FUSED_SIGNAL_BYTES if fused else 0),
                     ("fcounts", 2 * MAX_RANKS * FUSED_MAX_EXPERTS * 4 if fused else 0),
                     ("ftiles", mblocks * 8), ("fl1done", mblocks * 8),
                     ("fpool", fused_rows * hidden * elem_bytes),
                     ("fcomb", max_tokens * top_k * hidden * elem_bytes if fused else 0)):
    layout[name] = off
    off = _align(off + size)
  layout["total_bytes"] = off
  return layout


def workspace_bytes(num_ranks: int, max_tokens: int, hidden: int, top_k: int,
                    elem_bytes: int, fused_rows: int = 0) -> int:
  """Bytes one GPU allocates for a workspace of this size (fused_rows > 0: with the regions of
  the fused kernel, whose pool holds that many rows)."""
  _check_sizes(num_ranks, max_tokens, hidden, top_k, elem_bytes)
  if fused_rows < 0:
    raise ValueError(f"fused_rows must be >= 0, got {fused_rows}")
  return workspace_layout(num_ranks, max_tokens, hidden, top_k, elem_bytes,
                          fused_rows)["total_bytes"]


def _check_sizes(num_ranks, max_tokens, hidden, top_k, elem_bytes):
  if not 1 <= num_ranks <= MAX_RANKS:
    raise ValueError(f"num_ranks must be in [1, {MAX_RANKS}] (one NVLink domain), got {num_ranks}")
  if max_tokens < 1:
    raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
  if elem_bytes not in (2, 4):
    raise ValueError(f"elem_bytes must be 2 (bf16/fp16) or 4 (fp32), got {elem_bytes}")
  if hidden < 1 or (hidden * elem_bytes) % 16:
    raise ValueError(f"hidden * elem_bytes must be a positive multiple of 16 bytes, got hidden="
                     f"{hidden}, elem_bytes={elem_bytes}")
  if not 1 <= top_k <= 32:
    raise ValueError(f"top_k must be in [1, 32], got {top_k}")


# --- native library ---------------------------------------------------------------------------

_lib_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


def _library() -> ctypes.CDLL:
  """The extension's C ABI for workspaces (ffi/comm/workspace_registry.cu), loaded once."""
  global _lib
  with _lib_lock:
    if _lib is not None:
      return _lib
    from jax_megamoe import _ffi
    ext = _ffi.extension()
    if ext is None:
      raise RuntimeError("jax_megamoe: the native extension was not built; EP workspaces need it")
    lib = ctypes.CDLL(ext.__file__)
    if not hasattr(lib, "megamoe_ep_ws_new"):
      raise RuntimeError("jax_megamoe: the extension was built without CUDA; EP workspaces need "
                         "the CUDA build")
    i64, i32, p = ctypes.c_int64, ctypes.c_int, ctypes.c_char_p
    lib.megamoe_ep_ws_layout.argtypes = [i64, i64, i64, i64, i64, i64, ctypes.POINTER(i64)]
    lib.megamoe_ep_ws_new.argtypes = [i64, i64, i64, i64, i64, i64, i32, ctypes.c_double,
                                      ctypes.POINTER(i64), p, i32]
    lib.megamoe_ep_ws_alloc.argtypes = [i64, i32, i32, ctypes.c_void_p, p, i32]
    lib.megamoe_ep_ws_connect.argtypes = [i64, i32, i32, i32, ctypes.c_void_p, p, i32]
    for name in ("megamoe_ep_ws_finalize", "megamoe_ep_ws_error", "megamoe_ep_ws_close_peers",
                 "megamoe_ep_ws_free"):
      getattr(lib, name).argtypes = [i64, p, i32]
    _lib = lib
    return lib


def _call(fn, *args) -> None:
  msg = ctypes.create_string_buffer(1024)
  if fn(*args, msg, len(msg)) != 0:
    raise RuntimeError(f"jax_megamoe symmetric workspace: {msg.value.decode(errors='replace')}")


def native_layout(num_ranks, max_tokens, hidden, top_k, elem_bytes,
                  fused_rows: int = 0) -> dict[str, int]:
  """The layout as the compiled extension computes it (to check the Python mirror)."""
  names = ("signals", "meta_ids", "meta_w", "pool_d", "meta_c", "pool_c", "fsig", "fcounts",
           "ftiles", "fl1done", "fpool", "fcomb", "total_bytes")
  out = (ctypes.c_int64 * len(names))()
  _library().megamoe_ep_ws_layout(num_ranks, max_tokens, hidden, top_k, elem_bytes, fused_rows,
                                  out)
  return dict(zip(names, list(out)))


# --- workspaces -------------------------------------------------------------------------------


def _ordinal(device) -> int:
  """The CUDA device ordinal of a local JAX device."""
  hardware_id = getattr(device, "local_hardware_id", None)
  return int(hardware_id) if hardware_id is not None else int(device.id)


def ep_groups(mesh, expert_axis: str) -> np.ndarray:
  """Devices of `mesh` as [num_groups, R]: row g is one EP group in rank order."""
  names = tuple(mesh.axis_names)
  if expert_axis not in names:
    raise ValueError(f"expert_axis {expert_axis!r} is not an axis of the mesh {names}")
  axis = names.index(expert_axis)
  devices = np.moveaxis(np.asarray(mesh.devices), axis, -1)
  return devices.reshape(-1, devices.shape[-1])


@dataclasses.dataclass(eq=False)
class SymmetricWorkspace:
  """A symmetric workspace allocated on every GPU of a mesh's EP groups (see module doc)."""
  id: int
  num_ranks: int
  max_tokens: int
  hidden: int
  top_k: int
  elem_bytes: int
  comm_blocks: int
  timeout_s: float
  device_ids: tuple[int, ...]
  expert_axis: str
  bytes_per_device: int
  multiprocess: bool  # an EP group of this process spans processes (CUDA IPC handles exchanged)
  closed: bool = False
  fused_rows: int = 0  # rows of the fused kernel's pool (0: no fused regions)
  # A virtual group (jax_megamoe.virtual_ranks): all num_ranks ranks on one GPU, driven by one
  # call with rank-stacked operands.
  virtual: bool = False
  # The handshakes this process took part in and the store they went through (close needs them).
  _exchanges: tuple[ipc_exchange.GroupExchange, ...] = dataclasses.field(default=(), repr=False)
  _store: Any = dataclasses.field(default=None, repr=False)

  def fits(self, *, num_ranks: int, max_tokens: int, hidden: int, top_k: int,
           elem_bytes: int, fused_rows: int = 0) -> bool:
    return (not self.closed and num_ranks == self.num_ranks and max_tokens <= self.max_tokens
            and top_k <= self.top_k and hidden * elem_bytes <= self.hidden * self.elem_bytes
            and fused_rows <= self.fused_rows)

  def check(self) -> None:
    """Raises RuntimeError when a kernel of this workspace recorded an error (a timeout)."""
    if self.closed:
      return
    _call(_library().megamoe_ep_ws_error, self.id)

  def close(self, timeout_s: float | None = None) -> None:
    """Frees the workspace on every GPU of this process.

    No compiled program that uses it may run afterwards (its calls then fail with a clear error).
    When an EP group spans processes, every process of the group must close it: this process
    unmaps its peers' memory, says so through the key-value store and frees its own once every
    peer has said the same, waiting at most `timeout_s` (default: the workspace's EP timeout).
    A peer that does not close in time (it died, or closes later) leaves this process's memory
    allocated until the process exits, with a warning: never a hang, and never memory freed
    while a peer may still write into it.
    """
    _close([self], timeout_s)


def _this_process() -> int:
  import jax
  return jax.process_index()


def _programs_shared_between_processes() -> bool:
  """jax_share_binary_between_hosts: process 0's executable runs on every process, so the
  workspace ids compiled into it must be the same everywhere."""
  import jax
  return bool(getattr(jax.config, "jax_share_binary_between_hosts", False))


_sequences = ipc_exchange.Sequences()


def _require_gpus(mesh) -> None:
  """Symmetric workspaces live in GPU memory: other devices are named here, before a native
  call would report them as a CUDA driver error. (Tests that fake the native registry on CPU
  devices fake this too.)"""
  platforms = sorted({d.platform for d in np.asarray(mesh.devices).reshape(-1)})
  if platforms != ["gpu"]:
    raise ValueError(f"create_workspace: the mesh's devices are not GPUs (platform "
                     f"{', '.join(platforms)}); symmetric workspaces live in GPU memory")


def create_workspace(mesh, expert_axis: str = "expert", *, max_tokens: int, hidden: int,
                     top_k: int, dtype: Any = "bfloat16", comm_blocks: int | None = None,
                     timeout_s: float | None = None, handshake_timeout_s: float | None = None,
                     store: ipc_exchange.KeyValueStore | None = None,
                     fused_rows: int = 0) -> SymmetricWorkspace:
  """Allocates and maps a workspace on every GPU of `mesh` that belongs to this process.

  fused_rows: > 0 adds the regions of the fused kernel (backend "fused"), whose receive pool
  holds that many rows (see workspace_layout for the bytes).

  max_tokens: tokens per GPU (per rank) the workspace must hold; hidden, top_k, dtype: of the
  activations that travel (the element size of `dtype` sizes the pools). comm_blocks: thread
  blocks of every send kernel (default MEGAMOE_EP_COMM_BLOCKS or 128); timeout_s: longest wait on a
  peer before a kernel gives up and reports (default MEGAMOE_EP_TIMEOUT_S or 60).

  Works outside and inside a trace (`jax.jit`). When an EP group of this process spans processes
  (one process per GPU), the processes of the group exchange CUDA IPC handles through
  jax.distributed's key-value store (`store`: another KeyValueStore, for tests): every process of
  the group must then create the same workspaces in the same order, and a peer that does not
  answer within `handshake_timeout_s` (default MEGAMOE_EP_HANDSHAKE_TIMEOUT_S or 300) is reported
  by name. Groups inside this process need no other process (see jax_megamoe.ipc_exchange).
  """
  # Arguments checked before any native call, so that a bad one is named here instead of
  # surfacing as a ctypes or CUDA driver error.
  max_tokens, hidden, top_k = (_require_positive_int("create_workspace", name, value)
                               for name, value in (("max_tokens", max_tokens), ("hidden", hidden),
                                                   ("top_k", top_k)))
  comm_blocks, timeout_s = send_settings(comm_blocks, timeout_s, "create_workspace")
  _require_gpus(mesh)
  elem_bytes = int(np.dtype(dtype).itemsize)
  groups = ep_groups(mesh, expert_axis)
  num_ranks = groups.shape[1]
  _check_sizes(num_ranks, max_tokens, hidden, top_k, elem_bytes)
  handshake_timeout_s = ipc_exchange.timeout_from_env(handshake_timeout_s)
  me = _this_process()
  local = [(g, r, d) for g in range(groups.shape[0]) for r in range(num_ranks)
           for d in [groups[g, r]] if d.process_index == me]
  if not local:
    raise ValueError(f"create_workspace: no device of the mesh belongs to this process "
                     f"(process {me})")
  # Only this process's EP groups count: a group inside one process needs no exchange, even
  # when other groups of the mesh (or its data axis) span processes.
  exchanges = ipc_exchange.plan(groups, me, _sequences)
  if exchanges and store is None:
    store = ipc_exchange.DistributedStore()
  lib = _library()
  ws_id = ctypes.c_int64(0)
  _call(lib.megamoe_ep_ws_new, num_ranks, max_tokens, hidden, top_k, elem_bytes, fused_rows,
        comm_blocks, timeout_s, ctypes.byref(ws_id))
  ws_id = ws_id.value
  spec = ipc_exchange.WorkspaceSpec(ws_id, num_ranks, max_tokens, hidden, top_k, elem_bytes,
                                    comm_blocks, fused_rows)
  told_peers = False
  try:
    handles: dict[int, bytes] = {}
    for _, rank, dev in local:
      buf = ctypes.create_string_buffer(IPC_HANDLE_BYTES)
      _call(lib.megamoe_ep_ws_alloc, ws_id, _ordinal(dev), rank, buf)
      handles[int(dev.id)] = buf.raw
    if exchanges:
      ipc_exchange.publish_shares(store, exchanges, spec, handles)
      handles.update(ipc_exchange.collect_shares(
          store, exchanges, spec, handshake_timeout_s,
          strict_ids=_programs_shared_between_processes()))
    for g, rank, dev in local:
      for q in range(num_ranks):
        peer = groups[g, q]
        if q == rank:
          continue
        if peer.process_index == me:
          _call(lib.megamoe_ep_ws_connect, ws_id, _ordinal(dev), q, _ordinal(peer), None)
        else:
          _connect_ipc(lib, ws_id, dev, q, peer, handles[int(peer.id)])
    _call(lib.megamoe_ep_ws_finalize, ws_id)
    if exchanges:
      ipc_exchange.publish_ready(store, exchanges)
      told_peers = True
      ipc_exchange.wait_ready(store, exchanges, handshake_timeout_s)
  except BaseException as e:
    if exchanges and not told_peers:  # the peers fail now, not after their timeout
      ipc_exchange.publish_failure(store, exchanges, f"{type(e).__name__}: {e}")
    # The peers raise too (a peer slower than the timeout would fail in its first kernel).
    for name in ("megamoe_ep_ws_close_peers", "megamoe_ep_ws_free"):
      getattr(lib, name)(ws_id, None, 0)
    raise
  return SymmetricWorkspace(
      id=ws_id, num_ranks=num_ranks, max_tokens=max_tokens, hidden=hidden, top_k=top_k,
      elem_bytes=elem_bytes, comm_blocks=comm_blocks, timeout_s=timeout_s,
      device_ids=tuple(int(d.id) for d in groups.reshape(-1)), expert_axis=expert_axis,
      bytes_per_device=workspace_bytes(num_ranks, max_tokens, hidden, top_k, elem_bytes,
                                       fused_rows),
      multiprocess=bool(exchanges), fused_rows=fused_rows, _exchanges=tuple(exchanges),
      _store=store)


def _connect_ipc(lib, ws_id: int, dev, peer_rank: int, peer, handle: bytes) -> None:
  """Maps a peer of another process through its CUDA IPC handle."""
  try:
    _call(lib.megamoe_ep_ws_connect, ws_id, _ordinal(dev), peer_rank, -1, handle)
  except RuntimeError as e:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hint = ("" if visible is None else
            f" This process sees only CUDA_VISIBLE_DEVICES={visible}: if CUDA IPC cannot reach a "
            f"GPU hidden from the process here, make every GPU of the node visible and choose "
            f"each process's GPU with jax.distributed.initialize(local_device_ids=[...]).")
    raise RuntimeError(f"{e} (mapping device {peer.id} of process {peer.process_index} on device "
                       f"{dev.id}).{hint}") from None


def _close(workspaces: list[SymmetricWorkspace], timeout_s: float | None) -> None:
  """Closes workspaces (see SymmetricWorkspace.close): all of them are unmapped and announced
  before any wait, so processes that close them in different orders do not wait on each other."""
  todo = [ws for ws in workspaces if not ws.closed]
  if not todo:  # nothing to close: no library needed (a CPU build may call close_all)
    return
  lib = _library()
  if timeout_s is None:
    timeout_s = max(ws.timeout_s for ws in todo)
  deadline = time.monotonic() + timeout_s
  for ws in todo:
    _call(lib.megamoe_ep_ws_close_peers, ws.id)  # waits for this process's kernels, unmaps
    ws.closed = True
    with _cache_lock:
      for key, cached in list(_cache.items()):
        if cached is ws:
          del _cache[key]
  announced = []
  for ws in todo:
    if not ws._exchanges:
      _call(lib.megamoe_ep_ws_free, ws.id)
      continue
    try:
      ipc_exchange.publish_closed(ws._store, list(ws._exchanges))
      announced.append(ws)
    except Exception as e:  # e.g. jax.distributed was shut down before close
      _keep_allocated(ws, f"its peers could not be told ({type(e).__name__}: {e})")
  for ws in announced:
    try:
      missing = ipc_exchange.wait_closed(ws._store, list(ws._exchanges),
                                         max(0.001, deadline - time.monotonic()))
    except Exception as e:
      missing = [f"({type(e).__name__}: {e})"]
    if missing:
      _keep_allocated(ws, f"{', '.join(missing)} did not close it within {timeout_s:g} s")
    else:
      _call(lib.megamoe_ep_ws_free, ws.id)


def _keep_allocated(ws: SymmetricWorkspace, reason: str) -> None:
  warnings.warn(f"jax_megamoe symmetric workspace {ws.id}: {reason}; its memory on this "
                f"process's GPUs ({ws.bytes_per_device} bytes each) stays allocated until the "
                f"process exits, as a peer may still write into it", RuntimeWarning, stacklevel=4)


_cache_lock = threading.Lock()
_cache: dict[tuple, SymmetricWorkspace] = {}
_retired: list[SymmetricWorkspace] = []


def workspace_for(mesh, expert_axis: str, *, max_tokens: int, hidden: int, top_k: int,
                  dtype: Any, fused_rows: int = 0) -> SymmetricWorkspace:
  """A cached workspace of this mesh that fits the request, created on first use.

  Called while tracing (host side, before the program runs): the allocation happens once per
  mesh and size and stays until `close_all()` or `SymmetricWorkspace.close()`.
  """
  elem_bytes = int(np.dtype(dtype).itemsize)
  groups = ep_groups(mesh, expert_axis)
  key = (tuple(int(d.id) for d in groups.reshape(-1)), groups.shape, expert_axis)
  request = dict(num_ranks=groups.shape[1], max_tokens=max_tokens, hidden=hidden, top_k=top_k,
                 elem_bytes=elem_bytes, fused_rows=fused_rows)
  with _cache_lock:
    ws = _cache.get(key)
    if ws is not None and ws.fits(**request):
      return ws
  ws = create_workspace(mesh, expert_axis, max_tokens=max_tokens, hidden=hidden, top_k=top_k,
                        dtype=dtype, fused_rows=fused_rows)
  with _cache_lock:
    # An older, smaller one stays allocated (compiled programs may still use it) until close_all.
    if key in _cache:
      _retired.append(_cache[key])
    _cache[key] = ws
  return ws


def check_all() -> None:
  """Raises RuntimeError if a kernel of any workspace `workspace_for` created recorded an error
  (a wait that timed out). Such an error is otherwise raised by that workspace's next call; call
  this after a run's last step (or before saving a checkpoint) so that none goes unreported."""
  with _cache_lock:
    workspaces = list(_cache.values()) + list(_retired)
  for ws in workspaces:
    ws.check()


def close_all() -> None:
  """Closes every workspace `workspace_for` created (no program may use them afterwards)."""
  with _cache_lock:
    workspaces = list(_cache.values()) + list(_retired)
    _retired.clear()
  _close(workspaces, None)

"""A workspace's allocation and teardown (ffi/comm/workspace_registry.cu) leave the calling
thread's CUDA context as they found it.

They switch to the workspace's device for their scope. Restoring the previous device with
cudaSetDevice would create a context where the thread had none, since cudaGetDevice says 0 then.
In a process that drives one GPU of several visible, that is hundreds of MB on GPU 0 that the
process never meant to use. These tests call the workspace C ABI from a fresh thread, which has
no context, and read the thread's context through the driver before and after. GPU only; skipped
and reported as not run elsewhere.
"""

import ctypes
import threading

import pytest

from jax_megamoe import _ffi, symmetric, virtual_ranks


def _current_context():
  """The calling thread's current CUDA context (None: none), read through the driver."""
  libcuda = ctypes.CDLL("libcuda.so.1")
  ctx = ctypes.c_void_p()
  assert libcuda.cuCtxGetCurrent(ctypes.byref(ctx)) == 0
  return ctx.value


def _contexts_around_a_workspace(ordinal: int) -> dict:
  """From a fresh thread: its context before, after creating a 2-rank virtual workspace on
  `ordinal` (which allocates and zeroes its shares) and after freeing it."""
  lib = virtual_ranks._virtual_library()
  comm_blocks, timeout_s = symmetric.send_settings(None, None, "test_workspace_context")
  seen = {}

  def run():
    try:
      seen["before"] = _current_context()
      ws_id = ctypes.c_int64(0)
      # 2 ranks, 8 tokens, hidden 256, top-2, bf16 rows, no fused pool.
      symmetric._call(lib.megamoe_ep_ws_new_virtual, 2, 8, 256, 2, 2, 0, comm_blocks,
                      timeout_s, ordinal, ctypes.byref(ws_id))
      seen["after_create"] = _current_context()
      symmetric._call(lib.megamoe_ep_ws_close_peers, ws_id.value)
      symmetric._call(lib.megamoe_ep_ws_free, ws_id.value)
      seen["after_free"] = _current_context()
    except BaseException as e:  # re-raised in the test's thread
      seen["error"] = e

  thread = threading.Thread(target=run)
  thread.start()
  thread.join()
  if "error" in seen:
    raise seen["error"]
  return seen


@pytest.mark.gpu
def test_a_thread_without_a_context_is_left_without_one():
  seen = _contexts_around_a_workspace(symmetric._ordinal(_ffi.gpu_devices()[0]))
  assert seen["before"] is None, "a fresh thread should start without a CUDA context"
  assert seen["after_create"] is None, "creating the workspace left a context current"
  assert seen["after_free"] is None, "freeing the workspace left a context current"


@pytest.mark.multigpu
def test_a_workspace_on_the_second_gpu_leaves_no_context_on_the_first():
  """The case that cost memory: a thread with no context works on GPU 1 only."""
  seen = _contexts_around_a_workspace(symmetric._ordinal(_ffi.gpu_devices()[1]))
  assert seen["before"] is None
  assert seen["after_create"] is None and seen["after_free"] is None

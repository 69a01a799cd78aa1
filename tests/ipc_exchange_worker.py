"""One process of tests/test_ipc_exchange.py's two-process run: real jax.distributed (CPU, one
device per process), the native workspace registry faked. Workspaces are created while a
jax.jit function is traced, their handles exchanged through jax's own key-value store.

python -m ipc_exchange_worker <process_id> <port>   (tests/ on PYTHONPATH); prints
"IPC-EXCHANGE-OK <id>" when every check passed.
"""

import sys


def main(process_id: int, port: int) -> None:
  import jax
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                             process_id=process_id)
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh

  from fake_workspace_lib import FakeWorkspaceLib, fake_handle
  from jax_megamoe import ipc_exchange, symmetric

  lib = FakeWorkspaceLib(process_id)
  symmetric._library = lambda: lib
  symmetric._require_gpus = lambda mesh: None  # the native registry is faked: CPU devices do
  devices = jax.devices()
  assert len(devices) == 2 and [d.process_index for d in devices] == [0, 1], devices
  made = []

  def layer(mesh):
    def f(x):  # what cuda_ep does while `moe` is traced
      made.append(symmetric.workspace_for(mesh, "expert", max_tokens=8, hidden=64, top_k=2,
                                          dtype=jnp.float32))
      return x * 2
    return f

  x = jnp.ones((4,), jnp.float32)
  ep_across = Mesh(np.array(devices).reshape(1, 2), ("data", "expert"))
  jax.jit(layer(ep_across)).lower(x)
  ws = made[-1]
  assert ws.multiprocess and ws.id == 1, ws
  assert lib.connects == [(1, symmetric._ordinal(devices[process_id]), 1 - process_id, -1,
                           fake_handle(1 - process_id, 0, 1))], lib.connects  # CPU ordinal 0

  data_across = Mesh(np.array(devices).reshape(2, 1), ("data", "expert"))
  jax.jit(layer(data_across)).lower(x)
  assert not made[-1].multiprocess and len(lib.connects) == 1, made[-1]

  try:
    ipc_exchange.DistributedStore().get("jax_megamoe/test/never", 0.2)
    raise AssertionError("no TimeoutError")
  except TimeoutError:
    pass

  symmetric.close_all()
  assert sorted(lib.freed) == [1, 2], lib.freed
  print(f"IPC-EXCHANGE-OK {process_id}", flush=True)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]))

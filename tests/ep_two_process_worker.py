"""One process of the two-process EP tests: jax.distributed on localhost, one GPU per process.

python -m ep_two_process_worker <process_id> <port> <mode>   (tests/ on PYTHONPATH; see
tests/test_ep_two_process.py). The process's GPU: the one CUDA_VISIBLE_DEVICES leaves it, else
local_device_ids=[process_id] of the GPUs the test sees. Modes:
  eager  the workspace from symmetric.create_workspace, before anything is traced
  lazy   none given: expert_parallel_moe creates it while jax.jit traces (symmetric.workspace_for)
  die    lazy; process 1 exits inside the expert MLP of its 4th forward (after dispatch, before
         combine), process 0 must then fail with the EP timeout's message, not hang
Prints "EP-WORKER-OK <id>" when every check passed ("EP-WORKER-PEER-FAILURE <s> <message>" in
process 0 for mode die).
"""

import functools
import os
import sys
import time

DIE_AT_CALL = 4


def main(process_id: int, port: int, mode: str) -> None:
  import jax
  # One GPU visible: the test gave each process its own; otherwise this process's of the GPUs
  # the test sees (its CUDA_VISIBLE_DEVICES, kept: tests/subprocesses.py gpu_worker_env).
  visible = os.environ.get("CUDA_VISIBLE_DEVICES")
  own_gpu = None if visible is not None and "," not in visible else [process_id]
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                             process_id=process_id, local_device_ids=own_gpu)
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  import ep_helpers
  from jax_megamoe import symmetric
  from jax_megamoe.backends import cuda_ep

  assert jax.process_count() == 2 and len(jax.local_devices()) == 1, jax.devices()
  mesh = Mesh(np.array(jax.devices()), ("expert",))
  tokens, hidden, ffn, experts, top_k = 2 * 64, 128, 64, 8, 4
  ws = None
  if mode == "eager":
    ws = symmetric.create_workspace(mesh, "expert", max_tokens=tokens // 2, hidden=hidden,
                                    top_k=top_k, dtype=jnp.float32, comm_blocks=16,
                                    timeout_s=30.0)
    assert ws.multiprocess

  rng = np.random.default_rng(0)  # same data in both processes
  ids, w = ep_helpers.routing(rng, tokens, experts, top_k, mask_fraction=0.1)
  x = rng.standard_normal((tokens, hidden)).astype(np.float32)
  wgu = (rng.standard_normal((experts, hidden, 2 * ffn)) / np.sqrt(hidden)).astype(np.float32)
  wd = (rng.standard_normal((experts, ffn, hidden)) / np.sqrt(ffn)).astype(np.float32)
  probe = rng.standard_normal((tokens, hidden)).astype(np.float32)

  def glob(a):
    sharding = NamedSharding(mesh, P("expert"))
    return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])

  gx, gids, gw, gwgu, gwd, gprobe = map(glob, (x, ids, w, wgu, wd, probe))
  if mode == "die":
    return die_mid_step(process_id, mesh, (gx, gids, gw, gwgu, gwd))
  layer = functools.partial(cuda_ep.expert_parallel_moe, mesh=mesh, workspace=ws,
                            mlp=ep_helpers.dense_grouped_mlp)

  def loss(x, w, wgu, wd, ids, probe):
    return jnp.sum(layer(x, ids, w, wgu, wd) * probe)

  y = jax.jit(layer)(gx, gids, gw, gwgu, gwd)
  if ws is None:  # created while jax.jit traced the layer
    (ws,) = set(symmetric._cache.values())
    assert ws.multiprocess, ws
  value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(
      gx, gw, gwgu, gwd, gids, gprobe)
  for _ in range(50):  # consecutive calls: no stale signal
    y_again = jax.jit(layer)(gx, gids, gw, gwgu, gwd)

  # Oracle on this process's own GPU, full problem.
  dev = jax.local_devices()[0]
  lx, lids, lw, lwgu, lwd, lprobe = (jax.device_put(a, dev) for a in (x, ids, w, wgu, wd, probe))
  ref_y = ep_helpers.dense_moe(lx, lids, lw, lwgu, lwd)
  ref_value, ref_grads = jax.value_and_grad(
      lambda x, w, wgu, wd: jnp.sum(ep_helpers.dense_moe(x, lids, w, wgu, wd) * lprobe),
      argnums=(0, 1, 2, 3))(lx, lw, lwgu, lwd)

  def local(a, ref):
    shard = a.addressable_shards[0]
    return np.asarray(shard.data), np.asarray(ref)[shard.index]

  errors = {"y": ep_helpers.rel_err(*local(y, ref_y))}
  got, want = local(y_again, ref_y)
  assert np.array_equal(got, local(y, ref_y)[0]), "repeated calls differ"
  errors["loss"] = ep_helpers.rel_err(np.asarray(value.addressable_shards[0].data), ref_value)
  for name, g, r in zip(("dx", "dw", "dwgu", "dwd"), grads, ref_grads):
    errors[name] = ep_helpers.rel_err(*local(g, r))
  print(f"process {process_id}: rel errors {errors}", flush=True)
  bad = {k: v for k, v in errors.items() if not v < 2e-5}
  ws.check()
  if mode == "eager":
    ws.close()
  else:
    symmetric.close_all()
  if bad:
    raise SystemExit(f"EP-WORKER-FAIL {process_id}: {bad}")
  print(f"EP-WORKER-OK {process_id}", flush=True)
  jax.distributed.shutdown()


def die_mid_step(process_id, mesh, args):
  """Forward calls of a jitted layer; process 1 exits inside its 4th, between dispatch and
  combine (a host callback the expert MLP's output depends on)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.experimental import multihost_utils

  import ep_helpers
  from jax_megamoe.backends import cuda_ep

  calls = [0]

  def maybe_exit(_):
    calls[0] += 1
    if process_id == 1 and calls[0] == DIE_AT_CALL:
      print("EP-WORKER-DYING 1", flush=True)
      os._exit(17)
    return np.zeros((), np.float32)

  def mlp(x_sorted, group_sizes, w_gu, w_dn, *, recipe=None):
    y = ep_helpers.dense_grouped_mlp(x_sorted, group_sizes, w_gu, w_dn, recipe=recipe)
    zero = jax.pure_callback(maybe_exit, jax.ShapeDtypeStruct((), jnp.float32), y[0, 0])
    return y + zero.astype(y.dtype)

  layer = jax.jit(functools.partial(cuda_ep.expert_parallel_moe, mesh=mesh, mlp=mlp))
  compiled = layer.lower(*args).compile()  # traces: creates the workspace
  multihost_utils.sync_global_devices("compiled")  # no EP timeout while the other compiles
  started = {}
  for call in range(1, DIE_AT_CALL + 4):
    started[call] = time.monotonic()
    try:
      compiled(*args).block_until_ready()
    except Exception as e:  # the EP kernels' timeout, reported by the next EP call
      # From the start of the call the peer died in (its kernels gave up after the timeout).
      elapsed = time.monotonic() - started[min(call, DIE_AT_CALL)]
      message = " ".join(str(e).split())[:600]
      print(f"EP-WORKER-PEER-FAILURE {elapsed:.1f} call {call}: {message}", flush=True)
      os._exit(0)  # not jax.distributed.shutdown(): it would wait for the dead process
  print(f"EP-WORKER-NO-FAILURE {process_id}: {calls[0]} calls ran", flush=True)
  os._exit(1)


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "eager")

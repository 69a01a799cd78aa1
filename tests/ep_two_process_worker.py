"""One process of the two-process EP test: jax.distributed on localhost, one GPU per process.

python -m ep_two_process_worker <process_id> <port>   (tests/ on PYTHONPATH; see
tests/test_ep_two_process.py). Prints "EP-WORKER-OK <id>" when every check passed.
"""

import functools
import sys


def main(process_id: int, port: int) -> None:
  import jax
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                             process_id=process_id, local_device_ids=[process_id])
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  import ep_helpers
  from jax_megamoe import symmetric
  from jax_megamoe.backends import cuda_ep

  assert jax.process_count() == 2 and len(jax.local_devices()) == 1, jax.devices()
  mesh = Mesh(np.array(jax.devices()), ("expert",))
  tokens, hidden, ffn, experts, top_k = 2 * 64, 128, 64, 8, 4
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
  layer = functools.partial(cuda_ep.expert_parallel_moe, mesh=mesh, workspace=ws,
                            mlp=ep_helpers.dense_grouped_mlp)

  def loss(x, w, wgu, wd, ids, probe):
    return jnp.sum(layer(x, ids, w, wgu, wd) * probe)

  y = jax.jit(layer)(gx, gids, gw, gwgu, gwd)
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
  ws.close()
  if bad:
    raise SystemExit(f"EP-WORKER-FAIL {process_id}: {bad}")
  print(f"EP-WORKER-OK {process_id}", flush=True)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]))

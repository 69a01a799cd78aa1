"""Workers of tests/test_fused_multigpu.py: backend "fused" with its EP group across two GPUs.

  python -m fused_multigpu_worker all_gather
      one process, two GPUs: the fused layer and an all_gather of an unrelated array in one jit
      program (XLA may run the collective on another stream while the persistent kernel holds
      its SMs: it must leave room, issue 14 item 3), 20 calls, every result checked; the test
      runs it with MEGAMOE_FUSED_BACKWARD=0 (backend cuda's backward on the residuals)
  python -m fused_multigpu_worker two_process <process_id> <port>
      one of two processes (jax.distributed on localhost), one GPU each: forward and gradients
      (the backward's kernel pass) against the oracle, 20 repeated forwards bitwise equal
  python -m fused_multigpu_worker two_gpus <recipe>
      one process, two GPUs, recipe "bf16" / "fp8" / "fp8_pow2": forward and gradients against
      the oracle (bf16: the backward's kernel pass, in one process) or the FP8 emulation
      (backend reference on the CPU; dW_gate_up from x as the sender quantises it, since the
      rows cross GPUs in FP8), 20 repeated forwards bitwise equal
Prints "FUSED-WORKER-OK <id>" when every check passed, else exits non-zero saying what failed;
all_gather also prints "FUSED-WORKER-CONCURRENCY overlapped|not-overlapped: <why>", whether XLA
scheduled the fused kernel inside the all_gather's asynchronous window (tests/hlo_schedule.py).

FUSED_WORKER_BACKEND=reference runs the same modes on backend reference, on two CPU devices
(tests/test_fused_multigpu_workers_cpu.py, in CI): the workers' own code (shardings, oracle,
processes, checks) is then tested between the rare sessions that have two GPUs.
"""

import os
import sys

# F = 256: the backward's kernel pass applies (bf16, F % 256 == 0; MEGAMOE_FUSED_BACKWARD picks
# it by default with several ranks, 0 keeps backend cuda's kernels on the residuals).
TOKENS, HIDDEN, FFN, EXPERTS, TOP_K = 2 * 160, 256, 256, 8, 2
TOL = 1e-2  # bf16 against the float32 oracle (DESIGN.md)
FP8_TOL = 2e-2  # FP8 against its emulation (as backend cuda's FP8 MLP)
BACKEND = os.environ.get("FUSED_WORKER_BACKEND", "fused")


def problem():
  """The same inputs in every process: x, ids, w, w_gate_up, w_down, probe (numpy; x and the
  weights rounded to bf16)."""
  import ml_dtypes
  import numpy as np

  import ep_helpers
  rng = np.random.default_rng(0)
  ids, w = ep_helpers.routing(rng, TOKENS, EXPERTS, TOP_K, mask_fraction=0.1)
  x = rng.standard_normal((TOKENS, HIDDEN)).astype(ml_dtypes.bfloat16)
  wgu, wd = (np.asarray(a) for a in ep_helpers.weights_for(rng, EXPERTS, HIDDEN, FFN,
                                                            ml_dtypes.bfloat16))
  probe = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
  return x, ids, w, wgu, wd, probe


def fused_layer(mesh, recipe=None):
  """The layer on backend fused (BACKEND) over `mesh` (experts on axis "expert"); fails if a jit
  of it would not run the fused kernel (a fallback to backend cuda would test nothing)."""
  import jax

  import jax_megamoe as jm
  from jax_megamoe.backends import fused

  def layer(x, ids, w, wgu, wd):
    return jm.moe(x, ids, w, wgu, wd, mesh=mesh, expert_axis="expert", backend=BACKEND,
                  recipe=recipe)

  def check_lowering(*args):
    if BACKEND != "fused":
      return
    text = jax.jit(layer).lower(*args).as_text()
    if fused.TARGET not in text:
      raise SystemExit(f"FUSED-WORKER-FAIL: the layer did not lower to {fused.TARGET}")

  return layer, check_lowering


def oracle(x, ids, w, wgu, wd, probe, recipe=None):
  """(y, grads of sum(y * probe) in x, w, wgu, wd) in float32 on one device; with a
  recipe, its emulation (backend reference) on the CPU, dW_gate_up from x quantised as the
  sender quantises it (the fused kernel's rows cross GPUs in FP8; backend reference's do not)."""
  import jax
  import jax.numpy as jnp

  import ep_helpers
  f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
  if recipe is not None:
    import jax_megamoe as jm
    from jax_megamoe import fp8
    spec = fp8.get_recipe(recipe)
    with jax.default_device(jax.devices("cpu")[0]):
      ref = lambda x, w, wgu, wd: jm.moe(x, ids, w, wgu, wd, backend="reference",  # noqa: E731
                                         recipe=recipe)
      loss = lambda *a: jnp.sum(ref(*a).astype(jnp.float32) * probe)  # noqa: E731
      args = [jnp.asarray(a) for a in (x, w, wgu, wd)]
      y = ref(*args)
      grads = jax.grad(loss, argnums=(0, 1, 2, 3))(*args)
      if BACKEND != "fused":
        return y, grads
      x_q = fp8.quantize_activation(args[0], spec).astype(args[0].dtype)
      grads_q = jax.grad(loss, argnums=(0, 1, 2, 3))(x_q, *args[1:])
      return y, (grads[0], grads[1], grads_q[2], grads[3])

  def loss(x, w, wgu, wd):
    return jnp.sum(ep_helpers.dense_moe(x, ids, w, wgu, wd) * probe)

  y = ep_helpers.dense_moe(f32(x), ids, f32(w), f32(wgu), f32(wd))
  grads = jax.grad(loss, argnums=(0, 1, 2, 3))(f32(x), f32(w), f32(wgu), f32(wd))
  return y, grads


def check_backward_lowering(text: str, recipe) -> None:
  """The gradient program runs the fused backward's kernel pass exactly where it should: bf16
  (F = 256) unless MEGAMOE_FUSED_BACKWARD=0; FP8 never."""
  from jax_megamoe.backends import fused
  if BACKEND != "fused":
    return
  want = recipe is None and os.environ.get("MEGAMOE_FUSED_BACKWARD", "auto") != "0"
  if (fused.BWD_TARGET in text) != want:
    raise SystemExit(f"FUSED-WORKER-FAIL: the gradient program {'lacks' if want else 'has'} "
                     f"{fused.BWD_TARGET} (recipe {recipe})")


def check_layer(layer, mesh, arrays, process_id: int, recipe=None) -> None:
  """Forward and gradients of `layer` on the global arrays (x, ids, w, w_gate_up, w_down, probe,
  rows over "expert") against the oracle on this process's shards, and 20 repeated forwards
  bitwise equal; exits saying what failed."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  import ep_helpers
  gx, gids, gw, gwgu, gwd, gprobe = (jax.make_array_from_callback(
      a.shape, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("expert")),
      lambda i, a=a: a[i]) for a in arrays)

  def loss(x, w, wgu, wd, ids, probe):  # ids as an argument: a global array is not concrete
    y = layer(x, ids, w, wgu, wd)
    return jnp.sum(y.astype(jnp.float32) * probe), y  # y: the gradient program's own forward

  # Both programs compiled before either runs, and the processes meet after compiling: a fused
  # call waits for its peers at most MEGAMOE_EP_TIMEOUT_S, which one process's slower
  # compilation must not use up.
  forward = jax.jit(layer).lower(gx, gids, gw, gwgu, gwd).compile()
  grad_lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)).lower(
      gx, gw, gwgu, gwd, gids, gprobe)
  check_backward_lowering(grad_lowered.as_text(), recipe)
  grad_fn = grad_lowered.compile()
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices("fused worker: programs compiled")
  y = forward(gx, gids, gw, gwgu, gwd)
  (_, grad_y), grads = grad_fn(gx, gw, gwgu, gwd, gids, gprobe)
  for call in range(20):  # consecutive calls: no stale signal, bitwise the same
    again = forward(gx, gids, gw, gwgu, gwd)
    for a, b in zip(again.addressable_shards, y.addressable_shards):
      if not np.array_equal(np.asarray(a.data), np.asarray(b.data)):
        raise SystemExit(f"FUSED-WORKER-FAIL {process_id}: forward call {call} differs")
  with jax.default_device(jax.local_devices()[0]):
    ref_y, ref_grads = oracle(*arrays, recipe=recipe)

  def worst(a, ref):  # the largest error over this process's shards
    ref = np.asarray(ref, np.float32)
    return max(ep_helpers.rel_err(np.asarray(s.data, np.float32), ref[s.index])
               for s in a.addressable_shards)

  # The gradient program's forward is checked by its y, not by the loss sum(y * probe): that
  # scalar cancels (|loss| ~ 0.15-0.25 ||y|| ||probe|| here), so its relative error amplifies
  # rounding several times over y's (a review measured bf16's reference backend at 5.7e-3
  # against y's 3.9e-3, and FP8 emulation noise past 2e-2 in some draws), while random errors
  # in y mostly cancel in it.
  errors = {"y": worst(y, ref_y), "y_in_gradient_program": worst(grad_y, ref_y)}
  for name, g, r in zip(("dx", "dtopk_weights", "dw_gate_up", "dw_down"), grads, ref_grads):
    errors[name] = worst(g, r)
  print(f"process {process_id}: rel errors {errors}", flush=True)
  tol = TOL if recipe is None else FP8_TOL
  bad = {k: v for k, v in errors.items() if not v < tol}
  if bad:
    raise SystemExit(f"FUSED-WORKER-FAIL {process_id}: {bad}")


def all_gather_beside(process_id: int = 0) -> None:
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  import ep_helpers
  import hlo_schedule
  from jax_megamoe import parallel, symmetric
  from jax_megamoe.backends import fused

  if len(jax.devices()) < 2:
    raise SystemExit(f"FUSED-WORKER-FAIL: needs 2 GPUs, has {jax.devices()}")
  mesh = Mesh(np.array(jax.devices()[:2]), ("expert",))
  x, ids, w, wgu, wd, probe = problem()
  rows = NamedSharding(mesh, P("expert"))
  args = [jax.device_put(a, rows) for a in (x, ids, w, wgu, wd)]
  # 2 x 64 MiB: a collective that lasts while the fused kernel runs, if XLA overlaps them.
  big = np.arange(2 * (16 << 20), dtype=np.int32).reshape(2, -1) % 9973
  gbig = jax.device_put(big, rows)
  layer, check_lowering = fused_layer(mesh)
  check_lowering(*args)
  check_layer(layer, mesh, (x, ids, w, wgu, wd, probe), process_id)
  gather = parallel.shard_map(lambda b: jax.lax.all_gather(b, "expert", tiled=True), mesh,
                              (P("expert"),), P(), check_vma=False)

  @jax.jit
  def program(x, ids, w, wgu, wd, big):
    return layer(x, ids, w, wgu, wd), gather(big)

  # Whether XLA scheduled the fused kernel inside the all_gather's asynchronous window (else the
  # two never run at the same time and the test says so: it would test nothing of item 3).
  overlapped, why = hlo_schedule.op_inside_async_window(
      program.lower(*args, gbig).compile().as_text(), "all-gather-start",
      f'custom_call_target="{fused.TARGET}"')
  print(f"FUSED-WORKER-CONCURRENCY {'overlapped' if overlapped else 'not-overlapped'}: {why}",
        flush=True)
  ref_y = np.asarray(oracle(x, ids, w, wgu, wd, probe)[0])
  first = None
  for call in range(20):
    y, full = program(*args, gbig)
    y = np.asarray(y, np.float32)
    if first is None:
      first = y
      err = ep_helpers.rel_err(y, ref_y)
      if not err < TOL:
        raise SystemExit(f"FUSED-WORKER-FAIL: y rel error {err} against the oracle")
    elif not np.array_equal(y, first):
      raise SystemExit(f"FUSED-WORKER-FAIL: call {call} gave a different y")
    for shard in full.addressable_shards:
      if not np.array_equal(np.asarray(shard.data), big):
        raise SystemExit(f"FUSED-WORKER-FAIL: call {call}: all_gather on {shard.device} wrong")
  symmetric.check_all()  # a kernel timeout in the last call, reported by no later call
  print(f"FUSED-WORKER-OK {process_id}", flush=True)


def two_process(process_id: int, port: int) -> None:
  import jax
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                             process_id=process_id, local_device_ids=[process_id])
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  from jax_megamoe import symmetric

  assert jax.process_count() == 2 and len(jax.local_devices()) == 1, jax.devices()
  mesh = Mesh(np.array(jax.devices()), ("expert",))
  x, ids, w, wgu, wd, probe = problem()
  rows = NamedSharding(mesh, P("expert"))
  glob = lambda a: jax.make_array_from_callback(a.shape, rows, lambda i: a[i])  # noqa: E731
  layer, check_lowering = fused_layer(mesh)
  check_lowering(*map(glob, (x, ids, w, wgu, wd)))
  check_layer(layer, mesh, (x, ids, w, wgu, wd, probe), process_id)
  symmetric.check_all()
  symmetric.close_all()
  print(f"FUSED-WORKER-OK {process_id}", flush=True)
  jax.distributed.shutdown()


def one_process_two_gpus(recipe_name: str) -> None:
  recipe = None if recipe_name == "bf16" else recipe_name
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  from jax_megamoe import symmetric

  if len(jax.devices()) < 2:
    raise SystemExit(f"FUSED-WORKER-FAIL: needs 2 GPUs, has {jax.devices()}")
  mesh = Mesh(np.array(jax.devices()[:2]), ("expert",))
  x, ids, w, wgu, wd, probe = problem()
  rows = NamedSharding(mesh, P("expert"))
  layer, check_lowering = fused_layer(mesh, recipe)
  check_lowering(*[jax.device_put(a, rows) for a in (x, ids, w, wgu, wd)])
  check_layer(layer, mesh, (x, ids, w, wgu, wd, probe), 0, recipe)
  symmetric.check_all()
  print("FUSED-WORKER-OK 0", flush=True)


if __name__ == "__main__":
  if sys.argv[1] == "all_gather":
    all_gather_beside()
  elif sys.argv[1] == "two_gpus":
    one_process_two_gpus(sys.argv[2])
  elif sys.argv[1] == "two_process":
    two_process(int(sys.argv[2]), int(sys.argv[3]))
  else:
    raise SystemExit(f"unknown mode {sys.argv[1]!r}")

"""Expert-parallel dispatch / combine over NVLink vs JAX's own collectives, on 2+ GPUs.

Per-layer set-up of DESIGN.md §2: T tokens per GPU (16,384), top-8 of 128 experts, random routing,
bf16, hidden 2048 and 4096, EP = number of GPUs. Each op runs `--inner` times inside one jitted
lax.fori_loop (carry threads the data through, so nothing is hoisted); the figure is the median
over `--repeats` of (wall time / inner).

Reported GB/s: bytes that cross NVLink per direction per GPU (token rows whose expert rank is
another GPU, once per destination rank) / time. Ceiling here: 394 GB/s one way (copy engine),
~270-280 GB/s per direction with both GPUs sending at once (DESIGN.md §4).

  python3 benchmarks/bench_dispatch_combine.py --out ep.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jax_megamoe import parallel, symmetric  # noqa: E402
from jax_megamoe.backends import cuda_ep  # noqa: E402


def _timeit(fn, *args, inner, repeats):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - t0) / inner)
  return statistics.median(times)


def _routing(rng, tokens, experts, top_k):
  ids = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k].astype(np.int32)
  w = rng.random((tokens, top_k)).astype(np.float32)
  return ids, w / w.sum(axis=1, keepdims=True)


def _remote_bytes_per_gpu(ids, ranks, tokens, experts, hidden, itemsize):
  """Mean over GPUs of token rows sent to other ranks (once per destination rank)."""
  epr = experts // ranks
  total = 0
  for src in range(ranks):
    block = ids[src * tokens:(src + 1) * tokens]
    dest = np.zeros((tokens, ranks), bool)
    for r in range(ranks):
      dest[:, r] = np.any((block // epr) == r, axis=1)
    dest[:, src] = False
    total += dest.sum()
  return total / ranks * hidden * itemsize


def bench_shape(mesh, args, hidden, results):
  ranks = mesh.shape["expert"]
  T, E, k = args.tokens, args.experts, args.top_k
  dtype = jnp.bfloat16
  rng = np.random.default_rng(0)
  ids_np, w_np = _routing(rng, ranks * T, E, k)
  shard = NamedSharding(mesh, P("expert"))
  x = jax.device_put(jnp.asarray(rng.standard_normal((ranks * T, hidden)), dtype), shard)
  ids = jax.device_put(jnp.asarray(ids_np), shard)
  w = jax.device_put(jnp.asarray(w_np), shard)
  remote = _remote_bytes_per_gpu(ids_np, ranks, T, E, hidden, 2)
  n_cap = cuda_ep.capacity_rows(ranks, T, k, E // ranks, args.capacity_factor)
  row = dict(hidden=hidden, tokens_per_gpu=T, experts=E, top_k=k, ranks=ranks, n_cap=n_cap,
             remote_bytes_per_gpu=remote)
  inner, reps = args.inner, args.repeats
  smap = functools.partial(parallel.shard_map, mesh=mesh, check_vma=False)

  for blocks in args.comm_blocks:
    ws = symmetric.create_workspace(mesh, "expert", max_tokens=T, hidden=hidden, top_k=k,
                                    dtype=dtype, comm_blocks=blocks)

    def dispatch_loop(x, ids, w):
      def body(_, h):
        d = cuda_ep.dispatch(h, ids, w, workspace=ws, num_experts=E, n_cap=n_cap)
        return jax.lax.dynamic_slice_in_dim(d.x_sorted, 0, T)
      return jax.lax.fori_loop(0, inner, body, x)

    def roundtrip_loop(x, ids, w):
      def body(_, h):
        d = cuda_ep.dispatch(h, ids, w, workspace=ws, num_experts=E, n_cap=n_cap)
        return cuda_ep.combine(d.x_sorted, d, ids, workspace=ws, num_experts=E)
      return jax.lax.fori_loop(0, inner, body, x)

    def grad_loop(x, ids, w):
      def body(_, h):
        def f(h, w):
          d = cuda_ep.dispatch(h, ids, w, workspace=ws, num_experts=E, n_cap=n_cap)
          return cuda_ep.combine(d.x_sorted, d, ids, workspace=ws, num_experts=E)
        y, vjp = jax.vjp(f, h, w)
        dh, _ = vjp(y)
        return dh
      return jax.lax.fori_loop(0, inner, body, x)

    specs = (P("expert"),) * 3
    fns = {name: jax.jit(smap(fn, in_specs=specs, out_specs=P("expert")))
           for name, fn in (("dispatch", dispatch_loop), ("dispatch+combine", roundtrip_loop),
                            ("fwd+bwd", grad_loop))}
    t = {name: _timeit(fn, x, ids, w, inner=inner, repeats=reps) for name, fn in fns.items()}
    t["combine"] = t["dispatch+combine"] - t["dispatch"]
    t["bwd (combine-bwd + dispatch-bwd)"] = t["fwd+bwd"] - t["dispatch+combine"]
    for name, sec in t.items():
      moves = {"dispatch": 1, "combine": 1, "dispatch+combine": 2, "fwd+bwd": 4,
               "bwd (combine-bwd + dispatch-bwd)": 2}[name]
      row[f"ms {name} (blocks={blocks})"] = sec * 1e3
      row[f"GB/s {name} (blocks={blocks})"] = moves * remote / sec / 1e9
    ws.check()
    ws.close()

  # JAX collectives on the same bytes.
  def a2a_loop(buf):
    def body(_, b):
      return jax.lax.all_to_all(b, "expert", 0, 0, tiled=True)
    return jax.lax.fori_loop(0, inner, body, buf)

  dense = jax.device_put(jnp.zeros((ranks * ranks * T, hidden), dtype), shard)
  t_a2a = _timeit(jax.jit(smap(a2a_loop, in_specs=P("expert"), out_specs=P("expert"))), dense,
                  inner=inner, repeats=reps)
  a2a_bytes = (ranks - 1) * T * hidden * 2
  row["ms jax.lax.all_to_all (every token to every rank)"] = t_a2a * 1e3
  row["GB/s jax.lax.all_to_all"] = a2a_bytes / t_a2a / 1e9

  try:
    def ragged_loop(x, ids):
      epr = E // ranks
      dest = jnp.zeros((T, ranks), bool)
      for r in range(ranks):
        dest = dest.at[:, r].set(jnp.any(ids // epr == r, axis=1))
      send_sizes = jnp.sum(dest, axis=0).astype(jnp.int32)
      order = jnp.argsort(~dest.T.reshape(-1), stable=True)  # (rank, token) pairs routed
      operand = x[order % T]
      input_offsets = (jnp.cumsum(send_sizes) - send_sizes).astype(jnp.int32)
      all_sizes = jax.lax.all_gather(send_sizes, "expert")  # [src, dst]
      me = jax.lax.axis_index("expert")
      recv_sizes = all_sizes[:, me]
      before = jnp.cumsum(all_sizes, axis=0) - all_sizes  # rows from earlier sources
      output_offsets = before[me, :].astype(jnp.int32)
      out = jnp.zeros((ranks * T, hidden), x.dtype)

      def body(_, o):
        return jax.lax.ragged_all_to_all(operand, o, input_offsets, send_sizes, output_offsets,
                                         recv_sizes, axis_name="expert")
      return jax.lax.fori_loop(0, inner, body, out)

    fn = jax.jit(smap(ragged_loop, in_specs=(P("expert"),) * 2, out_specs=P("expert")))
    t_ragged = _timeit(fn, x, ids, inner=inner, repeats=reps)
    # Subtract the one-off set-up (sort + all_gather) measured with inner=0 equivalent.
    row["ms jax.lax.ragged_all_to_all (routed tokens, incl. set-up / inner)"] = t_ragged * 1e3
    row["GB/s jax.lax.ragged_all_to_all"] = remote / t_ragged / 1e9
  except Exception as e:  # noqa: BLE001
    row["ragged_all_to_all"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
  results.append(row)
  return row


def bench_layer(mesh, args, hidden, ffn, results):
  """The whole layer forward and forward+backward: backend cuda EP vs the JAX-native layer."""
  import jax_megamoe
  from jax_megamoe.backends import reference
  ranks = mesh.shape["expert"]
  T, E, k = args.layer_tokens, args.experts, args.top_k
  dtype = jnp.bfloat16
  rng = np.random.default_rng(1)
  ids_np, w_np = _routing(rng, ranks * T, E, k)
  shard = NamedSharding(mesh, P("expert"))
  x = jax.device_put(jnp.asarray(rng.standard_normal((ranks * T, hidden)), dtype), shard)
  ids = jax.device_put(jnp.asarray(ids_np), shard)
  w = jax.device_put(jnp.asarray(w_np), shard)
  wgu = jax.device_put(jnp.asarray(rng.standard_normal((E, hidden, 2 * ffn)) * 0.02, dtype), shard)
  wd = jax.device_put(jnp.asarray(rng.standard_normal((E, ffn, hidden)) * 0.02, dtype), shard)
  row = dict(layer_hidden=hidden, layer_ffn=ffn, layer_tokens_per_gpu=T)
  impls = {
      "cuda EP (NVLink kernels) + reference grouped_mlp": functools.partial(
          cuda_ep.expert_parallel_moe, mesh=mesh, capacity_factor=1.25, check_capacity=False,
          mlp=reference.grouped_mlp),
      "reference (shard_map + padded all_to_all)": functools.partial(
          jax_megamoe.moe, mesh=mesh, backend="reference"),
  }
  try:
    from jax_megamoe.backends import cuda
    if cuda.unavailable_reason(None) is None:
      impls["cuda EP + cuda grouped_mlp"] = functools.partial(
          cuda_ep.expert_parallel_moe, mesh=mesh, capacity_factor=1.25, check_capacity=False,
          mlp=cuda.grouped_mlp)
  except (ImportError, AttributeError):
    pass
  for name, layer in impls.items():
    try:
      fwd = jax.jit(layer)
      loss = jax.jit(jax.grad(lambda x, w, a, b: jnp.sum(layer(x, ids, w, a, b).astype(
          jnp.float32)), argnums=(0, 1, 2, 3)))
      row[f"ms fwd {name}"] = _timeit(fwd, x, ids, w, wgu, wd, inner=1, repeats=args.repeats) * 1e3
      row[f"ms fwd+bwd {name}"] = _timeit(loss, x, w, wgu, wd, inner=1,
                                          repeats=args.repeats) * 1e3
    except Exception as e:  # noqa: BLE001
      row[f"{name}"] = f"failed: {type(e).__name__}: {str(e)[:300]}"
  results.append(row)
  return row


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--tokens", type=int, default=16384, help="tokens per GPU")
  parser.add_argument("--experts", type=int, default=128)
  parser.add_argument("--top-k", type=int, default=8)
  parser.add_argument("--hidden", type=int, nargs="+", default=[2048, 4096])
  parser.add_argument("--comm-blocks", type=int, nargs="+", default=[128, 264])
  parser.add_argument("--capacity-factor", type=float, default=1.25,
                      help="x_sorted rows = factor * T * k (None: dropless, R*T*min(k, E/R))")
  parser.add_argument("--inner", type=int, default=10)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--layer-tokens", type=int, default=2048)
  parser.add_argument("--layer", action=argparse.BooleanOptionalAction, default=True)
  parser.add_argument("--out", type=str, default=None)
  args = parser.parse_args()

  devices = jax.devices()
  if len(devices) < 2:
    raise SystemExit(f"needs >= 2 GPUs, found {devices}")
  mesh = Mesh(np.array(devices[:min(len(devices), 8)]), ("expert",))
  results = []
  meta = dict(devices=[d.device_kind for d in mesh.devices.flat], jax=jax.__version__,
              date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
  print(json.dumps(meta), flush=True)
  for hidden in args.hidden:
    row = bench_shape(mesh, args, hidden, results)
    print(json.dumps(row, indent=1), flush=True)
  if args.layer:
    for hidden, ffn in ((2048, 768),):
      row = bench_layer(mesh, args, hidden, ffn, results)
      print(json.dumps(row, indent=1), flush=True)
  if args.out:
    Path(args.out).write_text(json.dumps(dict(meta=meta, results=results), indent=1))


if __name__ == "__main__":
  main()

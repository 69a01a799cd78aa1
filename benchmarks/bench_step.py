"""Training-step benchmark: one AdamW step of the example Qwen3-MoE model
(jax_megamoe.models.Qwen3Moe) per MoE backend — step time, tokens/s per GPU, MFU.

The model has the published layer shapes (--config) with fewer layers (--layers) so that it fits
the GPUs at hand; per-layer costs, and so MFU, are what the full model would see. Tokens are
sharded over every device, experts over the "expert" mesh axis (EP over all devices by default),
the other parameters FSDP-sharded over "data" (as the training script lays them out).

  python3 benchmarks/bench_step.py --out results/step.json                   GPU defaults
  python3 benchmarks/bench_step.py --smoke --out /tmp/step.json              tiny, any platform
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # as bench_layer.py: appended, an installed jax_megamoe wins
  sys.path.append(str(REPO))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

from benchmarks import report, timing  # noqa: E402
from benchmarks.bench_layer import WATCHDOG_GRACE_S, git_commit, log  # noqa: E402

H200_BF16_PEAK_TFLOPS = 989.4  # dense bf16 spec; DESIGN.md §2 measured 801 for a plain matmul


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", help="tiny, qwen3-30b-a3b, qwen3-235b-a22b (default 30b; smoke tiny)")
  p.add_argument("--layers", type=int, help="decoder layers (default 4; smoke: the config's)")
  p.add_argument("--batch", type=int, help="sequences per GPU per step (default 2; smoke 2)")
  p.add_argument("--seq", type=int, help="tokens per sequence (default 2048; smoke 16)")
  p.add_argument("--backends", default="cuda,fused,reference",
                 help="in run order: the kernels first, the slow reference last")
  p.add_argument("--recipe", default="bf16", choices=("bf16", "fp8", "mxfp8"))
  p.add_argument("--remat", default="full", help="a Qwen3Moe REMAT_POLICIES name")
  p.add_argument("--ep", type=int, default=0, help="expert-parallel size (default: all devices)")
  p.add_argument("--reps", type=int, help="timed steps (default 10; smoke 2)")
  p.add_argument("--case-cap", type=float, default=20.0, help="max seconds timing one backend")
  p.add_argument("--time-budget", type=float, default=120.0,
                 help="seconds; backends not started by then are recorded as skipped")
  p.add_argument("--peak-tflops", type=float, default=H200_BF16_PEAK_TFLOPS)
  p.add_argument("--out", help="JSON (default benchmarks/results/step_<time>.json)")
  p.add_argument("--md", default=str(REPO / "benchmarks" / "RESULTS.md"))
  p.add_argument("--png", help="bar chart (default: --out with .png; '' to skip)")
  p.add_argument("--smoke", action="store_true")
  args = p.parse_args(argv)
  args.config = args.config or ("tiny" if args.smoke else "qwen3-30b-a3b")
  args.layers = args.layers if args.layers is not None else (0 if args.smoke else 4)
  args.batch = args.batch or 2
  args.seq = args.seq or (16 if args.smoke else 2048)
  args.reps = args.reps or (2 if args.smoke else 10)
  args.backends = args.backends.split(",")
  stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d_%H%M%S")
  args.out = args.out or str(REPO / "benchmarks" / "results" / f"step_{stamp}.json")
  if args.png is None:
    args.png = str(pathlib.Path(args.out).with_suffix(".png"))
  return args


def build(args, backend, mesh):
  """(model, optimizer, config) for one backend, parameters laid out over the mesh."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import optax  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415
  from jax_megamoe import models  # noqa: PLC0415

  overrides = {"num_layers": args.layers} if args.layers else {}
  config = models.get_config(args.config, **overrides)
  recipe = None if args.recipe == "bf16" else args.recipe
  model = models.Qwen3Moe(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, backend=backend,
                          recipe=recipe, mesh=mesh, remat=args.remat)
  try:  # FSDP over "data" as the training script does; without it params stay replicated
    from jax_megamoe.models.sharding import param_shardings  # noqa: PLC0415
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(jax.device_put, params, param_shardings(params, mesh)))
  except ImportError:
    pass
  optimizer = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)
  return model, optimizer, config


def make_train_step(aux_coef: float):
  import jax.numpy as jnp  # noqa: PLC0415
  import optax  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415

  def loss_fn(model, tokens):
    out = model(tokens[:, :-1], return_aux=True)
    logits, aux = out if isinstance(out, tuple) else (out, None)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    balance = jnp.mean(aux.load_balancing_loss) if aux is not None else 0.0
    return ce + aux_coef * balance

  @nnx.jit
  def train_step(model, optimizer, tokens):
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
    optimizer.update(model, grads)
    return loss

  return train_step


def bench_backend(args, backend, mesh, num_gpus, deadline) -> dict:
  import jax  # noqa: PLC0415
  from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415
  from jax_megamoe import backends  # noqa: PLC0415

  record = {"backend": backend, "config": args.config, "layers": args.layers or "all"}
  if deadline.expired:
    return dict(record, status="skipped", error="time budget")
  try:
    reason = backends.unavailable_reason(backend, None if args.recipe == "bf16" else args.recipe)
  except Exception as e:  # noqa: BLE001  (a broken backend must not stop the others)
    reason = f"the backend failed to load: {timing.classify_error(e)[1]}"
  if reason is not None:
    return dict(record, status="not available", error=reason)
  try:
    model, optimizer, config = build(args, backend, mesh)
    batch = args.batch * num_gpus
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (batch, args.seq + 1))
    tokens = jax.device_put(tokens.astype(np.int32),
                            NamedSharding(mesh, P(tuple(mesh.axis_names))))
    step = make_train_step(config.router_aux_loss_coef)
    run = lambda: jax.block_until_ready(step(model, optimizer, tokens))  # noqa: E731
    t0 = time.perf_counter()
    loss = float(run())
    compile_s = time.perf_counter() - t0
    result = timing.measure_ms(run, warmup=1, reps=args.reps, cap_s=args.case_cap, min_reps=2)
  except Exception as e:  # noqa: BLE001  (recorded, the run goes on)
    status, message = timing.classify_error(e)
    log(f"[{backend}] {status}: {message[:300]}")
    return dict(record, status=status, error=message)
  seconds = result["ms"] / 1e3
  step_tokens = batch * args.seq
  flops_per_gpu = config.train_flops_per_token(args.seq) * step_tokens / num_gpus
  record.update(status="ok", **result, compile_s=round(compile_s, 1), first_loss=loss,
                tokens_per_s_per_gpu=step_tokens / seconds / num_gpus,
                tflops_per_gpu=flops_per_gpu / seconds / 1e12,
                mfu=flops_per_gpu / seconds / (args.peak_tflops * 1e12))
  log(f"[{backend}] {result['ms']:.2f} ms/step, {record['tokens_per_s_per_gpu']:.0f} tok/s/GPU, "
      f"MFU {record['mfu']:.1%} (compile+first {compile_s:.0f} s, loss {loss:.3f})")
  return record


def main(argv=None) -> dict:
  args = parse_args(argv)
  deadline = timing.Deadline(args.time_budget)
  started = time.time()
  import jax  # noqa: PLC0415
  from jax.sharding import Mesh  # noqa: PLC0415
  devices = jax.devices()
  ep = args.ep or len(devices)
  mesh = Mesh(np.array(devices).reshape(len(devices) // ep, ep), ("data", "expert"))
  meta = {
      "kind": "step", "device": f"{len(devices)} x {devices[0].device_kind}",
      "platform": devices[0].platform, "jax_version": jax.__version__,
      "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
      "commit": git_commit(),
      "command": " ".join(["python3", "benchmarks/bench_step.py", *(argv or sys.argv[1:])]),
      "config": args.config, "layers": args.layers or "all", "batch": args.batch * len(devices),
      "seq_len": args.seq, "ep": ep, "remat": args.remat, "recipe": args.recipe,
      "reps": args.reps, "peak_tflops": args.peak_tflops, "smoke": args.smoke,
  }
  log(f"bench_step: {meta['device']}, {args.config} x {meta['layers']} layers, batch "
      f"{meta['batch']} x {args.seq}, EP={ep}, remat {args.remat}")
  records: list[dict] = []

  def write(partial: bool) -> dict:
    meta["wall_s"] = round(time.time() - started, 1)
    result = {"meta": dict(meta, partial=partial), "results": records}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=float))
    log(f"wrote {out}")
    return result

  def give_up():
    log("watchdog: past the time budget; writing what was measured")
    meta["watchdog"] = True
    done = {r["backend"] for r in records}
    records.extend({"backend": b, "config": args.config, "status": "failed",
                    "error": "watchdog: still running past the time budget (hung or slow)"}
                   for b in args.backends if b not in done)
    finish(write(partial=True), args)

  watchdog = timing.start_watchdog(args.time_budget + WATCHDOG_GRACE_S, give_up)
  try:
    importlib.import_module("jax_megamoe.models")  # ImportError: not merged yet
    for backend in args.backends:
      records.append(bench_backend(args, backend, mesh, len(devices), deadline))
      write(partial=True)
  except ImportError as e:
    records += [{"backend": b, "config": args.config, "status": "not available",
                 "error": f"the example model is not in this checkout ({e})"}
                for b in args.backends]
  finally:
    watchdog.cancel()
  result = write(partial=False)
  finish(result, args)
  return result


def finish(result, args):
  """Markdown, chart and the short table, once the JSON is written."""
  if args.md:
    report.append_markdown(result, pathlib.Path(args.md))
  if args.png:
    try:
      report.bar_chart(result, pathlib.Path(args.png))
    except Exception as e:  # noqa: BLE001
      log(f"no chart: {timing.classify_error(e)[1]}")
  log("")
  log(report.short_table(result))


if __name__ == "__main__":
  main()

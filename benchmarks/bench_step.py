"""Training-step benchmark: the example's training step (examples/train_qwen3_moe.py, through
benchmarks/train_step.py) per MoE backend -- step time, tokens/s per GPU, MFU, peak memory and
the routing imbalance of the steps it timed.

The model has the published layer shapes (--config) with fewer layers (--layers) so that it fits
the GPUs at hand. Default 8 layers of the 30B config: the decoder layers are then 59% of the
active matmul parameters per token and the LM head 41% (at 4 layers the head was 58%; the full
48-layer model has it at 10%), and the step fits one H200 (141 GB; profile_step ran it there
with the compute copy, benchmarks/RESULTS.md session 6): AdamW's float32 state is 16 bytes per
parameter, the example's bf16 compute copy 2 more (its gradients take 2 less than float32
ones), ~11 GB per layer (its 128 experts hold 604M parameters) and ~11 GB for the embedding
and head. Tokens are sharded over every device (16,384 per GPU by default, as in the layer
benchmark), experts over the "expert" mesh axis (EP over all devices by default), the other
parameters FSDP-sharded over "data", as the training script lays them out. The batch is
uniform random ids by default: at initialisation their routing is near balanced (imbalance 1.4
at the 30B shapes), as a trained model's is; `--data corpus` takes the example's default corpus
instead (imbalance ~6 at initialisation: 29% of its bytes are spaces).

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


from benchmarks import report, timing  # noqa: E402
from benchmarks.bench_layer import WATCHDOG_GRACE_S, git_commit, log  # noqa: E402

H200_BF16_PEAK_TFLOPS = 989.4  # dense bf16 spec; DESIGN.md §2 measured 801 for a plain matmul


DEFAULT_LAYERS = 8  # see the module docstring


def add_step_arguments(p: argparse.ArgumentParser) -> None:
  """The options of the step itself (shared with profile_step.py)."""
  from jax_megamoe.router import SELECTION_NORMS  # noqa: PLC0415
  p.add_argument("--config", help="tiny, qwen3-30b-a3b, qwen3-235b-a22b (default 30b; smoke tiny)")
  p.add_argument("--layers", type=int,
                 help=f"decoder layers (default {DEFAULT_LAYERS}; smoke: the config's)")
  p.add_argument("--tokens-per-gpu", type=int,
                 help="tokens per GPU per step (default 16384 as bench_layer.py; smoke 32)")
  p.add_argument("--seq", type=int, help="tokens per sequence (default 4096; smoke 16)")
  p.add_argument("--recipe", default="bf16", choices=("bf16", "fp8", "mxfp8"))
  p.add_argument("--remat", default="full", help="a Qwen3Moe REMAT_POLICIES name")
  p.add_argument("--attention", default="auto", choices=("auto", "xla", "cudnn"),
                 help="auto: cuDNN flash attention where it runs, else xla (says why)")
  p.add_argument("--ce-chunk", type=int,
                 help="cross-entropy positions per chunk; 0: full logits; default: as the "
                      "example (full logits up to 1 GiB per device, else chunks)")
  p.add_argument("--data", default="random", choices=("random", "corpus"),
                 help="uniform random ids (default: routing near balanced from the first step, "
                      "as a trained model's) or a batch of the example's default corpus (29%% "
                      "spaces: routed by token, no router does better than imbalance ~4.7)")
  p.add_argument("--selection-norm", default=None, choices=SELECTION_NORMS,
                 help="the routers' top-k rule (Qwen3MoeConfig.router_selection_norm; default: "
                      "the config's, balance for the published configs, none for tiny)")
  p.add_argument("--ep", type=int, default=0, help="expert-parallel size (default: all devices)")
  p.add_argument("--compute-copy", action=argparse.BooleanOptionalAction, default=True,
                 help="the example's bf16 compute copy of the weights (default on, as the "
                      "example's bf16 runs; --no-compute-copy: each step casts every weight "
                      "and gradient itself)")
  p.add_argument("--peak-tflops", type=float, default=H200_BF16_PEAK_TFLOPS)
  p.add_argument("--smoke", action="store_true")


def finish_step_arguments(args) -> None:
  """Fills the size defaults (smoke: tiny sizes) and checks them."""
  args.config = args.config or ("tiny" if args.smoke else "qwen3-30b-a3b")
  args.layers = args.layers if args.layers is not None else (0 if args.smoke else DEFAULT_LAYERS)
  args.tokens_per_gpu = args.tokens_per_gpu or (32 if args.smoke else 16384)
  args.seq = args.seq or (16 if args.smoke else 4096)
  for name in ("tokens_per_gpu", "seq"):
    if getattr(args, name) < 1:
      raise SystemExit(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
  if args.tokens_per_gpu % args.seq:
    raise SystemExit(f"--tokens-per-gpu {args.tokens_per_gpu} must be a multiple of --seq "
                     f"{args.seq} (every GPU holds whole sequences)")


def step_options(args, backend: str):
  from benchmarks.train_step import StepOptions  # noqa: PLC0415
  return StepOptions(config=args.config, layers=args.layers, tokens_per_gpu=args.tokens_per_gpu,
                     seq=args.seq, backend=backend,
                     recipe=None if args.recipe == "bf16" else args.recipe, remat=args.remat,
                     attention=args.attention, ce_chunk=args.ce_chunk, data=args.data,
                     ep=args.ep, compute_copy=args.compute_copy,
                     selection_norm=args.selection_norm)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  add_step_arguments(p)
  p.add_argument("--backends", default="cuda,fused,reference",
                 help="in run order: the kernels first, the slow reference last")
  p.add_argument("--reps", type=int, help="timed steps (default 10; smoke 2)")
  p.add_argument("--case-cap", type=float, default=20.0, help="max seconds timing one backend")
  p.add_argument("--time-budget", type=float, default=420.0,
                 help="seconds; backends not started by then are recorded as skipped")
  p.add_argument("--out", help="JSON (default benchmarks/results/step_<time>.json)")
  p.add_argument("--md", default=str(REPO / "benchmarks" / "RESULTS.md"))
  p.add_argument("--png", help="bar chart (default: --out with .png; '' to skip)")
  args = p.parse_args(argv)
  finish_step_arguments(args)
  args.reps = args.reps or (2 if args.smoke else 10)
  args.backends = args.backends.split(",")
  stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d_%H%M%S")
  args.out = args.out or str(REPO / "benchmarks" / "results" / f"step_{stamp}.json")
  if args.png is None:
    args.png = str(pathlib.Path(args.out).with_suffix(".png"))
  return args


def peak_memory_gib(devices) -> float | None:
  """Largest peak of device memory in use so far (GiB), where the platform reports it."""
  peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]
  peaks = [p for p in peaks if p]
  return max(peaks) / 2**30 if peaks else None


def bench_backend(args, backend, num_gpus, deadline) -> dict:
  import jax  # noqa: PLC0415
  from benchmarks import train_step  # noqa: PLC0415
  from jax_megamoe import _ffi, backends, router  # noqa: PLC0415
  from jax_megamoe.models import losses  # noqa: PLC0415

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
    setup = train_step.build(step_options(args, backend))
    for note in setup.notes:
      log(f"[{backend}] {note}")
    record.update(attention=setup.args.attention, ce_chunk=setup.args.ce_chunk,
                  ce_kernel=losses.CE_KERNEL, balance_kernel=router.BALANCE_KERNEL)
    last = {}

    def run():
      last["metrics"] = setup.run()
      jax.block_until_ready(last["metrics"])

    launches_before = _ffi.launch_counts()
    t0 = time.perf_counter()
    run()
    compile_s = time.perf_counter() - t0
    loss = float(last["metrics"]["loss"])
    imbalance_first = setup.imbalance(last["metrics"])
    result = timing.measure_ms(run, warmup=1, reps=args.reps, cap_s=args.case_cap, min_reps=2)
    imbalance_last = setup.imbalance(last["metrics"])
  except Exception as e:  # noqa: BLE001  (recorded, the run goes on)
    status, message = timing.classify_error(e)
    log(f"[{backend}] {status}: {message[:300]}")
    return dict(record, status=status, error=message)
  seconds = result["ms"] / 1e3
  step_tokens = setup.tokens_per_step
  config = setup.config
  flops_per_gpu = config.train_flops_per_token(args.seq) * step_tokens / num_gpus
  record.update(status="ok", **result, compile_s=round(compile_s, 1), first_loss=loss,
                tokens_per_s_per_gpu=step_tokens / seconds / num_gpus,
                tflops_per_gpu=flops_per_gpu / seconds / 1e12,
                mfu=flops_per_gpu / seconds / (args.peak_tflops * 1e12),
                imbalance_first=imbalance_first, imbalance_last=imbalance_last,
                selection_norm=config.router_selection_norm,
                peak_gib=peak_memory_gib(jax.local_devices()),
                # Kernels a heuristic picked, launched by this case's handlers (a replayed CUDA
                # graph does not count): which path the step took (ffi/common/launch_counts.h).
                launches={k: v - launches_before.get(k, 0)
                          for k, v in _ffi.launch_counts().items()})
  log(f"[{backend}] {result['ms']:.2f} ms/step, {record['tokens_per_s_per_gpu']:.0f} tok/s/GPU, "
      f"MFU {record['mfu']:.1%}, routing ({config.router_selection_norm}) imbalance "
      f"{imbalance_first:.2f} (first step) -> "
      f"{imbalance_last:.2f} (last timed; 1 = balanced, {config.num_experts / config.top_k:g} "
      f"= one expert takes every token) (compile+first {compile_s:.0f} s, loss {loss:.3f})")
  return record


def main(argv=None) -> dict:
  args = parse_args(argv)
  deadline = timing.Deadline(args.time_budget)
  started = time.time()
  import jax  # noqa: PLC0415
  devices = jax.devices()
  ep = args.ep or len(devices)
  meta = {
      "kind": "step", "device": f"{len(devices)} x {devices[0].device_kind}",
      "platform": devices[0].platform, "jax_version": jax.__version__,
      "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
      "commit": git_commit(),
      "command": " ".join(["python3", "benchmarks/bench_step.py", *(argv or sys.argv[1:])]),
      "config": args.config, "layers": args.layers or "all",
      "batch": args.tokens_per_gpu // args.seq * len(devices), "seq_len": args.seq,
      "tokens_per_gpu": args.tokens_per_gpu, "ep": ep, "remat": args.remat,
      "recipe": args.recipe, "attention": args.attention, "data": args.data,
      "compute_copy": args.compute_copy, "selection_norm": args.selection_norm,
      "reps": args.reps, "peak_tflops": args.peak_tflops, "smoke": args.smoke,
  }
  log(f"bench_step: {meta['device']}, {args.config} x {meta['layers']} layers, "
      f"{args.tokens_per_gpu} tokens/GPU ({meta['batch']} x {args.seq} per step), EP={ep}, "
      f"remat {args.remat}, attention {args.attention}, data {args.data}")
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
      records.append(bench_backend(args, backend, len(devices), deadline))
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

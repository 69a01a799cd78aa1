"""Where a training step's device time goes: profiles a few steps of the example's training step
(built as bench_step.py builds it, benchmarks/train_step.py) with jax.profiler, or reads a trace
made elsewhere, and prints and records the time per category -- MoE kernels per kind and
direction, attention, LM head + cross-entropy, norms/RoPE/elementwise, router + aux losses,
optimizer, dtype casts, collectives, idle gaps (benchmarks/step_categories.py says how each
kernel is placed: kernel names, the compiled HLO's instructions and the model's named scopes).

  python3 benchmarks/profile_step.py --backend cuda                 30B x 8 layers, 16,384 tok/GPU
  python3 benchmarks/profile_step.py --smoke                         tiny, any platform (CI)
  python3 benchmarks/profile_step.py --trace DIR [--hlo module.hlo.txt]   a trace made elsewhere

Running, it writes the trace (jax.profiler: .xplane.pb and trace.json.gz) and the step's
compiled HLO (<module>.hlo.txt) under --trace-dir, the JSON to --out and a markdown section to
--md (benchmarks/RESULTS.md). On GPUs XLA's command buffers (CUDA graphs) are turned off while
profiling (--command-buffers keep leaves them): kernels replayed from a graph carry the graph's
annotation, not their own HLO op. XLA:CPU runs its "device" work as thunks on host threads:
the same tables, from those.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # as bench_layer.py: appended, an installed jax_megamoe wins
  sys.path.append(str(REPO))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from benchmarks import bench_step, hlo_ops, report, step_breakdown, trace_events  # noqa: E402
from benchmarks.bench_layer import git_commit, log  # noqa: E402

NO_COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer="


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  bench_step.add_step_arguments(p)
  p.add_argument("--backend", default="auto", help="MoE backend of the profiled step")
  p.add_argument("--steps", type=int, default=3, help="profiled steps (after the warm-up)")
  p.add_argument("--warmup", type=int, default=2, help="steps run before tracing")
  p.add_argument("--trace", help="read this trace (a file, or a jax.profiler.trace directory) "
                                 "instead of running a step")
  p.add_argument("--hlo", action="append", default=[],
                 help="HLO text of the traced module (repeatable; with --trace; default: the "
                      "*.hlo.txt files under the trace directory)")
  p.add_argument("--module", help="the HLO module of the step (default: the one with the "
                                  "most device time)")
  p.add_argument("--trace-dir", help="where to write the trace (default "
                                     "benchmarks/results/profile_<time>)")
  p.add_argument("--command-buffers", choices=("off", "keep"), default="off",
                 help="XLA's CUDA-graph command buffers while profiling (off: every kernel "
                      "carries its HLO op)")
  p.add_argument("--out", help="JSON (default: <trace-dir>/profile.json)")
  p.add_argument("--md", default=str(REPO / "benchmarks" / "RESULTS.md"),
                 help="markdown file to append the tables to ('' to skip)")
  args = p.parse_args(argv)
  bench_step.finish_step_arguments(args)
  for name in ("steps", "warmup"):
    if getattr(args, name) < (1 if name == "steps" else 0):
      p.error(f"--{name} must be >= {1 if name == 'steps' else 0}, got {getattr(args, name)}")
  stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d_%H%M%S")
  if args.trace is None:
    args.trace_dir = args.trace_dir or str(REPO / "benchmarks" / "results" / f"profile_{stamp}")
  elif args.trace_dir:
    p.error("--trace-dir is for a run; --trace reads an existing trace")
  base = pathlib.Path(args.trace_dir or args.trace)
  args.out = args.out or str((base if base.is_dir() or args.trace is None else base.parent)
                             / "profile.json")
  return args


def hlo_files_near(trace: pathlib.Path) -> list[pathlib.Path]:
  """*.hlo.txt under a trace directory, or beside a trace file and up to the directory
  jax.profiler.trace was given (<dir>/plugins/profile/<run>/<file>)."""
  if trace.is_dir():
    return sorted(trace.rglob("*.hlo.txt"))
  for parent in list(trace.parents)[:4]:
    found = sorted(parent.glob("*.hlo.txt"))
    if found:
      return found
  return []


def read_hlo(paths) -> dict[str, hlo_ops.HloModuleInfo]:
  modules = {}
  for path in paths:
    info = hlo_ops.parse_hlo_text(pathlib.Path(path).read_text())
    modules[info.name] = info
  return modules


def run_and_trace(args) -> tuple[dict, pathlib.Path, dict]:
  """Builds the step, writes its HLO, runs the warm-up, traces `args.steps` steps queued back
  to back (as a training loop runs them). Returns (meta about the step, trace dir, HLO)."""
  import jax  # noqa: PLC0415
  from benchmarks import train_step  # noqa: PLC0415
  from jax_megamoe import backends, router  # noqa: PLC0415
  from jax_megamoe.models import losses  # noqa: PLC0415

  recipe = None if args.recipe == "bf16" else args.recipe
  backend = backends.resolve(args.backend, recipe).NAME  # "auto" -> what runs
  setup = train_step.build(bench_step.step_options(args, backend))
  for note in setup.notes:
    log(note)
  compiled = setup.step.lower(setup.state, setup.inputs, setup.targets).compile()
  info = hlo_ops.parse_hlo_text(compiled.as_text())
  trace_dir = pathlib.Path(args.trace_dir)
  trace_dir.mkdir(parents=True, exist_ok=True)
  (trace_dir / f"{info.name}.hlo.txt").write_text(compiled.as_text())
  t0 = time.perf_counter()
  for _ in range(args.warmup):
    jax.block_until_ready(setup.run(compiled))
  warm_s = time.perf_counter() - t0
  with jax.profiler.trace(str(trace_dir)):
    for _ in range(args.steps):
      metrics = setup.run(compiled)
    jax.block_until_ready(metrics)
  config = setup.config
  meta = dict(config=args.config, layers=config.num_layers, tokens_per_gpu=args.tokens_per_gpu,
              seq_len=args.seq, backend=backend, recipe=args.recipe, remat=args.remat,
              attention=setup.args.attention, ce_chunk=setup.args.ce_chunk,
              ce_kernel=losses.CE_KERNEL, balance_kernel=router.BALANCE_KERNEL,
              compute_copy=setup.args.compute_copy, ep=args.ep or jax.device_count(),
              data=args.data, imbalance=setup.imbalance(metrics),
              loss=float(metrics["loss"]), warmup_s=round(warm_s, 2))
  return meta, trace_dir, {info.name: info}


def main(argv=None) -> dict:
  args = parse_args(argv)
  if args.trace is None and args.command_buffers == "off":
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_enable_command_buffer" not in flags:  # before the backend starts
      os.environ["XLA_FLAGS"] = f"{flags} {NO_COMMAND_BUFFERS}".strip()
  import jax  # noqa: PLC0415

  if args.trace is None:
    step_meta, trace_path, hlo = run_and_trace(args)
    if jax.devices()[0].platform == "gpu":
      step_meta["command_buffers"] = args.command_buffers
    module = args.module or next(iter(hlo))
    steps = args.steps
  else:
    trace_path = pathlib.Path(args.trace)
    hlo = read_hlo(args.hlo or hlo_files_near(trace_path))
    step_meta, module, steps = {}, args.module, None
  trace = trace_events.read_trace(trace_path)
  profile = step_breakdown.breakdown(trace, hlo, module=module, steps=steps)
  devices = jax.devices()
  meta = dict(kind="step_profile", jax_version=jax.__version__, commit=git_commit(),
              date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              command=" ".join(["python3", "benchmarks/profile_step.py",
                                *(argv if argv is not None else sys.argv[1:])]),
              smoke=args.smoke, **step_meta)
  if args.trace is None:
    meta["device"] = f"{len(devices)} x {devices[0].device_kind}"
  else:
    meta["device"] = f"{len(profile['devices'])} {profile['platform']} device(s) of the trace"
  result = dict(meta=meta, profile=profile)
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=1))
  log(report.short_table(result))
  log(f"outside GEMMs, attention and the optimizer: "
      f"{profile['outside_gemm_attention_optimizer_share']:.1%} of the step"
      + (f"; routing imbalance {meta['imbalance']:.2f}" if "imbalance" in meta else ""))
  log(f"wrote {out}" + (f" (trace and HLO in {trace_path})" if args.trace is None else ""))
  if args.md:
    report.append_markdown(result, pathlib.Path(args.md))
  return result


if __name__ == "__main__":
  main()

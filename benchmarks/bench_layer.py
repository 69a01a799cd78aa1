"""Per-layer MoE benchmark: Prime Intellect's published set-up (DESIGN.md §2), every
implementation side by side in one run.

Expert parallelism over all visible GPUs, 16,384 tokens per GPU, 128 experts, top-8, random
routing identical for every implementation (same seed; optional Zipf skew), no router; shapes
30b (H=2048, F=768) and 235b (H=4096, F=1536); recipes bf16 and fp8; passes fwd, bwd and
2f1b (2 forwards + 1 backward, the cost under full activation checkpointing). Median of
device-synchronised timings after warm-up ("ms": every call waited for), and beside it the
per-call time of calls queued back to back ("queued_ms", benchmarks/timing.py: the host's round
trip per call hidden, as inside a training step).

Implementations: jax_megamoe.moe with backend reference / cuda / fused (each where available),
the JAX-native layer (benchmarks/baselines/jax_native.py: argsort + ragged_all_to_all +
ragged_dot) and the PyTorch layer (benchmarks/baselines/torch_layer.py, under torchrun, where
torch is installed). Every failure is recorded with its message; the run goes on.

  python3 benchmarks/bench_layer.py --out results/layer.json          full run (GPU)
  python3 benchmarks/bench_layer.py --check                            numerics vs reference
  python3 benchmarks/bench_layer.py --smoke --out /tmp/smoke.json      tiny, any platform

Writes the JSON (--out), appends a markdown table to --md and draws a PNG chart (--png,
default: --out with .png), then prints a short table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: make `benchmarks` importable. Appended, so an
  sys.path.append(str(REPO))   # installed jax_megamoe wins over the source tree's
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPUs

import numpy as np  # noqa: E402

from benchmarks import problem as problem_lib, report, timing  # noqa: E402

TORCH_SCRIPT = REPO / "benchmarks" / "baselines" / "torch_layer.py"
# Run order (torch first, in its own processes, while the GPUs are still empty): the kernels
# before the baselines and the slow reference last, in case the time budget runs out.
ALL_IMPLS = ("torch", "megamoe:fused", "megamoe:cuda", "jax_native", "megamoe:reference")
WATCHDOG_GRACE_S = 90.0
WATCHDOG_EXIT = 3  # timing.start_watchdog's exit status


def log(*parts):
  print(*parts, flush=True)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--tokens", type=int, help="tokens per GPU (default 16384; smoke 32; check 64)")
  p.add_argument("--shapes", help="comma list of 30b, 235b, small, tiny (default 30b,235b; "
                 "smoke tiny; check small)")
  p.add_argument("--recipes", help="comma list of bf16, fp8 or any jax_megamoe recipe "
                 "(default bf16,fp8)")
  p.add_argument("--passes", default="fwd,bwd,2f1b", help="comma list of fwd, bwd, 2f1b")
  p.add_argument("--impls", default=",".join(ALL_IMPLS), help="comma list, run order as given")
  p.add_argument("--ep", type=int, default=0, help="expert-parallel size (default: all devices)")
  p.add_argument("--devices", type=int, default=0, help="use the first N devices (default all)")
  p.add_argument("--experts", type=int, default=problem_lib.NUM_EXPERTS)
  p.add_argument("--top-k", type=int, default=problem_lib.TOP_K)
  p.add_argument("--skew", type=float, default=0.0, help="Zipf exponent of routing (0: uniform)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--reps", type=int, help="timed repetitions per pass (default 20; smoke 3)")
  p.add_argument("--case-cap", type=float, default=3.0, help="max seconds timing one pass")
  p.add_argument("--time-budget", type=float, default=200.0,
                 help="seconds for the whole run; passes past it are recorded as skipped")
  p.add_argument("--torch-budget", type=float, default=70.0, help="seconds for the torch part")
  p.add_argument("--torch-variant", choices=("lean", "naive"), default="lean",
                 help="torch_layer.py --variant (naive: the first version, for comparison)")
  p.add_argument("--out", help="JSON results (default benchmarks/results/layer_<time>.json)")
  p.add_argument("--md", default=str(REPO / "benchmarks" / "RESULTS.md"),
                 help="markdown file the table is appended to ('' to skip)")
  p.add_argument("--png", help="bar chart (default: --out with .png; '' to skip)")
  p.add_argument("--isolate", choices=("auto", "on", "off"), default="auto",
                 help="each JAX implementation in its own process, so that a crash (an XLA "
                 "abort, a CUDA fault) costs only its own numbers (auto: on for GPUs)")
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # run by --isolate
  p.add_argument("--smoke", action="store_true", help="tiny sizes, few reps (CI, any platform)")
  p.add_argument("--check", action="store_true",
                 help="numerics of every implementation against the reference, no timing")
  args = p.parse_args(argv)
  small = args.smoke or args.check
  args.tokens = args.tokens or (32 if args.smoke else 64 if args.check else 16384)
  default_shapes = "small" if args.check else "tiny" if args.smoke else "30b,235b"
  args.shapes = (args.shapes or default_shapes).split(",")
  args.recipes = (args.recipes or ("bf16" if small else "bf16,fp8")).split(",")
  args.passes = args.passes.split(",")
  args.impls = args.impls.split(",")
  args.reps = args.reps or (3 if args.smoke else 20)
  stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d_%H%M%S")
  kind = "layer_check" if args.check else "layer"
  args.out = args.out or str(REPO / "benchmarks" / "results" / f"{kind}_{stamp}.json")
  if args.png is None:
    args.png = str(pathlib.Path(args.out).with_suffix(".png"))
  return args


def git_commit() -> str:
  if os.environ.get("JAX_MEGAMOE_COMMIT"):
    return os.environ["JAX_MEGAMOE_COMMIT"]
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown (no git; set JAX_MEGAMOE_COMMIT)"


def torch_installed() -> bool:
  import importlib.util  # noqa: PLC0415
  return importlib.util.find_spec("torch") is not None


def make_mesh(args):
  import jax  # noqa: PLC0415
  from jax.sharding import Mesh  # noqa: PLC0415
  devices = jax.devices()[:args.devices or None]
  ep = args.ep or len(devices)
  if len(devices) % ep:
    raise SystemExit(f"--ep {ep} must divide the {len(devices)} devices")
  grid = np.array(devices).reshape(len(devices) // ep, ep)
  return Mesh(grid, ("data", "expert")), devices


def device_inputs(prob, mesh, ids, weights, seed):
  """Inputs generated on the devices, already sharded (tokens over all axes, experts over
  'expert'); bf16 values with unit-scale activations."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415
  tokens = NamedSharding(mesh, P(tuple(mesh.axis_names)))
  experts = NamedSharding(mesh, P("expert"))
  keys = jax.random.split(jax.random.key(seed), 4)
  t, h, f, e = prob.num_tokens, prob.hidden, prob.ffn, prob.num_experts

  def normal(key, shape, scale, sharding):
    return jax.jit(lambda k: jax.random.normal(k, shape, jnp.bfloat16) * jnp.bfloat16(scale),
                   out_shardings=sharding)(key)

  x = normal(keys[0], (t, h), 1.0, tokens)
  wgu = normal(keys[1], (e, h, 2 * f), h ** -0.5, experts)
  wd = normal(keys[2], (e, f, h), f ** -0.5, experts)
  dy = normal(keys[3], (t, h), 1.0, tokens)
  inputs = (x, jax.device_put(ids, tokens), jax.device_put(weights, tokens), wgu, wd)
  return inputs, dy


# --- the parts of a run -------------------------------------------------------------------------

def run_torch(args, num_devices, ep, routing_path, budget_s) -> list[dict]:
  """The PyTorch layer under torchrun; its records, or one failure record per case."""
  def every_case(status, error):
    return [{"impl": "torch", "shape": s, "recipe": r, "pass": p, "status": status,
             "error": error} for s in args.shapes for r in args.recipes for p in args.passes]

  if not torch_installed():
    return every_case("not available", "torch is not installed")
  with tempfile.TemporaryDirectory() as tmp:
    out = pathlib.Path(tmp, "torch.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={num_devices}", str(TORCH_SCRIPT), f"--routing={routing_path}",
           f"--shapes={','.join(args.shapes)}", f"--recipes={','.join(args.recipes)}",
           f"--passes={','.join(args.passes)}",
           f"--experts={args.experts}", f"--ep={ep}", f"--reps={args.reps}",
           f"--case-cap={args.case_cap}", f"--time-budget={max(budget_s - 30, 5)}",
           f"--variant={args.torch_variant}", f"--out={out}"]
    log(f"[torch] {' '.join(cmd[2:])}")
    rc, stdout, stderr = run_process(cmd, timeout_s=budget_s + 60, capture_stdout=True)
    for line in stdout.splitlines()[-20:]:
      log(f"[torch] {line}")
    data = json.loads(out.read_text()) if out.exists() else {"meta": {}, "results": []}
  records = [dict(r, torch_meta=data["meta"]) if i == 0 else r
             for i, r in enumerate(data["results"])]
  if rc != 0:  # keep what it saved; every other case gets the failure
    status, message = timing.classify_error(stderr[-3000:] or f"exit status {rc}")
    log(f"[torch] torchrun ended with {rc}: {message[-300:]}")
    done = {(r["shape"], r["recipe"], r["pass"]) for r in records}
    records += [r for r in every_case(status, f"torchrun ended ({rc}): {message}")
                if (r["shape"], r["recipe"], r["pass"]) not in done]
  return records


def run_process(cmd, *, timeout_s: float, capture_stdout: bool):
  """(exit status or "timeout after N s", stdout, stderr) of cmd. It runs in its own process
  group, and a timeout kills the whole group: torchrun's workers must not outlive it holding
  GPU memory. Without capture_stdout the child's output streams through (progress)."""
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE if capture_stdout else None,
                          stderr=subprocess.PIPE, text=True, start_new_session=True)
  try:
    stdout, stderr = proc.communicate(timeout=timeout_s)
    return proc.returncode, stdout or "", stderr or ""
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    stdout, stderr = proc.communicate()
    return f"timeout after {timeout_s:.0f} s", stdout or "", stderr or ""


def run_jax(args, mesh, ids, weights, deadline, records: list[dict], save=lambda: None):
  """Appends the JAX implementations' records to `records`, calling save() after each case."""
  from benchmarks import jax_impls  # noqa: PLC0415
  from jax_megamoe import _ffi  # noqa: PLC0415
  impls = [i for i in args.impls if i != "torch"]
  # Recipe-major: every shape's bf16 numbers before any fp8 one, in case the budget runs out.
  for recipe in args.recipes:
    for shape in args.shapes:
      prob = problem_lib.make_problem(shape, args.tokens, mesh.devices.size,
                                      mesh.shape["expert"], args.experts, args.top_k)
      inputs = dy = None
      for impl in impls:
        base = {"impl": impl, "shape": shape, "hidden": prob.hidden, "ffn": prob.ffn,
                "recipe": recipe}
        reason = jax_impls.unavailable_reason(impl, recipe)
        if reason is not None:
          log(f"[{impl}] {shape} {recipe}: not available: {reason}")
          records += [dict(base, **{"pass": p, "status": "not available", "error": reason})
                      for p in args.passes]
          continue
        log(f"[{impl}] {shape} {recipe}")
        if inputs is None:
          try:
            inputs, dy = device_inputs(prob, mesh, ids, weights, args.seed)
          except Exception as e:  # noqa: BLE001
            status, message = timing.classify_error(e)
            records += [dict(base, **{"pass": p, "status": status,
                                      "error": f"inputs: {message}"}) for p in args.passes]
            continue
        layer = jax_impls.make_layer(impl, recipe, mesh)
        impl_inputs = jax_impls.layer_inputs(impl, recipe, mesh, inputs)
        try:
          reason = None if deadline.expired else jax_impls.fallback_reason(impl, layer,
                                                                           impl_inputs)
        except Exception:  # noqa: BLE001  (a layer that fails to lower: time_passes records why)
          reason = None
        if reason is not None:
          log(f"[{impl}] {shape} {recipe}: not timed: {reason}")
          records += [dict(base, **{"pass": p, "status": "not available", "error": reason})
                      for p in args.passes]
          continue
        before = _ffi.launch_counts()
        per_pass = jax_impls.time_passes(layer, impl_inputs, dy, args.passes, reps=args.reps,
                                         case_cap_s=args.case_cap, deadline=deadline, log=log)
        # Kernels a heuristic or an override picked, launched by this case's handlers (a
        # replayed CUDA graph does not count): which path the case took, e.g. whether
        # MEGAMOE_FUSED_L2_TMA=1 reached the kernel (ffi/common/launch_counts.h).
        launches = {k: v - before.get(k, 0) for k, v in _ffi.launch_counts().items()}
        if any(launches.values()):
          log(f"    launches: {', '.join(f'{k} {v}' for k, v in launches.items() if v)}")
        records += [dict(base, **{"pass": p}, **r, launches=launches) for p, r in per_pass.items()]
        save()
      del inputs, dy


def run_jax_isolated(args, mesh, deadline, records: list[dict], save=lambda: None):
  """run_jax with each runnable implementation in a child process of this script; the time left
  is shared among them. A child that dies leaves its saved records plus one failure record for
  every case it did not finish."""
  from benchmarks import jax_impls  # noqa: PLC0415
  impls = [i for i in args.impls if i != "torch"]
  runnable = [i for i in impls
              if any(jax_impls.unavailable_reason(i, r) is None for r in args.recipes)]
  for impl in impls:
    if impl not in runnable:  # recorded as not available without a process
      run_jax(_with(args, impls=[impl]), mesh, None, None, deadline, records, save)
      continue
    budget = max(deadline.left() / (len(runnable) - runnable.index(impl)), 1.0)
    with tempfile.TemporaryDirectory() as tmp:
      out = pathlib.Path(tmp, "child.json")
      cmd = [sys.executable, str(pathlib.Path(__file__).resolve()),
             *_child_argv(args, mesh.shape["expert"]),
             "--impls", impl, "--time-budget", f"{budget:.0f}", "--out", str(out), "--md", "",
             "--png", "", "--isolate", "off", "--child"]
      log(f"[{impl}] own process, {budget:.0f} s")
      rc, _, stderr = run_process(cmd, timeout_s=budget + WATCHDOG_GRACE_S + 60,
                                  capture_stdout=False)
      got = json.loads(out.read_text())["results"] if out.exists() else []
    got = [r for r in got if r["impl"] == impl]
    records += got
    if rc != 0:
      status, message = timing.classify_error(stderr[-2000:] or f"exit status {rc}")
      if rc == WATCHDOG_EXIT:
        status, message = "failed", "watchdog: still running past its budget (hang or slow compile)"
      log(f"[{impl}] process ended with {rc}: {message[-300:]}")
      done = {(r["shape"], r["recipe"], r["pass"]) for r in got}
      records += [{"impl": impl, "shape": s, "recipe": r, "pass": p, "status": status,
                   "error": f"process ended ({rc}): {message}"}
                  for r in args.recipes for s in args.shapes for p in args.passes
                  if (s, r, p) not in done]
    save()


def _with(args, **changes):
  return argparse.Namespace(**{**vars(args), **changes})


def _child_argv(args, ep) -> list[str]:
  """The options that define the problem, for a child process of this script."""
  argv = ["--tokens", str(args.tokens), "--shapes", ",".join(args.shapes), "--recipes",
          ",".join(args.recipes), "--passes", ",".join(args.passes), "--ep", str(ep),
          "--devices", str(args.devices), "--experts", str(args.experts), "--top-k",
          str(args.top_k), "--skew", str(args.skew), "--seed", str(args.seed), "--reps",
          str(args.reps), "--case-cap", str(args.case_cap)]
  return argv + (["--smoke"] if args.smoke else [])


def annotate(records, args, ids, num_gpus, ep):
  """Adds TFLOP/s, NVLink GB/s, floor and speed-ups over the baselines to the ok records."""
  ok = {(r["impl"], r["shape"], r["recipe"], r["pass"]): r["ms"] for r in records
        if r.get("status") == "ok"}
  for r in records:
    if r.get("status") != "ok" or r["pass"] not in problem_lib.PASSES:
      continue
    prob = problem_lib.make_problem(r["shape"], args.tokens, num_gpus, ep, args.experts,
                                    args.top_k)
    seconds = r["ms"] / 1e3
    r["tflops"] = prob.expert_flops_per_gpu(r["pass"]) / seconds / 1e12
    ceiling_recipe = "bf16" if r["recipe"] == "bf16" else "fp8"  # every FP8 flavour
    r["floor_ms"] = prob.floor_ms(r["pass"], ceiling_recipe)
    r["floor_fraction"] = r["floor_ms"] / r["ms"]
    if r.get("queued_ms"):
      r["queued_floor_fraction"] = r["floor_ms"] / r["queued_ms"]
    traffic = problem_lib.exchange_bytes_per_gpu(ids, prob, r["pass"])
    if traffic:
      r["nvlink_gbps"] = traffic / seconds / 1e9
    for baseline in ("torch", "jax_native"):
      base_ms = ok.get((baseline, r["shape"], "bf16", r["pass"]))
      if base_ms and r["impl"] != baseline:
        r[f"speedup_vs_{baseline}"] = base_ms / r["ms"]
  return records


def main(argv=None) -> dict:
  args = parse_args(argv)
  deadline = timing.Deadline(args.time_budget)
  started = time.time()
  import jax  # noqa: PLC0415
  mesh, devices = make_mesh(args)
  num_gpus, ep = len(devices), mesh.shape["expert"]
  meta = {
      "kind": "layer_check" if args.check else "layer",
      "device": f"{len(devices)} x {devices[0].device_kind}",
      "platform": devices[0].platform, "jax_version": jax.__version__,
      "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
      "commit": git_commit(),
      "command": " ".join(["python3", "benchmarks/bench_layer.py", *(argv or sys.argv[1:])]),
      "tokens_per_gpu": args.tokens, "experts": args.experts, "top_k": args.top_k, "ep": ep,
      "skew": args.skew, "seed": args.seed, "reps": args.reps, "smoke": args.smoke,
  }
  log(f"bench_layer: {meta['device']}, EP={ep}, {args.tokens} tokens/GPU, E={args.experts}, "
      f"k={args.top_k}, skew={args.skew}, shapes {args.shapes}, recipes {args.recipes}")
  ids, weights = problem_lib.make_routing(args.tokens * num_gpus, args.experts, args.top_k,
                                          seed=args.seed, skew=args.skew)
  records: list[dict] = []

  def result(partial: bool) -> dict:
    meta["wall_s"] = round(time.time() - started, 1)
    done = records if args.check else annotate([dict(r) for r in records], args, ids, num_gpus,
                                                   ep)
    return {"meta": dict(meta, partial=partial), "results": done}

  def save_partial():
    _write_json(result(partial=True), args.out)

  def give_up():
    log(f"\nwatchdog: {WATCHDOG_GRACE_S:.0f} s past the time budget; writing what was measured")
    final = result(partial=True)
    final["meta"]["watchdog"] = True
    write_outputs(final, args)

  watchdog = timing.start_watchdog(args.time_budget + WATCHDOG_GRACE_S, give_up)
  try:
    if args.check:
      run_check(args, mesh, ids, weights, records, save_partial)
    else:
      if "torch" in args.impls:
        with tempfile.TemporaryDirectory() as tmp:
          routing_path = pathlib.Path(tmp, "routing.npz")
          np.savez(routing_path, topk_ids=ids, topk_weights=weights)
          records += run_torch(args, num_gpus, ep, routing_path,
                               min(args.torch_budget, deadline.left()))
        save_partial()
      isolate = args.isolate == "on" or (args.isolate == "auto" and meta["platform"] == "gpu")
      if isolate:
        run_jax_isolated(args, mesh, deadline, records, save_partial)
      else:
        run_jax(args, mesh, ids, weights, deadline, records, save_partial)
  finally:
    watchdog.cancel()
  final = result(partial=False)
  write_outputs(final, args)
  return final


def run_check(args, mesh, ids, weights, records: list[dict], save=lambda: None):
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from benchmarks import numerics  # noqa: PLC0415
  on_gpu = mesh.devices.flat[0].platform == "gpu"
  dtype_name = "bfloat16" if on_gpu else "float32"
  for shape in args.shapes:
    prob = problem_lib.make_problem(shape, args.tokens, mesh.devices.size, mesh.shape["expert"],
                                    args.experts, args.top_k)
    host = numerics.make_inputs(prob, ids, weights, jnp.dtype(dtype_name), args.seed)
    log(f"check {shape} ({dtype_name}, {prob.num_tokens} tokens on {mesh.devices.size} "
        f"{jax.default_backend()} devices)")
    numerics.check(args.impls, prob, host, mesh, dtype_name, torch_ok=torch_installed(), log=log,
                   records=records, save=save)


def _write_json(result, path):
  out = pathlib.Path(path)
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = out.with_suffix(".tmp")
  tmp.write_text(json.dumps(result, indent=1, default=float))
  tmp.replace(out)  # atomic: a reader never sees half a file


def write_outputs(result, args):
  _write_json(result, args.out)
  log(f"wrote {args.out}")
  if args.md:
    report.append_markdown(result, pathlib.Path(args.md))
    log(f"appended the table to {args.md}")
  if args.png and result["meta"]["kind"] == "layer":
    try:
      report.bar_chart(result, pathlib.Path(args.png))
      log(f"wrote {args.png}")
    except Exception as e:  # noqa: BLE001  (a missing matplotlib must not lose the numbers)
      log(f"no chart: {timing.classify_error(e)[1]}")
  if not args.child:
    log("")
    log(report.short_table(result))


if __name__ == "__main__":
  main()

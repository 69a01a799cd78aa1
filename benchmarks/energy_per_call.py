"""Energy, power and SM clock per layer call, fused against cuda: whether a backend's time is set
by the card's power limit and how much energy each call takes.

Session 39 (H100, `nvidia-smi` samples beside bench_layer.py): under the software power cap the
235B bf16 forward's kernels ran at ~1.5 GHz with backend fused and ~1.7 GHz with cuda, so on a
power-bound card a call's time follows its energy, not only its cycles. This times a run of
calls queued back to back (long enough for the card to reach its limit) and reads, around it,
NVML's energy counter (`nvidia-smi --query-gpu=total_energy_consumption`, mJ since the driver
loaded; where nvidia-smi has no such field, as driver 580.159's on an H200 in session 40, the
power samples' mean times the run's length) and the SM clock, power (instantaneous where the
driver has it) and clock-event reasons sampled every 50 ms, after a second of calls that brings
the card to its steady state:

  python3 benchmarks/energy_per_call.py [--shapes 30b,235b] [--recipe bf16|fp8] [--seconds 3]
      [--rounds 2] [--impls fused,cuda] [--fused-env "NAME=V[,NAME=V];..."] [--out F]

Per shape and backend (interleaved round by round): ms per call, J per call, mean W, and the SM
clock's median over the samples (all of them, and those under the power cap). FP8 runs with
`weight_blocks=` (the weights quantised once, as bench_layer's "fused+blocks"). The problem is
bench_layer's at EP = 1 (16,384 tokens, 128 experts, top-8, uniform), on its one-device mesh.

--fused-env adds backend fused under other settings of its overrides (ffi/heuristics/: the
handlers read them at every call), each a further row of every round: what in the kernel draws
the power. E.g. "MEGAMOE_FUSED_COPY_HEAD=100;MEGAMOE_FUSED_COPY_HEAD=0;MEGAMOE_FUSED_L1_ORDER=m;
MEGAMOE_FUSED_L2_TMA=0": the whole row copy before the GEMMs (none beside the tiles), all of it
beside them, L1's tiles M-block-major, L2's rows by generic stores.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax_megamoe  # noqa: E402
from benchmarks import gpu_clocks, problem  # noqa: E402
from benchmarks.fused_phases import env_var, layer_arrays, one_gpu_mesh  # noqa: E402

# Seconds of calls queued before each timed run: the card reaches its steady (power-capped)
# state, and power.draw, a running average over about a second, catches up. Without it the
# first run of a shape read ~10% low (session 40, H200: 5.82 J against 6.65 in round 2).
WARMUP_S = 1.0


def query_gpu0(field: str) -> float | None:
  """One numeric field of GPU 0 from nvidia-smi; None where the driver has no such field
  (nvidia-smi exits 2: driver 580.159's total_energy_consumption on an H200 in session 40) or
  gives none ("[N/A]")."""
  out = subprocess.run(["nvidia-smi", "-i", "0", f"--query-gpu={field}",
                        "--format=csv,noheader,nounits"], capture_output=True, text=True)
  try:
    return float(out.stdout.strip().splitlines()[0]) if out.returncode == 0 else None
  except (ValueError, IndexError):
    return None


@functools.cache
def sample_query() -> str:
  """nvidia-smi's fields for the samples; the instantaneous power where the driver has it (the
  energy then follows the run, not a one-second average of it). Asked once per process."""
  power = "power.draw.instant" if query_gpu0("power.draw.instant") is not None else "power.draw"
  return f"timestamp,clocks.sm,{power},temperature.gpu,clocks_event_reasons.active"


def energy_mj() -> float | None:
  """NVML's energy counter of GPU 0 (mJ since the driver loaded), None without one."""
  return query_gpu0("total_energy_consumption")


def summarize_run(calls: int, seconds: float, joules: float, samples: list[dict]) -> dict:
  """Per-call figures of one timed run from its totals and its clock samples."""
  capped = [s["sm_mhz"] for s in samples if s["reasons"] & gpu_clocks.SW_POWER_CAP]
  return {"calls": calls, "ms_per_call": seconds * 1e3 / calls, "j_per_call": joules / calls,
          "mean_w": joules / seconds,
          "sm_mhz_median": statistics.median(s["sm_mhz"] for s in samples) if samples else None,
          "capped_samples": len(capped), "samples": len(samples),
          "sm_mhz_capped_median": statistics.median(capped) if capped else None}


def parse_fused_env(text: str) -> list[dict[str, str]]:
  """--fused-env's variants: ";" between variants, "," between one variant's NAME=VALUE pairs;
  only MEGAMOE_FUSED_* names (the fused handlers' overrides)."""
  variants = []
  for part in filter(None, (p.strip() for p in text.split(";"))):
    env = {}
    for pair in filter(None, (p.strip() for p in part.split(","))):
      name, eq, value = pair.partition("=")
      if not eq or not name.startswith("MEGAMOE_FUSED_"):
        raise SystemExit(f"--fused-env: {pair!r} is not MEGAMOE_FUSED_<NAME>=<VALUE>")
      env[name] = value
    variants.append(env)
  return variants


def variant_label(impl: str, env: dict[str, str]) -> str:
  return impl + "".join(f"[{k.removeprefix('MEGAMOE_FUSED_')}={v}]" for k, v in env.items())


def timed_run(call, seconds: float, env: dict[str, str] | None = None) -> dict:
  """Calls queued back to back for about `seconds` (a wait every 10 calls), with the energy
  counter read around them and the clocks sampled beside them; `env` set around the calls."""
  with contextlib.ExitStack() as stack:
    for name, value in (env or {}).items():
      stack.enter_context(env_var(name, value))
    return _timed_run(call, seconds)


def _timed_run(call, seconds: float) -> dict:
  jax.block_until_ready(call())
  t = time.perf_counter()
  jax.block_until_ready([call() for _ in range(5)])
  per_call = (time.perf_counter() - t) / 5
  batches = max(1, round(seconds / (10 * per_call)))
  for _ in range(max(1, round(WARMUP_S / (10 * per_call)))):  # batches of 10 (outputs in memory)
    jax.block_until_ready([call() for _ in range(10)])
  query = sample_query()
  with tempfile.NamedTemporaryFile("w+", suffix=".csv") as f:
    sampler = subprocess.Popen(["nvidia-smi", "-i", "0", f"--query-gpu={query}",
                                "--format=csv,noheader,nounits", "-lms", "50"], stdout=f,
                               stderr=subprocess.STDOUT)
    try:
      e0, t0 = energy_mj(), time.perf_counter()
      for _ in range(batches):
        jax.block_until_ready([call() for _ in range(10)])
      t1, e1 = time.perf_counter(), energy_mj()
    finally:
      sampler.terminate()
      sampler.wait()
    f.seek(0)
    samples = gpu_clocks.parse(f)
  joules, source = run_joules(e0, e1, t1 - t0, samples)
  return {**summarize_run(10 * batches, t1 - t0, joules, samples), "energy_from": source,
          "sampled": query}


def run_joules(e0_mj: float | None, e1_mj: float | None, seconds: float,
               samples: list[dict]) -> tuple[float, str]:
  """A run's energy (J) and where it came from: the energy counter read around it, else the
  mean of the power samples (every 50 ms) times its length."""
  if e0_mj is not None and e1_mj is not None:
    return (e1_mj - e0_mj) * 1e-3, "energy counter"
  watts = [s["power_w"] for s in samples if s["power_w"] is not None]
  if not watts:
    raise SystemExit("energy_per_call: neither an energy counter nor power samples")
  return statistics.fmean(watts) * seconds, "mean of power samples"


def layer(impl: str, recipe: str, x, ids, w, wgu, wd, mesh):
  """A no-argument call of the layer on backend `impl` (fp8: with weight blocks)."""
  fp8 = recipe != "bf16"
  blocks = (jax_megamoe.quantize_expert_weights(wgu, wd, recipe, mesh=mesh) if fp8 else None)
  fn = jax.jit(lambda x, ids, w, wgu, wd, blocks: jax_megamoe.moe(
      x, ids, w, wgu, wd, mesh=mesh, expert_axis="expert", backend=impl,
      recipe=recipe if fp8 else None, weight_blocks=blocks))
  return lambda: fn(x, ids, w, wgu, wd, blocks)


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--shapes", default="30b,235b")
  ap.add_argument("--recipe", default="bf16", choices=("bf16", "fp8", "fp8_pow2"))
  ap.add_argument("--impls", default="fused,cuda")
  ap.add_argument("--seconds", type=float, default=3.0, help="each timed run's length")
  ap.add_argument("--rounds", type=int, default=2, help="timed runs per backend, interleaved")
  ap.add_argument("--fused-env", default="",
                  help="further backend fused variants: NAME=VALUE settings of its overrides, "
                       "';' between variants, ',' inside one")
  ap.add_argument("--tokens", type=int, default=16384)
  ap.add_argument("--out", default="")
  args = ap.parse_args(argv)
  if args.seconds <= 0 or args.rounds < 1:
    raise SystemExit(f"--seconds must be > 0 and --rounds >= 1, got {args.seconds}, "
                     f"{args.rounds}")
  fused_envs = parse_fused_env(args.fused_env)
  mesh = one_gpu_mesh()
  rows = []
  for shape in args.shapes.split(","):
    x, ids, w, wgu, wd = layer_arrays(shape, args.tokens, problem.NUM_EXPERTS, problem.TOP_K)
    impls = args.impls.split(",")
    calls = {impl: layer(impl, args.recipe, x, ids, w, wgu, wd, mesh)
             for impl in dict.fromkeys(impls + (["fused"] if fused_envs else []))}
    runs = ([(impl, calls[impl], {}) for impl in impls]
            + [("fused", calls["fused"], env) for env in fused_envs])
    for rnd in range(args.rounds):
      for impl, call, env in runs:
        label = variant_label(impl, env)
        r = {"shape": shape, "recipe": args.recipe, "impl": label, "env": env,
             "round": rnd + 1, **timed_run(call, args.seconds, env)}
        rows.append(r)
        capped = (f"{r['sm_mhz_capped_median']:.0f} MHz under the power cap "
                  f"({r['capped_samples']} of {r['samples']} samples)"
                  if r["capped_samples"] else f"never power-capped ({r['samples']} samples)")
        print(f"{shape} {args.recipe} {label:5s} round {rnd + 1}: {r['ms_per_call']:.3f} ms, "
              f"{r['j_per_call']:.2f} J per call, {r['mean_w']:.0f} W, SM clock median "
              f"{r['sm_mhz_median']} MHz, {capped}", flush=True)
    del calls, runs
  out = {"device": str(jax.devices()[0].device_kind), "rows": rows}
  if args.out:
    with open(args.out, "w") as f:
      json.dump(out, f, indent=1)
  return out


if __name__ == "__main__":
  main()

"""Localises a fault of the fused kernel's FP8 path on one GPU, stage by stage.

Each stage runs in its own process (a kernel fault leaves the CUDA context unusable, so a later
stage in the same process would only report the first one's error), cheapest first, and the
run stops at the first stage that fails:

  quantize           cuda_fp8's quantisers on the layer's rows and weights (no fused kernel)
  forward            the fused FP8 forward without residuals (gate_up not stored), against the
                     FP8 emulation (backend "reference" on the CPU)
  forward_residuals  the forward keeping the one-rank residuals (gate_up, y_sorted, slot_dest):
                     the three-slot FP8 L1 epilogue
  grad               value_and_grad as tests/test_fused_moe.py runs it (the backward is backend
                     cuda's FP8 kernels from the residuals)

Defaults: the first failing case of test_fp8_one_gpu_matches_emulation (T=1000, E=8, k=2,
H=256, F=128). The kernel's debug knob MEGAMOE_FUSED_DEBUG (ffi/impls/fused_moe.h) passes
through to the children: 8 synchronises after the launch and names a fault of the fused kernel
itself (this script turns XLA's command buffers off for it), 1 skips L2, 2 skips both GEMMs,
4 stores no gate_up; e.g.

  MEGAMOE_FUSED_DEBUG=8 python benchmarks/fused_fp8_debug.py
  MEGAMOE_FUSED_DEBUG=9 python benchmarks/fused_fp8_debug.py --stages forward

Numbers are meaningless with bits 1, 2 or 4 (the layer is not computed); only "ran / faulted"
is read then.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

STAGES = ("quantize", "forward", "forward_residuals", "grad")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script from anywhere: the package at the repo root
  sys.path.insert(0, REPO)


def _inputs(args):
  import jax.numpy as jnp
  import numpy as np
  sys.path.insert(0, os.path.join(REPO, "tests"))
  import ep_helpers
  rng = np.random.default_rng(args.seed)
  ids, w = ep_helpers.routing(rng, args.tokens, args.experts, args.top_k)
  x = jnp.asarray(rng.standard_normal((args.tokens, args.hidden)), jnp.bfloat16)
  wgu, wd = ep_helpers.weights_for(rng, args.experts, args.hidden, args.ffn, jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((args.tokens, args.hidden)), jnp.float32)
  return x, jnp.asarray(ids), jnp.asarray(w), wgu, wd, dy, ep_helpers


def _emulation(recipe, x, ids, w, wgu, wd):
  import jax
  import jax_megamoe as jm
  cpu = jax.devices("cpu")[0]
  with jax.default_device(cpu):
    args = [jax.device_put(a, cpu) for a in (x, ids, w, wgu, wd)]
    return jm.moe(*args, backend="reference", recipe=recipe)


def run_stage(stage: str, args) -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np
  import jax_megamoe as jm
  from jax_megamoe.backends import cuda_ep, cuda_fp8, fused
  from jax_megamoe.validation import check_layer_args

  reason = fused.unavailable_reason(args.recipe)
  if reason is not None:
    raise SystemExit(f"the fused kernel cannot run here: {reason}")
  x, ids, w, wgu, wd, dy, helpers = _inputs(args)
  pow2 = args.recipe == "fp8_pow2"
  start = time.perf_counter()
  if stage == "quantize":
    rows = cuda_fp8.quantize_rows(x, pow2=pow2)
    blocks = cuda_fp8.quantize_expert_weights(wgu, wd, pow2=pow2)
    jax.block_until_ready((rows, blocks))
    print(f"rows q {rows.q.shape} scale {rows.scale.shape}; w_gate_up q {blocks.w_gate_up.q.shape}"
          f" scale {blocks.w_gate_up.scale.shape}; w_down q {blocks.w_down.q.shape} scale "
          f"{blocks.w_down.scale.shape}")
    got = None
  elif stage == "forward":
    got, phases = fused.forward_with_phases(x, ids, w, wgu, wd, recipe=args.recipe)
    jax.block_until_ready(got)
    print("phase clock (ns):", np.asarray(phases).tolist())
  elif stage == "forward_residuals":
    shape = check_layer_args(x, ids, w, wgu, wd)
    plan = cuda_ep.LayerPlan.of(shape, fused.cuda_mlp(args.recipe))
    cfg = fused.FusedConfig(fused._local_workspace(shape, plan.n_cap), shape.num_experts, plan,
                            fused.max_ctas(False), recipe=args.recipe)
    blocks = fused.quantized_weights(wgu, wd, cfg)
    got, _, kept = fused._fp8_call(x, ids.astype(jnp.int32), w.astype(jnp.float32), blocks,
                                   cfg, residuals=True)
    jax.block_until_ready((got, kept))
    finite = bool(np.all(np.isfinite(np.asarray(kept.y_sorted, np.float32)[
        :int(np.asarray(kept.group_sizes).sum())])))
    print(f"n_cap {plan.n_cap}, group sizes {np.asarray(kept.group_sizes).tolist()}, "
          f"y_sorted rows in use finite: {finite}")
  else:
    def loss(x, w, wgu, wd):
      y = jm.moe(x, ids, w, wgu, wd, backend="fused", recipe=args.recipe)
      return jnp.sum(y.astype(jnp.float32) * dy), y
    (_, got), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        x, w, wgu, wd)
    jax.block_until_ready((got, grads))
    print("grads finite:", [bool(np.all(np.isfinite(np.asarray(g, np.float32)))) for g in grads])
  took = time.perf_counter() - start
  if got is not None:
    want = _emulation(args.recipe, x, ids, w, wgu, wd)
    y = np.asarray(got, np.float32)
    err = helpers.rel_err(y, np.asarray(want, np.float32))
    print(f"y finite: {bool(np.all(np.isfinite(y)))}, rel err vs the FP8 emulation {err:.3e} "
          f"(tests: < 2e-2)")
  print(f"STAGE {stage} RAN ({took:.1f} s)")


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--recipe", default="fp8", choices=("fp8", "fp8_pow2"))
  p.add_argument("--tokens", type=int, default=1000)
  p.add_argument("--experts", type=int, default=8)
  p.add_argument("--top-k", type=int, default=2)
  p.add_argument("--hidden", type=int, default=256)
  p.add_argument("--ffn", type=int, default=128)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--stages", default=",".join(STAGES),
                 help=f"comma-separated, in order, from {', '.join(STAGES)}")
  p.add_argument("--timeout", type=float, default=300.0, help="seconds per stage")
  p.add_argument("--stage", help=argparse.SUPPRESS)  # a child's one stage
  args = p.parse_args()
  if args.stage is not None:
    run_stage(args.stage, args)
    return
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  debug = int(env.get("MEGAMOE_FUSED_DEBUG", "0") or 0)
  if debug & 8 and "xla_gpu_enable_command_buffer" not in env.get("XLA_FLAGS", ""):
    # The debug sync cannot run inside a CUDA graph capture.
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()
  passthrough = [f"--recipe={args.recipe}", f"--tokens={args.tokens}",
                 f"--experts={args.experts}", f"--top-k={args.top_k}", f"--hidden={args.hidden}",
                 f"--ffn={args.ffn}", f"--seed={args.seed}"]
  for stage in args.stages.split(","):
    if stage not in STAGES:
      raise SystemExit(f"unknown stage {stage!r} (stages: {', '.join(STAGES)})")
    print(f"=== {stage} (MEGAMOE_FUSED_DEBUG={debug})", flush=True)
    try:
      rc = subprocess.run([sys.executable, os.path.abspath(__file__), *passthrough,
                           "--stage", stage], env=env, timeout=args.timeout).returncode
    except subprocess.TimeoutExpired:
      rc = "timeout"
    print(f"=== {stage}: rc {rc}", flush=True)
    if rc != 0:
      print(f"FIRST FAILING STAGE: {stage}")
      sys.exit(1)
  print("ALL STAGES RAN")


if __name__ == "__main__":
  main()

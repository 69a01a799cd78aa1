"""Grouped SwiGLU expert MLP on one GPU: our CUDA kernels vs torch._grouped_mm vs lax.ragged_dot.

Rows: 16,384 tokens x top-8 = 131,072 routed rows, random routing, over 128 and over 16 experts;
shapes Qwen3-30B-A3B (H=2048, F=768) and Qwen3-235B-A22B (H=4096, F=1536); bf16, fp32 accumulation.
Reports the median time of each grouped GEMM and of the whole MLP forward / backward, in ms and
TFLOP/s (dense-equivalent FLOPs of the routed rows). Every framework is timed in this process on
the same group sizes.

  python3 benchmarks/bench_grouped_mlp.py [--out results.json] [--quick] [--variants 0,1,2]

Each grouped-GEMM tile-schedule variant (MEGAMOE_GROUPED_GEMM_VARIANT, ffi/heuristics/gemm_variants.h)
is timed in its own subprocess. `--shapes tiny --rows 64 --experts 4` smoke-tests the script on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

SHAPES = {"30B": (2048, 768), "235B": (4096, 1536), "tiny": (128, 128)}


def group_sizes_for(rows: int, experts: int, seed: int = 0) -> np.ndarray:
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, experts, size=rows)
  return np.bincount(ids, minlength=experts).astype(np.int32)


def time_jax(fn, *args, trials=7, calls=3, warmup=2) -> float:
  import jax
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(trials):
    t0 = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / calls * 1e3)
  return statistics.median(times)


def time_torch(fn, trials=7, calls=3, warmup=2) -> float:
  import torch
  for _ in range(warmup):
    fn()
  torch.cuda.synchronize()
  times = []
  for _ in range(trials):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
      fn()
    end.record()
    end.synchronize()
    times.append(start.elapsed_time(end) / calls)
  return statistics.median(times)


def bench_ours(h, f, sizes, results, key, variant="default", with_fp8=True):
  import jax
  import jax.numpy as jnp
  from jax_megamoe import _ffi
  from jax_megamoe.backends import cuda_bf16

  n, e = int(sizes.sum()), len(sizes)
  k = jax.random.split(jax.random.key(0), 5)
  bf = jnp.bfloat16
  x = jax.random.normal(k[0], (n, h), bf)
  wgu = (jax.random.normal(k[1], (e, h, 2 * f), jnp.float32) / np.sqrt(h)).astype(bf)
  wd = (jax.random.normal(k[2], (e, f, h), jnp.float32) / np.sqrt(f)).astype(bf)
  dy = jax.random.normal(k[3], (n, h), bf)
  gs = jnp.asarray(sizes)
  hid = jax.random.normal(k[4], (n, f), bf)
  dgu = jax.random.normal(k[4], (n, 2 * f), bf)
  gemm = jax.jit(cuda_bf16.grouped_gemm, static_argnames="kind")
  cases = {
      "L1 fprop": (lambda: gemm(x, gs, wgu, kind=0), 2 * n * h * 2 * f),
      "L2 fprop": (lambda: gemm(hid, gs, wd, kind=0), 2 * n * f * h),
      "L2 dgrad": (lambda: gemm(dy, gs, wd, kind=1), 2 * n * h * f),
      "L1 dgrad": (lambda: gemm(dgu, gs, wgu, kind=1), 2 * n * 2 * f * h),
      "L2 wgrad": (lambda: gemm(hid, gs, dy, kind=2), 2 * n * f * h),
      "L1 wgrad": (lambda: gemm(x, gs, dgu, kind=2), 2 * n * h * 2 * f),
  }
  fwd = jax.jit(cuda_bf16.forward)
  _, gate_up, hidden = fwd(x, gs, wgu, wd)
  bwd = jax.jit(cuda_bf16.backward)
  cases["MLP fwd"] = (lambda: fwd(x, gs, wgu, wd), 6 * n * h * f)
  cases["MLP bwd"] = (lambda: bwd(dy, x, gs, wgu, wd, gate_up, hidden), 12 * n * h * f)
  # The same backward with its dgrads forced onto each path (ffi/heuristics/moe_dgrad_core.h).
  # The handler reads the variable when XLA first runs the call, which is then replayed from a
  # CUDA graph: each such case sets it and clears JAX's caches before its first call.
  envs = {"MLP bwd, dgrads on the tile engine's core": {"MEGAMOE_DGRAD_CORE": "1"},
          "MLP bwd, dgrads on CUTLASS + SwiGLU bwd": {"MEGAMOE_DGRAD_CORE": "0"}}
  for name in envs:
    cases[name] = cases["MLP bwd"]
  if with_fp8 and h % 128 == 0 and f % 128 == 0:
    from jax_megamoe.backends import cuda_fp8 as fp8k
    quant_rows = jax.jit(fp8k.quantize_rows)
    quant_weights = jax.jit(fp8k.quantize_weights)
    fp8_gemm = jax.jit(fp8k.grouped_gemm_quantized)
    x_q, hid_q = quant_rows(x), quant_rows(hid)
    wgu_q, wd_q = quant_weights(wgu), quant_weights(wd)
    fp8_fwd = jax.jit(fp8k.mlp_forward, static_argnums=3)
    blocks = fp8k.ExpertWeightBlocks(wgu_q, wd_q)
    move = lambda elems: 3 * elems  # quantiser traffic: 2 bytes read + 1 written per element
    cases["fp8 L1 GEMM"] = (lambda: fp8_gemm(x_q, gs, wgu_q), 2 * n * h * 2 * f)
    cases["fp8 L2 GEMM"] = (lambda: fp8_gemm(hid_q, gs, wd_q), 2 * n * f * h)
    # "tflops" of a quantiser = its TB/s (bytes / ms / 1e9).
    cases["fp8 quantize x (TB/s)"] = (lambda: quant_rows(x), move(n * h))
    cases["fp8 quantize w_gate_up (TB/s)"] = (lambda: quant_weights(wgu), move(e * h * 2 * f))
    # From quantised weights too (before fp8-quantize-once it quantised them: another op).
    cases["fp8 MLP fwd from quantized x and weights"] = (
        lambda: fp8_fwd(x_q, gs, blocks, False), 6 * n * h * f)
    # Backward: the dgrad GEMMs on pre-quantised operands, the K-grouped wgrad on
    # weight-gradient operands, their quantisers, and the whole FP8 MLP backward.
    dy_q, dgu_q = quant_rows(dy), quant_rows(dgu)
    quant_w_dgrad = jax.jit(lambda w: fp8k.quantize_weights(w, dgrad=True))
    wgu_dq, wd_dq = quant_w_dgrad(wgu), quant_w_dgrad(wd)
    wgrad_op = jax.jit(fp8k.quantize_wgrad_operand)
    x_c, dgu_c, hid_c, dy_c = (wgrad_op(a, gs) for a in (x, dgu, hid, dy))
    fp8_wgrad = jax.jit(fp8k.grouped_wgrad_quantized)
    fp8_bwd = jax.jit(fp8k.mlp_backward, static_argnums=4)
    # The backward's weights are the forward's blocks (MlpResiduals), read transposed.
    fp8_res = fp8k.MlpResiduals(gate_up, hidden, blocks)
    dgrad_operand = jax.jit(fp8k.dgrad_operand)
    cases["fp8 L2 dgrad GEMM"] = (lambda: fp8_gemm(dy_q, gs, wd_dq), 2 * n * h * f)
    cases["fp8 L1 dgrad GEMM"] = (lambda: fp8_gemm(dgu_q, gs, wgu_dq), 2 * n * 2 * f * h)
    cases["fp8 L2 wgrad GEMM"] = (lambda: fp8_wgrad(hid_c, gs, dy_c), 2 * n * f * h)
    cases["fp8 L1 wgrad GEMM"] = (lambda: fp8_wgrad(x_c, gs, dgu_c), 2 * n * h * 2 * f)
    cases["fp8 quantize wgrad operand x (TB/s)"] = (lambda: wgrad_op(x, gs), move(n * h))
    rows_and_op = jax.jit(lambda a, s: fp8k.quantize_wgrad_operand(a, s, with_rows=True))
    cases["fp8 quantize dy rows + wgrad operand (TB/s)"] = (lambda: rows_and_op(dy, gs),
                                                            4 * n * h)
    swiglu_bwd = jax.jit(fp8k.swiglu_backward_quantize)
    # bytes: dh and gate_up read, dgate_up written twice in e4m3.
    cases["fp8 SwiGLU bwd + quantize both ways (TB/s)"] = (
        lambda: swiglu_bwd(hid, gate_up, gs), 2 * n * f + 4 * n * f + 4 * n * f)
    cases["fp8 quantize w_gate_up dgrad (TB/s)"] = (lambda: quant_w_dgrad(wgu),
                                                    move(e * h * 2 * f))
    # The same operand as the forward's blocks transposed: 1 byte read + 1 written per element.
    cases["fp8 dgrad operand w_gate_up from its blocks (TB/s)"] = (
        lambda: dgrad_operand(wgu_q), 2 * e * h * 2 * f)
    cases["fp8 MLP bwd"] = (lambda: fp8_bwd(dy, x, gs, fp8_res, False), 12 * n * h * f)
  only = os.environ.get("MEGAMOE_BENCH_ONLY", "")
  for name, (fn, flops) in cases.items():
    if only and not name.startswith(only):
      continue
    saved = {v: os.environ.get(v) for v in envs.get(name, {})}
    if name in envs:
      os.environ.update(envs[name])
      jax.clear_caches()
    try:
      before = _ffi.launch_counts()
      ms = time_jax(fn)
      # Heuristic-picked kernels this case's handlers launched (a replayed CUDA graph does not
      # count): says which path a forced case really took.
      launches = {k: v - before.get(k, 0) for k, v in _ffi.launch_counts().items()}
      results.append({**key, "impl": f"megamoe v{variant}", "op": name, "ms": ms,
                      "tflops": flops / ms / 1e9, "launches": launches})
    except Exception as ex:  # noqa: BLE001
      results.append({**key, "impl": f"megamoe v{variant}", "op": name,
                      "error": str(ex).splitlines()[0][:300]})
    finally:
      for v, old in saved.items():
        if old is None:
          os.environ.pop(v, None)
        else:
          os.environ[v] = old
    print(results[-1], flush=True)


def bench_ragged_dot(h, f, sizes, results, key):
  import jax
  import jax.numpy as jnp
  n, e = int(sizes.sum()), len(sizes)
  bf = jnp.bfloat16
  x = jax.random.normal(jax.random.key(1), (n, h), bf)
  wgu = jax.random.normal(jax.random.key(2), (e, h, 2 * f), bf)
  gs = jnp.asarray(sizes)
  fn = jax.jit(lambda x, w, g: jax.lax.ragged_dot(x, w, g, preferred_element_type=jnp.float32
                                                  ).astype(bf))
  try:
    ms = time_jax(fn, x, wgu, gs, trials=3, calls=1, warmup=1)
    results.append({**key, "impl": "lax.ragged_dot", "op": "L1 fprop", "ms": ms,
                    "tflops": 2 * n * h * 2 * f / ms / 1e9})
  except Exception as ex:  # noqa: BLE001
    results.append({**key, "impl": "lax.ragged_dot", "op": "L1 fprop",
                    "error": str(ex).splitlines()[0][:300]})
  print(results[-1], flush=True)


def bench_torch(h, f, sizes, results, key):
  import torch
  import torch.nn.functional as F
  n, e = int(sizes.sum()), len(sizes)
  dev = "cuda"
  bf = torch.bfloat16
  g = torch.Generator(device=dev).manual_seed(0)
  x = torch.randn(n, h, device=dev, dtype=bf, generator=g)
  wgu = (torch.randn(e, h, 2 * f, device=dev, generator=g) / h ** 0.5).to(bf)
  wd = (torch.randn(e, f, h, device=dev, generator=g) / f ** 0.5).to(bf)
  dy = torch.randn(n, h, device=dev, dtype=bf, generator=g)
  offs = torch.as_tensor(np.cumsum(sizes), dtype=torch.int32, device=dev)

  def mm(a, b):
    return torch._grouped_mm(a, b, offs=offs)

  # torch._grouped_mm may want b column-major in its last two dims; use what it accepts.
  try:
    mm(x, wgu)
    layout = "row-major b"
  except Exception:  # noqa: BLE001
    wgu = wgu.transpose(-2, -1).contiguous().transpose(-2, -1)
    wd = wd.transpose(-2, -1).contiguous().transpose(-2, -1)
    layout = "column-major b"
  key = {**key, "torch_b_layout": layout}
  hid = torch.randn(n, f, device=dev, dtype=bf, generator=g)

  def mlp(x, wgu, wd):
    gu = mm(x, wgu)
    return mm(F.silu(gu[:, :f]) * gu[:, f:], wd)

  xg, wgug, wdg = (t.detach().clone().requires_grad_(True) for t in (x, wgu, wd))

  def fwd_bwd():
    y = mlp(xg, wgug, wdg)
    y.backward(dy)

  cases = {
      "L1 fprop": (lambda: mm(x, wgu), 2 * n * h * 2 * f),
      "L2 fprop": (lambda: mm(hid, wd), 2 * n * f * h),
      "MLP fwd": (lambda: mlp(x, wgu, wd), 6 * n * h * f),
      "MLP fwd+bwd": (fwd_bwd, 18 * n * h * f),
  }
  for name, (fn, flops) in cases.items():
    try:
      with torch.no_grad() if name != "MLP fwd+bwd" else torch.enable_grad():
        ms = time_torch(fn)
      results.append({**key, "impl": "torch._grouped_mm", "op": name, "ms": ms,
                      "tflops": flops / ms / 1e9})
    except Exception as ex:  # noqa: BLE001
      results.append({**key, "impl": "torch._grouped_mm", "op": name, "error": repr(ex)[:300]})
    print(results[-1], flush=True)


def run_variant_subprocess(variant, args, results):
  """Times our kernels with one tile-schedule variant in a fresh process (read once there)."""
  with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
    path = tmp.name
  cmd = [sys.executable, __file__, "--impls", "megamoe", "--variants", variant, "--out", path,
         "--shapes", args.shapes, "--experts", args.experts, "--rows", str(args.rows)]
  env = {**os.environ, "MEGAMOE_GROUPED_GEMM_VARIANT": variant,
         "MEGAMOE_BENCH_FP8": "1" if variant == args.variants.split(",")[0] else "0"}
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
  sys.stdout.write(proc.stdout[-4000:])
  if proc.returncode != 0:
    sys.stdout.write(proc.stderr[-2000:])
  try:
    with open(path) as fh:
      results.extend(json.load(fh))
  except (OSError, ValueError) as ex:
    results.append({"shape": "-", "experts": "-", "impl": f"megamoe v{variant}",
                    "error": f"subprocess failed: {ex!r} {proc.stderr[-200:]}"})


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="bench_grouped_mlp.json")
  ap.add_argument("--quick", action="store_true", help="235B shape over 128 experts only")
  ap.add_argument("--impls", default="megamoe,torch,ragged_dot")
  ap.add_argument("--variants", default="0,1,2", help="grouped-GEMM schedule variants to time")
  ap.add_argument("--shapes", default="30B,235B")
  ap.add_argument("--experts", default="128,16")
  ap.add_argument("--rows", type=int, default=16384 * 8)
  ap.add_argument("--timeout", type=float, default=300)
  args = ap.parse_args()
  if args.quick:
    args.shapes, args.experts = "235B", "128"
  impls = args.impls.split(",")
  variants = args.variants.split(",")
  results = []
  rows = args.rows
  combos = [(s, int(e)) for s in args.shapes.split(",") for e in args.experts.split(",")]
  if "megamoe" in impls and len(variants) > 1:
    for v in variants:
      run_variant_subprocess(v, args, results)
    impls.remove("megamoe")
  for shape, experts in combos:
    h, f = SHAPES[shape]
    sizes = group_sizes_for(rows, experts)
    key = {"shape": shape, "H": h, "F": f, "experts": experts, "rows": rows}
    for name in impls:
      try:
        if name == "megamoe":
          bench_ours(h, f, sizes, results, key, variant=variants[0],
                     with_fp8=os.environ.get("MEGAMOE_BENCH_FP8", "1") == "1")
        elif name == "torch":
          bench_torch(h, f, sizes, results, key)
          import torch
          torch.cuda.empty_cache()  # the inputs died with bench_torch's frame
        elif name == "ragged_dot":
          bench_ragged_dot(h, f, sizes, results, key)
      except Exception:  # noqa: BLE001
        results.append({**key, "impl": name, "error": traceback.format_exc()[-300:]})
        print(results[-1], flush=True)
  with open(args.out, "w") as fh:
    json.dump(results, fh, indent=1)
  print("\n| shape | E | impl | op | ms | TFLOP/s (quantisers: TB/s) |")
  print("|---|---|---|---|---|---|")
  for r in results:
    rate = f"{r['tflops']:.2f}" if "(TB/s)" in r["op"] else f"{r['tflops']:.0f}"  # quantisers
    val = f"{r['ms']:.3f} | {rate}" if "ms" in r else f"FAILED: {r['error'][:80]} |"
    print(f"| {r['shape']} | {r['experts']} | {r['impl']} | {r.get('op', '-')} | {val} |")


if __name__ == "__main__":
  main()

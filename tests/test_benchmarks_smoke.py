"""CPU smoke run of the benchmark suite at tiny sizes (no timing claims): the JSON, markdown and
PNG are produced, every implementation is recorded (run or why not), and the baselines' numerics
agree with jax_megamoe.moe's reference backend.

On CPU the JAX-native baseline runs with its padded all_to_all emulation of ragged_all_to_all
(XLA:CPU has no ragged-all-to-all); the PyTorch baseline runs under torchrun with gloo where
torch is installed, and is skipped otherwise.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_megamoe
from jax_megamoe import _ffi
from jax_megamoe.backends import cuda_fp8

# benchmarks/ is a source-tree tool, not part of the installed package. Appended to the path,
# so that jax_megamoe still comes from the installation CI tests.
sys.path.append(str(pathlib.Path(__file__).resolve().parent.parent))
from benchmarks import bench_layer, bench_step, jax_impls, problem, report  # noqa: E402
from moe_oracles import assert_errors_below  # noqa: E402

TINY = ["--experts", "8", "--top-k", "2", "--devices", "4", "--ep", "2"]
HAS_TORCH = importlib.util.find_spec("torch") is not None


def _outputs(tmp_path, name):
  return ["--out", str(tmp_path / f"{name}.json"), "--md", str(tmp_path / "RESULTS.md")]


def _is_png(path):
  return path.exists() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_layer_rows_with_weight_blocks(tmp_path):
  """"megamoe:B+blocks": the layer with its FP8 weights quantised once before the timed calls
  (jax_impls.layer_inputs); bf16 is recorded as not available."""
  impls = "megamoe:reference,megamoe:reference+blocks"
  bench_layer.main(["--smoke", "--impls", impls, "--passes", "fwd,2f1b", "--shapes", "small",
                    "--recipes", "bf16,fp8", "--tokens", "16", *TINY,
                    *_outputs(tmp_path, "layer")])
  saved = json.loads((tmp_path / "layer.json").read_text())
  status = {(r["impl"], r["recipe"], r["pass"]): r["status"] for r in saved["results"]}
  assert status[("megamoe:reference+blocks", "bf16", "fwd")] == "not available"
  for impl in impls.split(","):
    for name in ("fwd", "2f1b"):
      assert status[(impl, "fp8", name)] == "ok", (impl, name)


def test_layer_smoke_writes_json_markdown_and_chart(tmp_path):
  impls = "megamoe:reference,megamoe:cuda,megamoe:fused,jax_native"
  result = bench_layer.main(["--smoke", "--impls", impls, "--passes", "fwd,2f1b", *TINY,
                             *_outputs(tmp_path, "layer")])
  saved = json.loads((tmp_path / "layer.json").read_text())
  assert saved["meta"]["smoke"] and saved["meta"]["kind"] == "layer"
  by_impl = {}
  for r in saved["results"]:
    by_impl.setdefault(r["impl"], {})[r["pass"]] = r
  assert set(by_impl) == set(impls.split(","))
  for impl in ("megamoe:reference", "jax_native"):
    for name in ("fwd", "2f1b"):
      record = by_impl[impl][name]
      assert record["status"] == "ok", record
      assert record["ms"] > 0 and record["tflops"] > 0 and 0 < record["floor_fraction"]
  assert by_impl["megamoe:reference"]["fwd"]["speedup_vs_jax_native"] > 0
  for impl in ("megamoe:cuda", "megamoe:fused"):  # not built here: recorded with the reason
    assert all(r["status"] in ("not available", "ok") for r in by_impl[impl].values())
  markdown = (tmp_path / "RESULTS.md").read_text()
  assert "| shape | recipe | impl | pass | ms |" in markdown and "no timing claims" in markdown
  assert _is_png(tmp_path / "layer.png")
  assert "megamoe:reference" in report.short_table(result)


def test_jax_native_and_reference_agree(tmp_path):
  result = bench_layer.main(["--check", "--impls", "megamoe:reference,jax_native", *TINY,
                             *_outputs(tmp_path, "check")])
  native = next(r for r in result["results"] if r["impl"] == "jax_native")
  assert native["status"] == "ok", native
  assert_errors_below(native["rel_err"], 1e-4)
  assert set(native["rel_err"]) == {"y", "dx", "dtopk_weights", "dw_gate_up", "dw_down"}
  assert "padded" in native["exchange"]  # CPU: the emulated ragged_all_to_all
  assert "| shape | impl | dtype |" in (tmp_path / "RESULTS.md").read_text()


@pytest.mark.slow  # torchrun start-up: ~45 s on two shared cores
@pytest.mark.skipif(not HAS_TORCH, reason="not run: torch is not installed")
def test_torch_baseline_agrees_with_reference(tmp_path):
  result = bench_layer.main(["--check", "--impls", "torch", "--experts", "8", "--top-k", "2",
                             "--devices", "2", *_outputs(tmp_path, "torch_check")])
  (torch_record,) = result["results"]
  assert torch_record["status"] == "ok", torch_record
  assert_errors_below(torch_record["rel_err"], 1e-4)


@pytest.mark.slow  # two torchrun start-ups
@pytest.mark.skipif(not HAS_TORCH, reason="not run: torch is not installed")
def test_torch_lean_and_naive_variants_agree(tmp_path):
  """The lean PyTorch layer against the first version it replaced (--variant naive), which the
  device runs time beside it: same y and gradients, with uneven and empty expert groups."""
  import subprocess  # noqa: PLC0415
  from benchmarks import numerics  # noqa: PLC0415
  prob = problem.make_problem("small", 64, num_gpus=2, ep=2, num_experts=8, top_k=2)
  ids, weights = problem.make_routing(prob.num_tokens, 8, 2, seed=2, skew=3.0)  # expert 2: none
  host = numerics.make_inputs(prob, ids, weights, jnp.float32)
  np.savez(tmp_path / "in.npz", dtype=np.array("float32"), **host)
  got = {}
  for variant in ("lean", "naive"):
    out = tmp_path / f"{variant}.npz"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(numerics.TORCH_SCRIPT), "--check", f"--variant={variant}",
           f"--inputs={tmp_path / 'in.npz'}", f"--outputs={out}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got[variant] = dict(np.load(out))
  for name in numerics.OUTPUT_NAMES:
    want = got["naive"][name]
    np.testing.assert_allclose(got["lean"][name], want, atol=1e-5 * np.abs(want).max(),
                               err_msg=name)


def test_backward_pass_is_timed_from_saved_residuals():
  """The bwd pass applies a vjp returned by an earlier jitted call: same as jax.grad."""
  def layer(x, ids, w, wgu, wd):
    del ids
    return (jnp.tanh(x @ wgu[0][:, :4]) @ wd[0][:4]) * w[:, :1]

  x = jnp.ones((8, 4))
  inputs = (x, jnp.zeros((8, 2), jnp.int32), jnp.full((8, 2), 0.5), jnp.ones((2, 4, 8)) * 0.1,
            jnp.ones((2, 4, 4)) * 0.2)
  dy = jnp.ones((8, 4))
  fns = jax_impls.pass_functions(layer)
  dx, *_ = fns["bwd"](inputs, dy)()
  want = jax.grad(lambda x: jnp.sum(layer(x, *inputs[1:])))(x)
  np.testing.assert_allclose(dx, want, rtol=1e-6)
  y, grads = fns["2f1b"](inputs, dy)()
  np.testing.assert_allclose(grads[0], want, rtol=1e-6)


def test_fused_rows_are_not_timed_when_the_layer_fell_back_to_cuda(monkeypatch):
  """megamoe:fused* rows are timed only when the program has the fused kernel's custom call."""
  from jax_megamoe.backends import fused
  layer, inputs = (lambda x: x * 2), (jnp.ones(4),)
  assert "backend cuda" in jax_impls.fallback_reason("megamoe:fused", layer, inputs)
  assert jax_impls.fallback_reason("megamoe:cuda", layer, inputs) is None
  assert jax_impls.fallback_reason("jax_native", layer, inputs) is None
  monkeypatch.setattr(fused, "TARGET", "stablehlo.multiply")  # a stand-in for the custom call
  assert jax_impls.fallback_reason("megamoe:fused+blocks", layer, inputs) is None


def test_routing_is_reproducible_distinct_and_skewable():
  ids, weights = problem.make_routing(4096, 128, 8, seed=3)
  again, _ = problem.make_routing(4096, 128, 8, seed=3)
  np.testing.assert_array_equal(ids, again)
  assert all(len(set(row)) == 8 for row in ids[:256])
  np.testing.assert_allclose(weights.sum(axis=1), 1.0, rtol=1e-5)
  uniform_max = np.bincount(ids.ravel(), minlength=128).max()
  skewed, _ = problem.make_routing(4096, 128, 8, seed=3, skew=1.2)
  assert np.bincount(skewed.ravel(), minlength=128).max() > 2 * uniform_max


def test_flops_and_floor_match_design_doc():
  prob = problem.make_problem("30b", 16384, num_gpus=2, ep=2)
  assert prob.expert_flops_per_gpu("fwd") == pytest.approx(1.237e12, rel=1e-3)
  assert prob.floor_ms("fwd", "bf16") == pytest.approx(1.545, rel=1e-3)
  assert prob.floor_ms("fwd", "fp8") == pytest.approx(0.856, rel=1e-3)
  assert prob.floor_ms("bwd", "bf16") == pytest.approx(2 * 1.545, rel=1e-3)
  # DESIGN.md §2: at EP=8 a token reaches ~5.3 distinct ranks, 7/8 of them remote.
  ids, _ = problem.make_routing(8 * 512, 128, 8, seed=0)
  ep8 = problem.make_problem("30b", 512, num_gpus=8, ep=8)
  assert problem.remote_rows_per_gpu(ids, ep8) / 512 == pytest.approx(5.33 * 7 / 8, rel=0.02)


def test_step_smoke(tmp_path):
  pytest.importorskip("jax_megamoe.models", reason="not run: the example model is not merged")
  result = bench_step.main(["--smoke", "--layers", "1", "--seq", "8", "--remat", "none",
                            "--backends", "reference,fused", "--ep", "2",
                            *_outputs(tmp_path, "step")])
  ref = next(r for r in result["results"] if r["backend"] == "reference")
  assert ref["status"] == "ok", ref
  assert ref["tokens_per_s_per_gpu"] > 0 and 0 < ref["mfu"] < 1
  # The routing of what was timed: tiny has 8 experts, top-2 (1 = balanced, 4 = one expert).
  assert 1 <= ref["imbalance_first"] <= 4 and 1 <= ref["imbalance_last"] <= 4
  # Which heuristic-picked kernels the case launched: none on the reference backend.
  assert set(ref["launches"]) == set(_ffi.launch_counts()) and not any(ref["launches"].values())
  assert result["meta"]["tokens_per_gpu"] == 32
  assert result["meta"]["batch"] == 4 * jax.device_count()
  markdown = (tmp_path / "RESULTS.md").read_text()
  assert "| config | backend | step ms |" in markdown and "imbalance" in markdown
  assert _is_png(tmp_path / "step.png")


def test_step_report_without_the_model(tmp_path):
  """bench_step's table and chart from a synthetic result (runs before the model is merged)."""
  meta = {"kind": "step", "device": "2 x test", "date": "today", "commit": "abc",
          "command": "bench_step.py", "config": "tiny", "batch": 4, "seq_len": 8, "reps": 2,
          "peak_tflops": 989.4, "smoke": True}
  results = [{"backend": "reference", "config": "tiny", "status": "ok", "ms": 12.5,
              "tokens_per_s_per_gpu": 1280.0, "tflops_per_gpu": 0.01, "mfu": 1e-5,
              "imbalance_first": 3.5, "imbalance_last": 1.25, "peak_gib": None},
             {"backend": "cuda", "config": "tiny", "status": "not available", "error": "why"}]
  result = {"meta": meta, "results": results}
  report.append_markdown(result, tmp_path / "RESULTS.md")
  report.bar_chart(result, tmp_path / "step.png")
  markdown = (tmp_path / "RESULTS.md").read_text()
  assert "| tiny | reference | 12.50 |" in markdown and "[1] not available: why" in markdown
  assert "| 3.50 -> 1.25 |" in markdown
  assert _is_png(tmp_path / "step.png")
  assert "reference" in report.short_table(result)


@pytest.mark.slow  # one child process: ~10 s
def test_isolated_implementations_run_in_child_processes(tmp_path):
  result = bench_layer.main(["--smoke", "--isolate", "on", "--impls", "megamoe:fused,jax_native",
                             "--passes", "fwd", *TINY, *_outputs(tmp_path, "isolated")])
  by_impl = {r["impl"]: r for r in result["results"]}
  assert by_impl["jax_native"]["status"] == "ok", by_impl["jax_native"]
  assert by_impl["megamoe:fused"]["status"] in ("not available", "ok")


def test_fp8_grad_program_ops_lists_both_programs_kernels():
  from benchmarks import fp8_grad_program_ops  # noqa: PLC0415
  programs = fp8_grad_program_ops.main(["--tokens", "256", "--min-mib", "0.01"])
  fused_ops, cuda_ops = ([op for op, _, _ in rows] for rows in programs.values())
  assert fused_ops.count("ffi_call:megamoe_fused_moe_fwd") == 1
  assert "ffi_call:megamoe_fused_moe_fwd" not in cuda_ops
  for ops in (fused_ops, cuda_ops):  # the same FP8 backward: two dgrad, two wgrad GEMMs
    assert ops.count("ffi_call:megamoe_grouped_wgrad_fp8") == 2, ops
    assert ops.count("ffi_call:megamoe_fp8_quantize_weights") == 2, ops


def test_classify_error_keeps_a_tracebacks_start_and_end():
  from benchmarks import timing  # noqa: PLC0415
  text = "Traceback (most recent call last): " + "frame " * 400 + "OSError: address in use"
  status, message = timing.classify_error(text)
  assert status == "failed" and len(message) < 620
  assert message.startswith("Traceback") and message.endswith("OSError: address in use")
  assert timing.classify_error("RESOURCE_EXHAUSTED: 3 GiB")[0] == "oom"


def _tiny_layer(seed, hidden=32, ffn=16, dtype=jnp.float32):
  """x, ids, weights, w_gate_up, w_down of a 16-token, 4-expert, top-2 layer (x and the expert
  weights in `dtype`)."""
  rng = np.random.default_rng(seed)
  t, h, f, e, k = 16, hidden, ffn, 4, 2
  return (jnp.asarray(rng.standard_normal((t, h)), dtype),
          jnp.asarray(np.argsort(rng.random((t, e)), axis=1)[:, :k], jnp.int32),
          jnp.asarray(rng.random((t, k)), jnp.float32),
          jnp.asarray(rng.standard_normal((e, h, 2 * f)) * 0.1, dtype),
          jnp.asarray(rng.standard_normal((e, f, h)) * 0.1, dtype))


def test_fused_phases_grad_pass_is_the_layers_gradients():
  """fused_phases --overhead-pass grad times the gradients of <y, dy> (x, routing weights, both
  expert weights): on any backend they are jax.grad's; a bad pass name is refused by name."""
  from benchmarks import fused_phases
  x, ids, w, wgu, wd = _tiny_layer(0)
  dy = jnp.asarray(np.random.default_rng(10).standard_normal(x.shape), jnp.float32)
  got = fused_phases.layer_call("reference", None, "grad", dy)(x, ids, w, wgu, wd)
  loss = lambda x, w, a, b: jnp.vdot(jax_megamoe.moe(x, ids, w, a, b, backend="reference"), dy)
  want = jax.grad(loss, argnums=(0, 1, 2, 3))(x, w, wgu, wd)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
  y = fused_phases.layer_call("reference", None, "fwd")(x, ids, w, wgu, wd)
  assert y.shape == x.shape
  with pytest.raises(ValueError, match="overhead_pass must be 'fwd' or 'grad', got 'bwd'"):
    fused_phases.layer_call("reference", None, "bwd")


@pytest.mark.skipif(
    not all(_ffi.has_target(t, "cpu") for t in cuda_fp8.TARGETS),
    reason="not run: the native extension (its FP8 CPU handlers) is not built")
def test_fused_phases_weight_blocks_are_the_same_call(capsys):
  """fused_phases --overhead --weight-blocks passes the blocks as the calls' sixth argument,
  and the call reads them: forward and gradients bit for bit those of the call that quantises
  its weights itself (the weight_blocks contract), so the split times the same layer; bf16
  with --weight-blocks is refused by name."""
  from benchmarks import fused_phases
  x, ids, w, wgu, wd = _tiny_layer(3, hidden=256, ffn=128, dtype=jnp.bfloat16)
  dy = jnp.asarray(np.random.default_rng(13).standard_normal(x.shape), jnp.bfloat16)
  blocks = jax_megamoe.quantize_expert_weights(wgu, wd, "fp8")
  for overhead_pass in ("fwd", "grad"):
    call = fused_phases.layer_call("reference", "fp8", overhead_pass, dy)
    per_call = jax.tree.leaves(call(x, ids, w, wgu, wd))
    with_blocks = jax.tree.leaves(call(x, ids, w, wgu, wd, blocks))
    assert len(per_call) == (1 if overhead_pass == "fwd" else 4)
    for a, b in zip(per_call, with_blocks):
      a, b = np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32))
      assert np.abs(a).max() > 0, overhead_pass
      np.testing.assert_array_equal(a, b, err_msg=overhead_pass)
  # The blocks are what the call reads: those of other weights give another y.
  other = jax_megamoe.quantize_expert_weights(wgu * 2, wd, "fp8")
  call = fused_phases.layer_call("reference", "fp8", "fwd")
  assert not np.array_equal(np.asarray(call(x, ids, w, wgu, wd, other), np.float32),
                            np.asarray(call(x, ids, w, wgu, wd, blocks), np.float32))
  with pytest.raises(SystemExit):
    fused_phases.main(["--weight-blocks", "--recipe", "bf16", "--overhead"])
  assert "--weight-blocks: weight blocks are for FP8 recipes, got --recipe bf16" in (
      capsys.readouterr().err)


def test_fused_phases_gemm_region():
  """The GEMM region's rate: session 37's 30B bf16 phases on an H100 (1.231 + 0.814 ms for
  6 T k H F = 1.237 TFLOP) give 605 TFLOP/s."""
  from benchmarks import fused_phases
  phases = {"head copied": 0.047, "rows copied": 1.231, "GEMM tiles done": 0.814,
            "combine done": 0.206}
  got = fused_phases.gemm_region(phases, 16384, 8, 2048, 768)
  assert abs(got["ms"] - 2.045) < 1e-9
  assert round(got["tflops"]) == 605, got


def test_gpu_clocks_summary_leaves_idle_samples_out_and_names_reasons(tmp_path):
  """gpu_clocks: idle samples (reason bit 0x1 alone) are not counted in the clock and power
  figures; a sample's reason bits are each counted; the samples under the power cap are
  summarised apart; rows that are not samples (an error line, a cut last line, "[N/A]" clocks)
  are skipped; a file without a busy sample says so."""
  from benchmarks import gpu_clocks
  rows = ["2026/12/06 22:14:15.123, 345, 70.12, 31, 0x0000000000000001",
          "2026/12/06 22:14:15.323, 1980, 650.50, 55, 0x0000000000000000",
          "2026/12/06 22:14:15.523, 1755, 699.90, 60, 0x0000000000000004",
          "2026/12/06 22:14:15.723, 1650, 700.00, 62, 0x0000000000000024",
          "2026/12/06 22:14:15.923, 1700, [N/A], 61, 0x0000000000000004",
          "2026/12/06 22:14:16.123, [N/A], 500, 61, 0x0000000000000000",
          "Failed to query", "2026/12/06 22:14:16.3"]
  samples = gpu_clocks.parse(rows)
  assert len(samples) == 5
  text = gpu_clocks.summarize(samples, "235b")
  assert text.startswith("clocks 235b: 5 samples, 4 busy;"), text
  assert "SM MHz min/median/max 1650 / 1728 / 1980" in text, text
  assert "power W 650 / 700 / 700" in text, text
  assert "max temp 62 C" in text, text
  assert "sw_power_cap 3, sw_thermal_slowdown 1" in text, text
  assert "gpu_idle" not in text, text
  # the clock under the power cap: the three samples with bit 0x4, one without a power figure
  assert text.endswith("under the power cap (3 samples): SM MHz min/median/max 1650 / 1700 / "
                       "1755, power W 700 / 700 / 700"), text
  assert "no busy sample" in gpu_clocks.summarize(samples[:1])
  assert "power cap" not in gpu_clocks.summarize(samples[:2])
  path = tmp_path / "clocks.csv"
  path.write_text("\n".join(rows) + "\n")
  assert gpu_clocks.main([str(path), "--label", "235b"]) == 0


def test_energy_per_call_summarizes_a_run():
  """energy_per_call.summarize_run: per-call ms and J, mean W from the energy and the time, the
  SM clock's median over every sample and over those under the power cap."""
  from benchmarks import energy_per_call, gpu_clocks
  rows = ["t, 1980, 300, 50, 0x0000000000000000", "t, 1500, 690, 60, 0x0000000000000004",
          "t, 1400, 700, 61, 0x0000000000000004", "t, 1600, 680, 61, 0x0000000000000004"]
  r = energy_per_call.summarize_run(200, 2.0, 1300.0, gpu_clocks.parse(rows))
  assert r["ms_per_call"] == pytest.approx(10.0) and r["j_per_call"] == pytest.approx(6.5)
  assert r["mean_w"] == pytest.approx(650.0)
  assert r["sm_mhz_median"] == 1550 and r["sm_mhz_capped_median"] == 1500
  assert (r["samples"], r["capped_samples"]) == (4, 3)
  none = energy_per_call.summarize_run(10, 1.0, 100.0, gpu_clocks.parse(rows[:1]))
  assert none["capped_samples"] == 0 and none["sm_mhz_capped_median"] is None
  with pytest.raises(SystemExit, match="--seconds must be > 0"):
    energy_per_call.main(["--seconds", "0"])
  # The energy: from the counter where nvidia-smi has one, else mean power x time.
  assert energy_per_call.run_joules(1000.0, 7500.0, 2.0, []) == (6.5, "energy counter")
  joules, source = energy_per_call.run_joules(None, None, 2.0, gpu_clocks.parse(rows))
  assert joules == pytest.approx(2.0 * (300 + 690 + 700 + 680) / 4)
  assert source == "mean of power samples"
  with pytest.raises(SystemExit, match="neither an energy counter nor power samples"):
    energy_per_call.run_joules(1.0, None, 2.0, [])


def test_energy_per_call_queries_nvidia_smi_fields(tmp_path, monkeypatch):
  """query_gpu0: a field's number; None where nvidia-smi refuses the field (exit 2, as driver
  580.159 did for the energy counter) or prints "[N/A]"; the samples use the instantaneous
  power only where it reads."""
  from benchmarks import energy_per_call
  fake = tmp_path / "nvidia-smi"
  fake.write_text("#!/bin/sh\n"
                  "case \"$*\" in\n"
                  "  *total_energy_consumption*) echo 'Field is not a valid field' >&2; exit 2;;\n"
                  "  *power.draw.instant*) echo '[N/A]';;\n"
                  "  *) echo '612.34';;\n"
                  "esac\n")
  fake.chmod(0o755)
  monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
  assert energy_per_call.query_gpu0("power.draw") == pytest.approx(612.34)
  assert energy_per_call.energy_mj() is None
  assert energy_per_call.query_gpu0("power.draw.instant") is None
  energy_per_call.sample_query.cache_clear()  # asked once per process: ask this fake
  try:
    assert energy_per_call.sample_query().split(",")[2] == "power.draw"
  finally:
    energy_per_call.sample_query.cache_clear()


def test_energy_per_call_parses_fused_env_variants():
  """--fused-env: ';' between variants, ',' inside one, only the fused handlers' overrides; the
  labels name each setting; the environment is set around a timed run only."""
  from benchmarks import energy_per_call
  got = energy_per_call.parse_fused_env(
      "MEGAMOE_FUSED_COPY_HEAD=100; MEGAMOE_FUSED_L1_ORDER=m,MEGAMOE_FUSED_L2_TMA=0;")
  assert got == [{"MEGAMOE_FUSED_COPY_HEAD": "100"},
                 {"MEGAMOE_FUSED_L1_ORDER": "m", "MEGAMOE_FUSED_L2_TMA": "0"}]
  assert energy_per_call.variant_label("fused", got[1]) == "fused[L1_ORDER=m][L2_TMA=0]"
  assert energy_per_call.parse_fused_env("") == []
  for bad in ("COPY_HEAD=100", "MEGAMOE_FUSED_COPY_HEAD", "XLA_FLAGS=--x"):
    with pytest.raises(SystemExit, match="is not MEGAMOE_FUSED_"):
      energy_per_call.parse_fused_env(bad)
  seen = []
  def call():  # records the setting, then stops the run before it reaches nvidia-smi
    seen.append(os.environ.get("MEGAMOE_FUSED_COPY_HEAD"))
    raise RuntimeError("stop")
  assert "MEGAMOE_FUSED_COPY_HEAD" not in os.environ
  with pytest.raises(RuntimeError, match="stop"):
    energy_per_call.timed_run(call, 1.0, {"MEGAMOE_FUSED_COPY_HEAD": "100"})
  assert seen == ["100"] and "MEGAMOE_FUSED_COPY_HEAD" not in os.environ


def test_fused_phases_alone_trace_groups_calls_by_gap():
  """alone_trace: kernels closer than 50 us are one call (their gaps are idle inside it);
  farther apart, a new group; per-call figures divide by the calls made."""
  from benchmarks import fused_phases, trace_events
  ev = lambda start_us, dur_us: trace_events.DeviceEvent("gpu:0", "s", "k", start_us * 1e3,
                                                         dur_us * 1e3)
  # call 1: 0-100, gap 10, 110-200 (overlapping 150-160); call 2 at 400: 400-500, gap 20.
  events = [ev(0, 100), ev(110, 90), ev(150, 10), ev(400, 100), ev(520, 30)]
  got = fused_phases.alone_trace(events, 2)
  assert got["alone_groups_seen"] == 2
  assert got["alone_gpu_busy_ms"] == pytest.approx((190 + 130) / 2 * 1e-3)
  assert got["alone_gpu_idle_inside_ms"] == pytest.approx((10 + 20) / 2 * 1e-3)


def test_call_latency_splits_annotated_calls():
  """call_latency.split_calls: per annotated call, launch delay (to the first kernel), GPU span
  and tail, and the host events inside the launch delay clipped to it."""
  from benchmarks import call_latency
  a = call_latency.ANNOTATION
  host = [(a, 0, 1000), ("dispatch", 0, 300), ("thunk", 250, 900), (a, 2000, 2600),
          ("dispatch", 2000, 2100)]
  gpu = [(400, 700), (720, 950), (2200, 2500), (1500, 1600)]
  calls = call_latency.split_calls(host, gpu)
  assert len(calls) == 2
  assert calls[0] == {"launch_delay_ns": 400, "gpu_span_ns": 550, "tail_ns": 50,
                      "host_ns": {"dispatch": 300.0, "thunk": 150.0}}
  assert calls[1]["launch_delay_ns"] == 200 and calls[1]["host_ns"] == {"dispatch": 100.0}
  s = call_latency.summarise(calls, top=1)
  assert s["calls"] == 2 and list(s["host_ms"]) == ["dispatch"]
  assert s["launch_delay_ms"] == pytest.approx(300e-6)


def test_bench_quantize_times_every_quantiser_and_the_copy_floor(tmp_path):
  """bench_quantize (on the CPU handlers here): a row per op and shape, with the bytes each op
  moves (2 read + 1 written per value + the scales) and the JSON written."""
  from benchmarks import bench_quantize
  from jax_megamoe.backends import cuda_fp8
  if not all(_ffi.has_target(t, "cpu") for t in cuda_fp8.TARGETS):
    pytest.skip("not run: the native extension (with the FP8 CPU handlers) is not built")
  out = bench_quantize.main(["--shapes", "small", "--experts", "2", "--tokens", "128",
                             "--out", str(tmp_path / "q.json")])
  ops = [r["op"] for r in out["rows"]]
  assert len(ops) == 4 and ops[0].startswith("weights") and ops[3].startswith("floor")
  h, f = 512, 256
  assert out["rows"][0]["bytes"] == 3 * 2 * (h * 2 * f) + 4 * 2 * (h * 2 * f) // 128 + \
      3 * 2 * (f * h) + 4 * 2 * (f * h) // 128
  assert all(r["ms"] > 0 for r in out["rows"])
  assert json.loads((tmp_path / "q.json").read_text())["rows"] == out["rows"]


def test_fused_phases_layer_call_under_the_bench_mesh():
  """fused_phases times the layer under bench_layer's one-device mesh by default (the bar's
  figures); under it the layer is the same function as without a mesh."""
  from benchmarks import fused_phases
  x, ids, w, wgu, wd = _tiny_layer(1)
  mesh = fused_phases.one_gpu_mesh()
  assert mesh.shape == {"data": 1, "expert": 1}
  got = fused_phases.layer_call("reference", None, "fwd", mesh=mesh)(x, ids, w, wgu, wd)
  want = fused_phases.layer_call("reference", None, "fwd")(x, ids, w, wgu, wd)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_bench_route_times_every_norm_and_compares_balance_variants(capsys):
  """bench_route (CPU here): a line per selection norm, and a line per variant of balance's solve,
  each compared with the default's choice; the kernel's line says it did not run (8 CPU
  devices, no mesh); the module's kernel switch is left as it was."""
  from benchmarks import bench_route
  from jax_megamoe import router
  before = router.BALANCE_KERNEL
  bench_route.main(["--tokens", "64", "--experts", "32", "--top-k", "2", "--reps", "1"])
  out = capsys.readouterr().out
  assert router.BALANCE_KERNEL == before
  for norm in router.SELECTION_NORMS[:-1]:
    assert f"\n{norm} " in out
  assert out.count("same choice") + out.count("choice differs") == 3, out
  assert re.search(r"balance, kernel +not run", out), out


def test_ce_logsumexp_passes_times_both_forms(capsys):
  """ce_logsumexp_passes at a 1,000-token vocabulary: a line per form of the log-sum-exp, each
  against jax.nn.logsumexp, and the loss + d_logits lines; the module's switch is left as it
  was."""
  from benchmarks import ce_logsumexp_passes
  from jax_megamoe.models import losses
  before = losses.CE_LSE_ONE_PASS
  ce_logsumexp_passes.main(["--vocab", "1000", "--reps", "1"])
  out = capsys.readouterr().out
  assert losses.CE_LSE_ONE_PASS == before
  diffs = [float(d) for d in re.findall(r"max \|diff\| (\S+)", out)]
  assert "two passes" in out and "one pass" in out and len(diffs) == 2, out
  assert max(diffs) < 1e-5, out
  # The chunk's loss + d_logits: the JAX definition timed; the kernel where it runs.
  assert re.search(r"jax +loss \+ d_logits [\d.]+ [\d.]+ ", out), out
  assert re.search(r"kernel +loss \+ d_logits ([\d.]+ [\d.]+ |not run)", out), out


def test_balance_solve_quality_compares_every_variant_on_every_router(capsys):
  """balance_solve_quality at 256 tokens: a line per synthetic router and solve variant, each
  variant but the default compared with the default's offsets and choice."""
  from benchmarks import balance_solve_quality as q
  q.main(["--tokens", "256"])
  out = capsys.readouterr().out
  routers, variants = 5, len(q.VARIANTS)
  assert len(re.findall(r"imbalance \d+\.\d{3} ", out)) == routers * variants, out
  assert out.count("choice differs") == routers * (variants - 1), out


def test_bench_embedding_grad_times_both_lookups_on_every_distribution(capsys):
  """bench_embedding_grad at a small table: a line per id distribution and lookup, with its
  time and its error against the float64 sum; embedding_lookup's bfloat16 gradient within about
  one rounding of the largest entry."""
  from benchmarks import bench_embedding_grad
  bench_embedding_grad.main(["--batch", "2", "--seq", "256", "--vocab", "500", "--hidden", "32",
                             "--reps", "1"])
  out = capsys.readouterr().out
  lines = [line for line in out.splitlines() if "queued" in line]
  assert len(lines) == 6, out
  for line in lines:
    if "embedding_lookup" in line:
      assert float(line.rsplit(" ", 1)[1]) < 2.0 ** -7, line

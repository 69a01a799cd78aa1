"""benchmarks/profile_step.py and its parts: a real trace of the tiny training step on CPU is
read (xplane and JSON alike) and every category the issue names that the CPU step has is found
by its named scope; the rules place this project's GPU kernels, NCCL and cuDNN by name; a GPU
trace's stream lines are read and its derived lines skipped (a synthetic XSpace)."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

sys.path.append(str(pathlib.Path(__file__).resolve().parent.parent))
from benchmarks import (hlo_ops, profile_step, report, step_breakdown,  # noqa: E402
                        step_categories, trace_events)


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory):
  out = tmp_path_factory.mktemp("profile")
  result = profile_step.main(["--smoke", "--steps", "2", "--warmup", "1", "--trace-dir",
                              str(out / "trace"), "--md", str(out / "RESULTS.md")])
  return result, out


def _rows(profile):
  return {r["label"]: r for r in profile["rows"]}


def test_tiny_step_profile_on_cpu(tiny_profile):
  result, out = tiny_profile
  p = result["profile"]
  assert p["platform"] == "cpu" and p["steps"] == 2 and p["hlo_known"]
  assert p["hlo_matched_share"] == pytest.approx(1.0)
  assert p["module"] == "jit_train_step"
  rows = _rows(p)
  # Found through the model's and the train step's named scopes (not guessed from names).
  for label in ("attention (softmax(QK)V: cuDNN flash / XLA)",
                "attention projections (q, k, v, o)", "LM head + cross-entropy",
                "router + aux losses", "optimizer update (AdamW, clipping, non-finite guard)",
                "norms, RoPE, residual adds, other elementwise", "dtype casts",
                "MoE forward: XLA GEMMs (ragged_dot)", "MoE backward: XLA GEMMs (ragged_dot)",
                "MoE recompute: XLA GEMMs (ragged_dot)", "idle gaps (no kernel on any stream)"):
    assert label in rows, (label, sorted(rows))
    if label.startswith(("MoE", "attention", "LM head", "optimizer")):
      assert rows[label]["ms"] > 0, label
  assert "unattributed (no HLO op or scope)" not in rows  # the HLO names every thunk's op
  # The rows add up to the step: categories + idle - overlap.
  assert sum(r["ms"] for r in p["rows"]) == pytest.approx(p["step_ms"], rel=1e-6)
  assert sum(r["share"] for r in p["rows"]) == pytest.approx(1.0, rel=1e-6)
  assert 0 < p["gemm_ms"] < p["kernel_ms"]
  assert 0 <= p["outside_gemm_attention_optimizer_share"] <= 1
  assert result["meta"]["imbalance"] >= 1.0 and result["meta"]["backend"] == "reference"
  saved = json.loads(pathlib.Path(out / "trace" / "profile.json").read_text())
  assert saved["meta"]["kind"] == "step_profile" and saved["profile"]["rows"] == p["rows"]
  markdown = (out / "RESULTS.md").read_text()
  assert "## Training step profile" in markdown and "| category | ms / step |" in markdown
  assert "| LM head + cross-entropy |" in markdown and "top kernels" in markdown
  assert "MoE forward: XLA GEMMs" in report.short_table(result)


def test_an_existing_trace_reads_the_same_from_xplane_and_json(tiny_profile, tmp_path):
  _, out = tiny_profile
  trace_dir = out / "trace"
  run_dirs = list((trace_dir / "plugins" / "profile").iterdir())
  (xplane,) = run_dirs[0].glob("*.xplane.pb")
  (json_trace,) = run_dirs[0].glob("*.trace.json.gz")
  from_dir = profile_step.main(["--trace", str(trace_dir), "--out", str(tmp_path / "a.json"),
                                "--md", ""])["profile"]
  from_json = profile_step.main(["--trace", str(json_trace), "--out", str(tmp_path / "b.json"),
                                 "--md", ""])["profile"]
  assert from_dir["trace"] == str(xplane) and from_dir["hlo_known"] and from_json["hlo_known"]
  assert from_dir["steps"] == from_json["steps"] == 2  # counted from the run ids
  a, b = _rows(from_dir), _rows(from_json)
  assert set(a) == set(b)
  for label in a:  # JSON rounds times to 1 ns (us with 3 decimals)
    assert a[label]["ms"] == pytest.approx(b[label]["ms"], abs=1e-3), label


def test_trace_errors_name_the_path(tmp_path):
  with pytest.raises(FileNotFoundError, match="no such file"):
    trace_events.read_trace(tmp_path / "missing")
  with pytest.raises(FileNotFoundError, match=r"no \*.xplane.pb"):
    trace_events.read_trace(tmp_path)
  with pytest.raises(ValueError, match="not HLO text"):
    hlo_ops.parse_hlo_text("hello")


def _op(opcodes, op_names=(), target=None):
  return hlo_ops.HloOp(name="x", opcode=opcodes[0], computation="main", target=target,
                       op_names=tuple(op_names), opcodes=tuple(opcodes))


@pytest.mark.parametrize("kernel,op,scope,want", [
    ("void DispatchSendKernel<__nv_bfloat16>(PeerView, int)", None, None,
     ("moe", "EP dispatch", "forward")),
    ("CombineBwdRecvKernel", _op(["custom-call"], target="megamoe_ep_combine_bwd"), None,
     ("moe", "EP combine", "backward")),
    ("cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<...>>",
     _op(["custom-call"], ["jit(step)/transpose(jvp(moe))/experts/moe"],
         "megamoe_grouped_mlp_bwd"), None, ("moe", "grouped GEMM (CUTLASS)", "backward")),
    ("SwigluQuantizeKernel", _op(["custom-call"], target="megamoe_fp8_swiglu_quantize"), None,
     ("moe", "FP8 quantise", "forward")),
    ("FusedMoeForwardKernel", None, None, ("moe", "fused dispatch + GEMMs + combine", "forward")),
    ("megamoe::grouped::(anonymous namespace)::MoeDgradKernel(EngineParams<GroupRowDest>, ...)",
     _op(["custom-call"], ["jit(step)/transpose(jvp(moe))/experts/moe"],
         "megamoe_grouped_mlp_bwd"), None,
     ("moe", "dgrad GEMMs + SwiGLU bwd (tile engine)", "backward")),
    ("SwigluForwardKernel", None, "checkpoint/rematted_computation/moe/experts/moe", ("moe", "SwiGLU", "recompute")),
    ("CrossEntropyGradKernel<true, 4>", _op(["custom-call"], ["jit(s)/cross_entropy/ffi_call"],
                                            "megamoe_cross_entropy_grad"), None,
     ("lm_head", None, None)),
    ("CrossEntropyGradKernel<true, 4>", None, "jit(s)/cross_entropy/ffi_call",
     ("lm_head", None, None)),
    ("BalanceOffsetsKernel<4, true>", _op(["custom-call"], ["jit(s)/jvp(moe)/router/ffi_call"],
                                          "megamoe_balance_offsets"), None,
     ("router", None, None)),
    ("ncclDevKernel_AllGather_RING_LL", None, None, ("collectives", None, None)),
    ("all-gather-start", _op(["all-gather-start"]), None, ("collectives", None, None)),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", None, None, ("attention", None, None)),
    ("loop_convert_fusion", _op(["fusion", "parameter", "convert", "bitcast"]), None,
     ("casts", None, None)),
    ("sm90_xmma_gemm_bf16bf16", _op(["custom-call"], ["jit(s)/jvp(attention)/qkv_proj/dot"],
                                     "__cublas$lt$matmul"), None, ("attention_proj", None, None)),
    ("loop_add_fusion", _op(["fusion", "add", "multiply"],
                            ["jit(s)/optimizer/add", "jit(s)/optimizer/mul", "jit(s)/add"]),
     None, ("optimizer", None, None)),
    ("loop_reduce_fusion", None, "transpose(jvp(moe))/router/reduce_sum", ("router", None, None)),
    ("some_kernel", None, None, ("unattributed", None, None)),
])
def test_placement_rules(kernel, op, scope, want):
  got = step_categories.place(kernel, op, scope)
  assert (got.category, got.kind, got.direction) == want


def test_the_dgrad_core_counts_as_gemm_time():
  for op in (None, _op(["custom-call"], target="megamoe_grouped_mlp_bwd")):
    assert step_categories.place("MoeDgradKernel", op).gemm
  assert not step_categories.place("SwigluBackwardKernel", None).gemm


def test_scopes_unwrap_transforms_and_tell_the_direction():
  assert step_categories.scopes("jit(train_step)/jvp(moe)/router/top_k") == (
      ["train_step", "moe", "router", "top_k"], "forward")
  names, direction = step_categories.scopes(
      "jit(train_step)/transpose(jvp(jvp()))/checkpoint/attention/core/dot_general")
  assert direction == "backward" and ["attention", "core"] == names[-3:-1]
  assert step_categories.scopes(
      "jit(s)/transpose(jvp(jvp()))/checkpoint/rematted_computation/moe/experts/gather")[1] == \
      "recompute"


GPU_XSPACE = """
planes {
  id: 1 name: "/device:GPU:0"
  lines { id: 1 name: "Stream #7(compute)" timestamp_ns: 0
    events { metadata_id: 1 offset_ps: 0 duration_ps: 4000000 stats { metadata_id: 10 str_value: "custom-call.3" } stats { metadata_id: 11 str_value: "jit_train_step" } }
    events { metadata_id: 2 offset_ps: 5000000 duration_ps: 2000000 stats { metadata_id: 12 ref_value: 20 } }
    events { metadata_id: 1 offset_ps: 10000000 duration_ps: 4000000 stats { metadata_id: 10 str_value: "custom-call.3" } stats { metadata_id: 11 str_value: "jit_train_step" } }
    events { metadata_id: 2 offset_ps: 15000000 duration_ps: 2000000 stats { metadata_id: 12 ref_value: 20 } }
  }
  lines { id: 2 name: "Stream #9(nccl)" timestamp_ns: 0
    events { metadata_id: 3 offset_ps: 1000000 duration_ps: 2000000 stats { metadata_id: 12 ref_value: 21 } }
    events { metadata_id: 3 offset_ps: 11000000 duration_ps: 2000000 stats { metadata_id: 12 ref_value: 21 } }
  }
  lines { id: 3 name: "XLA Ops" timestamp_ns: 0
    events { metadata_id: 1 offset_ps: 0 duration_ps: 4000000 }
  }
  event_metadata { key: 1 value { id: 1 name: "void DispatchSendKernel<__nv_bfloat16>(PeerView)" } }
  event_metadata { key: 2 value { id: 2 name: "loop_fusion_3" } }
  event_metadata { key: 3 value { id: 3 name: "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL" } }
  stat_metadata { key: 10 value { id: 10 name: "hlo_op" } }
  stat_metadata { key: 11 value { id: 11 name: "hlo_module" } }
  stat_metadata { key: 12 value { id: 12 name: "kernel_annotation" } }
  stat_metadata { key: 20 value { id: 20 name: "XlaModule:#hlo_module=jit_train_step,program_id=3#::Thunk:#name=transpose(jvp(attention))/core/dot,hlo_op=fusion.7#" } }
  stat_metadata { key: 21 value { id: 21 name: "XlaModule:#hlo_module=jit_train_step,program_id=3#::Thunk:#hlo_op=reduce-scatter.2#" } }
}
"""


def test_gpu_trace_streams_annotations_idle_and_overlap(tmp_path, monkeypatch):
  from jax.profiler import ProfileData
  path = tmp_path / "host.xplane.pb"
  path.write_bytes(ProfileData.text_proto_to_serialized_xspace(GPU_XSPACE))
  trace = trace_events.read_trace(tmp_path)
  assert trace.platform == "gpu"
  assert len(trace.events) == 6  # the "XLA Ops" line repeats a kernel: skipped
  fusion = next(e for e in trace.events if e.name == "loop_fusion_3")
  assert (fusion.hlo_op, fusion.hlo_module, fusion.scope) == (
      "fusion.7", "jit_train_step", "transpose(jvp(attention))/core/dot")
  p = step_breakdown.breakdown(trace)
  assert p["steps"] == 2 and p["devices"] == ["gpu:0"] and not p["hlo_known"]
  rows = _rows(p)
  # Per step: dispatch 4 us, attention 2 us, reduce-scatter 2 us (under the dispatch), a 1 us
  # gap between them; window 17 us over 2 steps.
  assert rows["MoE forward: EP dispatch"]["ms"] == pytest.approx(0.004)
  assert rows["attention (softmax(QK)V: cuDNN flash / XLA)"]["ms"] == pytest.approx(0.002)
  assert rows["collectives (XLA / NCCL)"]["ms"] == pytest.approx(0.002)
  assert rows["idle gaps (no kernel on any stream)"]["ms"] == pytest.approx(0.0025)
  assert rows["overlap (concurrent streams, counted twice above)"]["ms"] == pytest.approx(-0.002)
  assert p["step_ms"] == pytest.approx(0.0085)
  assert sum(r["ms"] for r in p["rows"]) == pytest.approx(p["step_ms"])
  # Kernel kinds: instance numbers dropped, summed over HLO ops; the same total time.
  kinds = {(k["kernel"], k["label"]) for k in p["top_kernel_kinds"]}
  assert ("loop_fusion", "attention (softmax(QK)V: cuDNN flash / XLA)") in kinds
  assert all(k["hlo_op"] == "*" for k in p["top_kernel_kinds"])
  assert sum(k["ms"] for k in p["top_kernel_kinds"]) == pytest.approx(
      sum(k["ms"] for k in p["top_kernels"]))


HLO_TEXT = """HloModule jit_train_step, is_scheduled=true

%fused_computation.1 (param_0: f32[8,4]) -> bf16[8,4] {
  %param_0 = f32[8,4]{1,0} parameter(0)
  ROOT %convert.1 = bf16[8,4]{1,0} convert(%param_0), metadata={op_name="jit(train_step)/jvp(moe)/experts/convert_element_type"}
}

%fused_computation.2 (param_0.1: bf16[8,4], param_1: bf16[4,4]) -> bf16[8,4] {
  %param_0.1 = bf16[8,4]{1,0} parameter(0)
  %param_1 = bf16[4,4]{1,0} parameter(1)
  ROOT %dot.1 = bf16[8,4]{1,0} dot(%param_0.1, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(train_step)/transpose(jvp(attention))/out_proj/dot_general"}
}

ENTRY %main.9 (p0: f32[8,4], p1: bf16[4,4]) -> (bf16[8,4], bf16[8,4]) {
  %p0 = f32[8,4]{1,0} parameter(0)
  %p1 = bf16[4,4]{1,0} parameter(1)
  %loop_convert_fusion.3 = bf16[8,4]{1,0} fusion(%p0), kind=kLoop, calls=%fused_computation.1
  %gemm_fusion.4 = bf16[8,4]{1,0} fusion(%loop_convert_fusion.3, %p1), kind=kCustom, calls=%fused_computation.2, metadata={op_name="jit(train_step)/transpose(jvp(attention))/out_proj/dot_general"}
  %custom-call.5 = bf16[8,4]{1,0} custom-call(%gemm_fusion.4), custom_call_target="megamoe_grouped_mlp_fwd", metadata={op_name="jit(train_step)/jvp(moe)/experts/moe"}
  ROOT %tuple = (bf16[8,4]{1,0}, bf16[8,4]{1,0}) tuple(%gemm_fusion.4, %custom-call.5)
}
"""


def test_hlo_text_instructions_and_matching_gpu_kernel_names():
  info = hlo_ops.parse_hlo_text(HLO_TEXT)
  assert info.name == "jit_train_step" and set(info.ops) >= {"loop_convert_fusion.3",
                                                            "gemm_fusion.4", "custom-call.5"}
  cast, gemm, call = (info.ops[n] for n in ("loop_convert_fusion.3", "gemm_fusion.4",
                                            "custom-call.5"))
  assert cast.is_cast and not cast.is_gemm  # its op name comes from the fused body
  assert cast.op_names == ("jit(train_step)/jvp(moe)/experts/convert_element_type",)
  assert gemm.is_gemm and not gemm.is_cast and gemm.fusion_kind == "kCustom"
  assert call.target == "megamoe_grouped_mlp_fwd"
  events = [trace_events.DeviceEvent("gpu:0", "Stream #1", name, 1000.0 * i, 500.0)
            for i, name in enumerate(["loop_convert_fusion_3", "gemm_fusion_4",
                                      "cutlass::device_kernel<GemmUniversal>"])]
  events[2].hlo_op = "custom-call.5"  # a custom call's kernels carry its annotation
  trace = trace_events.Trace("gpu", events, "synthetic")
  p = step_breakdown.breakdown(trace, {info.name: info}, module=None, steps=1)
  assert p["hlo_matched_share"] == pytest.approx(1.0)  # kernel names spell the fusions
  assert {r["label"] for r in p["rows"]} >= {"dtype casts", "attention projections (q, k, v, o)",
                                             "MoE forward: grouped GEMM (CUTLASS)"}


def test_rows_add_up_with_a_tiny_overlap():
  """Overlap under 0.1% of the step still gets its row, so the rows add up to the step (CI on a
  loaded CPU once missed the identity by 0.07 ms of 72)."""
  ev = lambda stream, name, start, dur: trace_events.DeviceEvent(  # noqa: E731
      "gpu:0", stream, name, start, dur, hlo_module="jit_train_step", run_id="1")
  trace = trace_events.Trace("gpu", [ev("s1", "FusedMoeForwardKernel", 0.0, 1e6),
                                     ev("s2", "ncclDevKernel_AllGather_RING_LL", 5e5, 500.0)],
                             "synthetic")
  p = step_breakdown.breakdown(trace)
  rows = _rows(p)
  assert rows["overlap (concurrent streams, counted twice above)"]["ms"] == pytest.approx(-5e-4)
  assert sum(r["ms"] for r in p["rows"]) == pytest.approx(p["step_ms"], rel=1e-9)

"""Benchmark JSON -> a markdown table appended to benchmarks/RESULTS.md, a PNG bar chart, and
the short table the benchmarks print last.

  python3 benchmarks/report.py RESULT.json [...] [--md benchmarks/RESULTS.md] [--png chart.png]

Understands the JSON of bench_layer.py (kind "layer" and "layer_check"), bench_step.py
(kind "step") and profile_step.py (kind "step_profile"). Records that did not run keep their
status and message, as footnotes.
"""

from __future__ import annotations

import argparse
import json
import pathlib

PASS_ORDER = ("fwd", "bwd", "2f1b")


def _num(value, fmt="{:.2f}"):
  return "" if value is None else fmt.format(value)


def _status_cell(r, notes: list[str]) -> str:
  if r.get("status") == "ok":
    return "ok"
  note = f"{r.get('status')}: {r.get('error', '')}".strip()
  if note not in notes:
    notes.append(note)
  return f"{r.get('status')} [{notes.index(note) + 1}]"


def _header(meta: dict, title: str) -> list[str]:
  lines = [f"## {title} — {meta.get('date', '')}", "",
           f"- device: {meta.get('device', '?')} (jax {meta.get('jax_version', '?')})",
           f"- commit: `{meta.get('commit', '?')}`",
           f"- command: `{meta.get('command', '?')}`"]
  if meta.get("smoke"):
    lines.append("- smoke run at tiny sizes: no timing claims")
  return lines


def layer_markdown(result: dict) -> str:
  meta, notes = result["meta"], []
  lines = _header(meta, "MoE layer" if meta["kind"] == "layer" else "MoE layer numerics")
  lines.append(f"- set-up: {meta['tokens_per_gpu']} tokens/GPU, {meta['experts']} experts, "
               f"top-{meta['top_k']}, EP={meta['ep']}, routing skew {meta['skew']} "
               f"(seed {meta['seed']}), median of up to {meta.get('reps', '?')} reps")
  lines.append("")
  if meta["kind"] == "layer_check":
    lines += ["| shape | impl | dtype | max rel err (y, dx, dw_topk, dw_gate_up, dw_down) | "
              "tolerance | status |", "|---|---|---|---|---|---|"]
    for r in result["results"]:
      errs = ", ".join(f"{v:.1e}" for v in r.get("rel_err", {}).values())
      lines.append(f"| {r['shape']} | {r['impl']} | {r['recipe']} | {errs} | "
                   f"{r.get('tolerance', '')} | {_status_cell(r, notes)} |")
  else:
    lines += ["| shape | recipe | impl | pass | ms | queued ms | TFLOP/s | NVLink GB/s | "
              "of floor | x torch | x jax_native | status |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in _collapse_unrun(sorted(result["results"], key=_layer_key)):
      lines.append(
          f"| {r['shape']} | {r['recipe']} | {r['impl']} | {r['pass']} | {_num(r.get('ms'))} | "
          f"{_num(r.get('queued_ms'))} | "
          f"{_num(r.get('tflops'), '{:.3g}')} | {_num(r.get('nvlink_gbps'), '{:.3g}')} | "
          f"{_num(r.get('floor_fraction'), '{:.0%}')} | "
          f"{_num(r.get('speedup_vs_torch'), '{:.2f}x')} | "
          f"{_num(r.get('speedup_vs_jax_native'), '{:.2f}x')} | {_status_cell(r, notes)} |")
    lines += ["", "TFLOP/s: expert FLOPs per GPU (tokens x k x 6 x H x F per forward; backward "
              "2x) over the time. Floor: those FLOPs at 801 TFLOP/s (bf16) or 1446 (fp8), the "
              "ceilings measured in DESIGN.md §2. NVLink GB/s: the least traffic, one bf16 "
              "H-row per (token, remote rank) pair per one-way exchange, per GPU, over the time. "
              "Speed-ups are over the bf16 baselines. ms: each call waited for (its host round "
              "trip included); queued ms: calls queued back to back, one wait per few "
              "(benchmarks/timing.py), what a call costs inside a longer program where the "
              "device is the bottleneck."]
  return "\n".join(lines + _footnotes(notes)) + "\n"


def _compute_copy(meta: dict) -> str:
  """", compute copy on|off" where the record says (results from before it existed do not)."""
  if meta.get("compute_copy") is None:
    return ""
  return f", compute copy {'on' if meta['compute_copy'] else 'off'}"


def step_markdown(result: dict) -> str:
  meta, notes = result["meta"], []
  lines = _header(meta, "Training step")
  tokens = f"{meta['tokens_per_gpu']} tokens/GPU, " if meta.get("tokens_per_gpu") else ""
  lines.append(f"- model: {meta.get('config')} x {meta.get('layers')} layers, {tokens}batch "
               f"{meta.get('batch')} x seq {meta.get('seq_len')} per step, EP={meta.get('ep')}, "
               f"remat {meta.get('remat')}, attention {meta.get('attention', '?')}, data "
               f"{meta.get('data', 'random')}{_compute_copy(meta)}, {meta.get('reps')} reps")
  lines += ["", "| config | backend | step ms | tokens/s/GPU | TFLOP/s/GPU | MFU | imbalance "
                "(first -> last step) | peak GiB | status |",
            "|---|---|---|---|---|---|---|---|---|"]
  for r in result["results"]:
    imbalance = (f"{r['imbalance_first']:.2f} -> {r['imbalance_last']:.2f}"
                 if r.get("imbalance_first") is not None else "")
    lines.append(f"| {r.get('config')} | {r['backend']} | {_num(r.get('ms'))} | "
                 f"{_num(r.get('tokens_per_s_per_gpu'), '{:.0f}')} | "
                 f"{_num(r.get('tflops_per_gpu'), '{:.0f}')} | {_num(r.get('mfu'), '{:.1%}')} | "
                 f"{imbalance} | {_num(r.get('peak_gib'), '{:.1f}')} | "
                 f"{_status_cell(r, notes)} |")
  lines += ["", f"MFU: model FLOPs (6 x active params per token + attention) over "
                f"{meta.get('peak_tflops', '?')} TFLOP/s per GPU. Imbalance: the largest "
                f"expert's share of the routed slots over 1/E, worst layer (1 = balanced)."]
  return "\n".join(lines + _footnotes(notes)) + "\n"


def profile_markdown(result: dict) -> str:
  """The step profile of profile_step.py: time per category, then the top kernels."""
  meta, p = result["meta"], result["profile"]
  lines = _header(meta, "Training step profile")
  if meta.get("config"):
    lines.append(f"- step: {meta['config']} x {meta.get('layers')} layers, "
                 f"{meta.get('tokens_per_gpu')} tokens/GPU (seq {meta.get('seq_len')}), backend "
                 f"{meta.get('backend')}, recipe {meta.get('recipe')}, attention "
                 f"{meta.get('attention')}, cross-entropy chunk {meta.get('ce_chunk')}, remat "
                 f"{meta.get('remat')}, EP={meta.get('ep')}, data {meta.get('data')}"
                 f"{_compute_copy(meta)}")
  lines.append(f"- trace: {p['steps']} steps of module `{p['module']}` on "
               f"{len(p['devices'])} {p['platform']} device(s), mean over devices"
               + (f"; {p['hlo_matched_share']:.0%} of the kernel time matched to its HLO "
                  f"instruction" if p["hlo_known"] else "; no HLO text: classified by kernel "
                                                        "names and annotations only"))
  if meta.get("command_buffers") == "off":
    lines.append("- XLA command buffers (CUDA graphs) were off so that every kernel carries "
                 "its HLO op")
  lines += ["", "| category | ms / step | % of step | kernels / step |", "|---|---|---|---|"]
  for r in p["rows"]:
    kernels = f"{r['kernels']:g}" if r["kernels"] else ""
    lines.append(f"| {r['label']} | {r['ms']:.3f} | {r['share']:.1%} | {kernels} |")
  lines.append(f"| **step** | **{p['step_ms']:.3f}** | 100% | |")
  lines += ["", f"GEMMs {p['gemm_ms']:.3f} ms, attention (non-GEMM) {p['attention_ms']:.3f} ms, "
                f"optimizer {p['optimizer_ms']:.3f} ms; device time outside GEMMs, attention "
                f"and the optimizer: {p['outside_gemm_attention_optimizer_ms']:.3f} ms = "
                f"{p['outside_gemm_attention_optimizer_share']:.1%} of the step."]
  if meta.get("imbalance") is not None:
    lines.append(f"Routing imbalance of the profiled steps: {meta['imbalance']:.2f} (1 = "
                 f"balanced).")
  lines += ["", "| top kernels | HLO op | category | ms / step | % | per step |",
            "|---|---|---|---|---|---|"]
  for k in p["top_kernels"][:12]:
    name = k["kernel"].replace("|", "/")[:70]
    lines.append(f"| `{name}` | {k['hlo_op'] or ''} | {k['label']} | {k['ms']:.3f} | "
                 f"{k['share']:.1%} | {k['per_step']:g} |")
  return "\n".join(lines) + "\n"


def _footnotes(notes):
  return [""] + [f"[{i + 1}] {n}" for i, n in enumerate(notes)] if notes else []


def _collapse_unrun(rows):
  """One row with pass "all" where every pass of an implementation did not run, for one reason."""
  groups = {}
  for r in rows:
    groups.setdefault((r["shape"], r["recipe"], r["impl"]), []).append(r)
  out = []
  for group in groups.values():
    reasons = {(r.get("status"), r.get("error")) for r in group}
    if len(group) > 1 and len(reasons) == 1 and group[0].get("status") != "ok":
      out.append(dict(group[0], **{"pass": "all"}))
    else:
      out += group
  return out


def _layer_key(r):
  pass_rank = PASS_ORDER.index(r["pass"]) if r["pass"] in PASS_ORDER else 9
  return (r["shape"], r["recipe"], r["impl"], pass_rank)


def to_markdown(result: dict) -> str:
  kind = result["meta"].get("kind")
  if kind == "step_profile":
    return profile_markdown(result)
  return step_markdown(result) if kind == "step" else layer_markdown(result)


def append_markdown(result: dict, path: pathlib.Path) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  with path.open("a") as f:
    if path.stat().st_size == 0:
      f.write("# Benchmark results\n\nAppended by benchmarks/report.py; newest last.\n")
    f.write("\n" + to_markdown(result))


def bar_chart(result: dict, png: pathlib.Path) -> None:
  """One panel per (shape, recipe) (layer) or one panel of step times (step): ms per impl."""
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  ok = [r for r in result["results"] if r.get("status") == "ok" and r.get("ms")]
  meta = result["meta"]
  if meta.get("kind") == "step":
    panels = {("step", ""): ok}
    groups, member = ["step"], "backend"
  else:
    panels = {}
    for r in ok:
      panels.setdefault((r["shape"], r["recipe"]), []).append(r)
    groups, member = list(PASS_ORDER), "impl"
  panels = panels or {("no successful runs", ""): []}
  # One colour per implementation across panels.
  palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  colour = {name: palette[i % len(palette)]
            for i, name in enumerate(sorted({r[member] for r in ok}))}
  fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
  for ax, ((shape, recipe), rows) in zip(axes[0], sorted(panels.items())):
    names = sorted({r[member] for r in rows})
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
      values = [next((r["ms"] for r in rows if r[member] == name
                      and r.get("pass", "step") == g), 0.0) for g in groups]
      xs = [g + i * width for g in range(len(groups))]
      bars = ax.bar(xs, values, width, label=name, color=colour[name])
      ax.bar_label(bars, labels=[f"{v:.2f}" if v else "" for v in values], fontsize=7)
    ax.set_xticks([g + width * (len(names) - 1) / 2 for g in range(len(groups))], groups)
    ax.set_ylabel("ms (lower is better)")
    ax.set_title(f"{shape} {recipe}".strip())
    if names:
      ax.legend(fontsize=8)
  fig.suptitle(f"{meta.get('device', '')} — {meta.get('date', '')} — {meta.get('commit', '')}"
               + (" (smoke: no timing claims)" if meta.get("smoke") else ""), fontsize=9)
  fig.tight_layout()
  png.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(png, dpi=110)
  plt.close(fig)


def short_table(result: dict) -> str:
  """A few lines for the end of a run's log: ms per pass per implementation."""
  meta = result["meta"]
  if meta.get("kind") == "step_profile":
    p = result["profile"]
    return "\n".join([f"{r['label'][:58]:58s} {r['ms']:10.3f} ms {r['share']:7.1%}"
                      for r in p["rows"]] + [f"{'step':58s} {p['step_ms']:10.3f} ms"])
  if meta.get("kind") == "step":
    lines = [f"{'backend':18s} {'step ms':>9s} {'tok/s/GPU':>10s} {'MFU':>6s} {'imbalance':>9s}"]
    for r in result["results"]:
      if r.get("status") == "ok":
        imbalance = r.get("imbalance_last")
        lines.append(f"{r['backend']:18s} {r['ms']:9.2f} {r['tokens_per_s_per_gpu']:10.0f} "
                     f"{r['mfu']:6.1%} " + (f"{imbalance:9.2f}" if imbalance is not None
                                           else f"{'':9s}"))
      else:
        lines.append(f"{r['backend']:18s} {r['status']}: {r.get('error', '')[:60]}")
    return "\n".join(lines)
  if meta.get("kind") == "layer_check":
    return "\n".join(f"check {r['shape']:5s} {r['impl']:18s} {r['status']}"
                     + (f"  max rel err {max(r['rel_err'].values()):.1e}" if r.get("rel_err")
                        else f"  {r.get('error', '')[:60]}") for r in result["results"])
  cells = {}
  for r in result["results"]:
    key = (r["shape"], r["recipe"], r["impl"])
    if r.get("status") == "ok":
      extra = f" ({r['speedup_vs_torch']:.2f}x)" if r.get("speedup_vs_torch") else ""
      cells.setdefault(key, {})[r["pass"]] = f"{r['ms']:.2f}{extra}"
    else:
      cells.setdefault(key, {})[r["pass"]] = r.get("status", "?")
  lines = [f"{'shape':5s} {'recipe':6s} {'impl':18s} " + " ".join(f"{p:>17s}" for p in PASS_ORDER)
           + "   ms (x torch)"]
  for (shape, recipe, impl), by_pass in sorted(cells.items()):
    lines.append(f"{shape:5s} {recipe:6s} {impl:18s} "
                 + " ".join(f"{by_pass.get(p, '-'):>17s}" for p in PASS_ORDER))
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("json", nargs="+")
  parser.add_argument("--md", default=str(pathlib.Path(__file__).with_name("RESULTS.md")))
  parser.add_argument("--png", help="chart for the (last) JSON")
  args = parser.parse_args(argv)
  for name in args.json:
    result = json.loads(pathlib.Path(name).read_text())
    if args.md:
      append_markdown(result, pathlib.Path(args.md))
    if args.png:
      bar_chart(result, pathlib.Path(args.png))
    print(short_table(result))


if __name__ == "__main__":
  main()

"""A step's device time by category, from the events of a profiler trace of a few steps.

Per device: each event's own time (an XLA:CPU loop thunk minus the thunks it ran inside it on
the same thread; a GPU kernel is its duration) goes to its category (step_categories.place);
the device's window runs from its first event of the module to its last; idle = window minus
the time any stream was busy; overlap = kernel time minus busy time (work on concurrent
streams, counted in two rows). Then the mean over devices, per step:

  step = sum(categories) + idle - overlap
"""

from __future__ import annotations

import collections
import re
import statistics

from benchmarks import step_categories
from benchmarks.hlo_ops import HloModuleInfo
from benchmarks.trace_events import DeviceEvent, Trace

TOP_KERNELS = 25
_KERNEL_SUFFIX = re.compile(r"_(\d+)$")


def breakdown(trace: Trace, hlo: dict[str, HloModuleInfo] | None = None, *,
              module: str | None = None, steps: int | None = None) -> dict:
  """The profile of the module that ran the step (default: the one with the most device
  time) as a JSON-able dict: rows (label, category, ms per step, share of the step, kernels
  per step, GEMM ms), step_ms, idle/overlap, GEMM, attention and optimizer time, the share
  outside them, the top kernels, what was left out (other modules) and hlo_matched_share (the
  kernel time whose HLO instruction was found: the rest is placed by kernel name alone)."""
  hlo = hlo or {}
  if not trace.events:
    raise ValueError(f"trace {trace.path!r} has no device events (was anything run on the "
                     "device while tracing?)")
  by_module = collections.defaultdict(float)
  for e in trace.events:
    by_module[e.hlo_module] += e.duration_ns
  named = {m: t for m, t in by_module.items() if m is not None}
  if module is None:
    module = max(named, key=named.get) if named else None
  elif module not in by_module:
    raise ValueError(f"module {module!r} is not in the trace; its modules: "
                     f"{sorted(m for m in by_module if m)}")
  events = [e for e in trace.events if e.hlo_module == module]
  info = hlo.get(module) if module else None
  if info is None and len(hlo) == 1:  # events without module names, one module's HLO given
    info = next(iter(hlo.values()))
  steps = steps or _count_steps(events)
  if steps < 1:
    raise ValueError(f"steps must be >= 1, got {steps}")

  devices = sorted({e.device for e in events})
  per_device = [_device_totals([e for e in events if e.device == d], info) for d in devices]
  rows = _mean_rows(per_device, steps)
  window = statistics.fmean(t["window_ns"] for t in per_device) / steps
  busy = statistics.fmean(t["busy_ns"] for t in per_device) / steps
  kernel = sum(r["ns"] for r in rows)
  matched = statistics.fmean(t["matched_ns"] for t in per_device) / steps
  gemm = sum(r["gemm_ns"] for r in rows)
  attention = sum(r["ns"] - r["gemm_ns"] for r in rows if r["category"] == "attention")
  optimizer = sum(r["ns"] - r["gemm_ns"] for r in rows if r["category"] == "optimizer")
  ms = lambda ns: ns / 1e6  # noqa: E731
  share = lambda ns: ns / window if window else 0.0  # noqa: E731
  table = [dict(label=r["label"], category=r["category"], ms=ms(r["ns"]), share=share(r["ns"]),
                kernels=r["count"], gemm_ms=ms(r["gemm_ns"])) for r in rows]
  table.append(dict(label="idle gaps (no kernel on any stream)", category="idle",
                    ms=ms(window - busy), share=share(window - busy), kernels=0, gemm_ms=0.0))
  if kernel > busy:  # any overlap at all: the rows must add up to the step
    table.append(dict(label="overlap (concurrent streams, counted twice above)",
                      category="overlap", ms=-ms(kernel - busy), share=-share(kernel - busy),
                      kernels=0, gemm_ms=0.0))
  outside = kernel - gemm - attention - optimizer
  other_modules = {m or "(no module)": ms(t) for m, t in by_module.items() if m != module}
  return dict(
      platform=trace.platform, trace=trace.path, module=module, steps=steps,
      devices=devices, hlo_known=info is not None,
      hlo_matched_share=matched / kernel if kernel else 0.0, step_ms=ms(window),
      busy_ms=ms(busy),
      kernel_ms=ms(kernel), gemm_ms=ms(gemm), attention_ms=ms(attention),
      optimizer_ms=ms(optimizer), outside_gemm_attention_optimizer_ms=ms(outside),
      outside_gemm_attention_optimizer_share=share(outside), rows=table,
      top_kernels=_top_kernels(per_device, steps, window),
      top_kernel_kinds=_top_kernels(per_device, steps, window, by_op=False, top=60),
      other_modules_ms_total=other_modules)


def _count_steps(events: list[DeviceEvent]) -> int:
  """Executions of the module: distinct run ids when every event has one, else the most
  common number of events per (device, instruction) (most instructions run once a step)."""
  if events and all(e.run_id for e in events):
    return len({e.run_id for e in events})
  counts = collections.Counter((e.device, e.hlo_op or e.name) for e in events)
  return collections.Counter(counts.values()).most_common(1)[0][0] if counts else 1


def _self_times(events: list[DeviceEvent]) -> list[float]:
  """Each event's duration minus that of the events nested in it on the same line."""
  own = [e.duration_ns for e in events]
  by_line = collections.defaultdict(list)
  for i, e in enumerate(events):
    by_line[e.stream].append(i)
  for indices in by_line.values():
    indices.sort(key=lambda i: (events[i].start_ns, -events[i].duration_ns))
    stack: list[int] = []
    for i in indices:
      while stack and events[stack[-1]].end_ns <= events[i].start_ns:
        stack.pop()
      if stack and events[i].end_ns <= events[stack[-1]].end_ns:
        own[stack[-1]] -= events[i].duration_ns
      stack.append(i)
  return [max(t, 0.0) for t in own]


def busy_ns(events: list[DeviceEvent]) -> float:
  """The time at least one of `events` runs (the union of their intervals)."""
  busy, end = 0.0, None
  for e in sorted(events, key=lambda e: e.start_ns):
    if end is None or e.start_ns > end:
      busy += e.duration_ns
      end = e.end_ns
    elif e.end_ns > end:
      busy += e.end_ns - end
      end = e.end_ns
  return busy


def _device_totals(events: list[DeviceEvent], info: HloModuleInfo | None) -> dict:
  totals = collections.defaultdict(lambda: dict(ns=0.0, gemm_ns=0.0, count=0))
  kernels = collections.defaultdict(lambda: dict(ns=0.0, count=0))
  places, matched_ns = {}, 0.0
  for e, own in zip(events, _self_times(events)):
    key = (e.name, e.hlo_op, e.scope)
    if key not in places:
      op = _instruction(info, e)
      places[key] = (step_categories.place(e.name, op, e.scope), op is not None)
    placement, matched = places[key]
    matched_ns += own if matched else 0.0
    row = totals[(placement.category, placement.label)]
    row["ns"] += own
    row["gemm_ns"] += own if placement.gemm else 0.0
    row["count"] += 1
    kernel = kernels[(e.name, e.hlo_op, placement.label)]
    kernel["ns"] += own
    kernel["count"] += 1
  window = max(e.end_ns for e in events) - min(e.start_ns for e in events)
  return dict(rows=totals, kernels=kernels, window_ns=window, busy_ns=busy_ns(events),
              matched_ns=matched_ns)


def _instruction(info: HloModuleInfo | None, e: DeviceEvent):
  """The HLO instruction an event ran for: its hlo_op, else its own name (XLA:CPU thunks), else
  the name as XLA:GPU spells a fusion's kernel ("loop_add_fusion_3" for loop_add_fusion.3)."""
  if info is None:
    return None
  for name in (e.hlo_op, e.name, _KERNEL_SUFFIX.sub(r".\1", e.name)):
    if name and name in info.ops:
      return info.ops[name]
  return None


def _row_order(key) -> tuple:
  category, label = key
  rank = step_categories.ORDER.index(category)
  if category == "moe":
    direction = label.split(":")[0].removeprefix("MoE ")
    return (rank, step_categories.MOE_DIRECTIONS.index(direction), label)
  return (rank, 0, label)


def _mean_rows(per_device: list[dict], steps: int) -> list[dict]:
  keys = sorted({k for t in per_device for k in t["rows"]}, key=_row_order)
  n = len(per_device)
  rows = []
  for key in keys:
    cells = [t["rows"].get(key, dict(ns=0.0, gemm_ns=0.0, count=0)) for t in per_device]
    rows.append(dict(category=key[0], label=key[1],
                     ns=sum(c["ns"] for c in cells) / n / steps,
                     gemm_ns=sum(c["gemm_ns"] for c in cells) / n / steps,
                     count=round(sum(c["count"] for c in cells) / n / steps, 1)))
  return rows


def _top_kernels(per_device: list[dict], steps: int, window_ns: float, *,
                 by_op: bool = True, top: int = TOP_KERNELS) -> list[dict]:
  """The kernels that took the most time, per (kernel, HLO op, row label); with by_op=False
  summed over the HLO ops that launch the same kind of kernel under one label, the kernel's
  instance number dropped ("loop_convert_fusion_2" -> "loop_convert_fusion"): where a
  category's time goes when each op is small (norms, RoPE, the router)."""
  merged = collections.defaultdict(lambda: dict(ns=0.0, count=0))
  for t in per_device:
    for (name, op, label), k in t["kernels"].items():
      key = (name, op, label) if by_op else (re.sub(r"[._]\d+$", "", name), "*", label)
      merged[key]["ns"] += k["ns"]
      merged[key]["count"] += k["count"]
  n = len(per_device)
  best = sorted(merged.items(), key=lambda item: -item[1]["ns"])[:top]
  return [dict(kernel=name[:120], hlo_op=op, label=label, ms=k["ns"] / n / steps / 1e6,
               share=k["ns"] / n / steps / window_ns if window_ns else 0.0,
               per_step=round(k["count"] / n / steps, 1))
          for (name, op, label), k in best]

"""The device work in a JAX profiler trace: one DeviceEvent per kernel (GPU) or XLA thunk
(XLA:CPU, whose "device" work runs on host threads), with the HLO instruction and module it ran
for.

Reads what `jax.profiler.trace(dir)` writes: `<dir>/plugins/profile/<run>/<host>.xplane.pb`
(through jax.profiler.ProfileData), or the Chrome-trace JSON written beside it
(`<host>.trace.json.gz`, `perfetto_trace.json.gz` with create_perfetto_trace=True).

GPU: events of the "/device:GPU:N" planes' stream lines (derived lines such as "XLA Ops" are
skipped: they repeat the kernels). The instruction comes from the event's `hlo_op` /
`hlo_module` stats, or from XLA's kernel annotation ("Thunk:#name=<scope>,hlo_op=<op>#").
CPU: events of the "/host:CPU" plane that carry an `hlo_op` stat, device = `device_ordinal`.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import pathlib
import re

# Lines of a GPU plane that repeat or summarise the stream lines' kernels.
_DERIVED_LINES = re.compile(r"^(XLA Ops|XLA Modules|Steps|Framework Ops|Framework Name Scope|"
                            r"Source code|TensorFlow Ops|TensorFlow Name Scope|XLA TraceMe|"
                            r"Launch Stats|SparseCore)", re.IGNORECASE)
_ANNOTATION_FIELD = re.compile(r"(?<![\w])(hlo_op|hlo_module|name|program_id)=([^,#]+)")
# Host-side bookkeeping events of XLA:CPU that are not work.
_CPU_NOISE = re.compile(r"^(end: |ThreadpoolListener|ThunkExecutor)")


@dataclasses.dataclass
class DeviceEvent:
  """One kernel or thunk. Times in nanoseconds from the trace's start."""

  device: str            # "gpu:0", "cpu:0"
  stream: str            # the trace line (GPU stream, CPU thread)
  name: str              # kernel name (GPU) or thunk name (CPU)
  start_ns: float
  duration_ns: float
  hlo_op: str | None = None
  hlo_module: str | None = None
  scope: str | None = None    # op-name path from XLA's kernel annotation, when present
  run_id: str | None = None   # one per execution of the module, when the trace says

  @property
  def end_ns(self) -> float:
    return self.start_ns + self.duration_ns


@dataclasses.dataclass
class Trace:
  platform: str          # "gpu" or "cpu"
  events: list[DeviceEvent]
  path: str


def find_trace_file(path: str | pathlib.Path) -> pathlib.Path:
  """A trace file itself, or the newest one under a jax.profiler.trace directory (an
  .xplane.pb before the JSON of the same run). Raises FileNotFoundError naming the path."""
  path = pathlib.Path(path)
  if path.is_file():
    return path
  if not path.is_dir():
    raise FileNotFoundError(f"trace {str(path)!r}: no such file or directory")
  candidates = [p for pattern in ("*.xplane.pb", "*.trace.json.gz", "perfetto_trace.json.gz")
                for p in path.rglob(pattern)]
  if not candidates:
    raise FileNotFoundError(f"trace {str(path)!r}: no *.xplane.pb or *trace.json.gz under it "
                            "(write one with jax.profiler.trace)")
  newest_run = max(p.parent.stat().st_mtime for p in candidates)
  run = [p for p in candidates if p.parent.stat().st_mtime == newest_run]
  return sorted(run, key=lambda p: (not p.name.endswith(".xplane.pb"), p.name))[0]


def read_trace(path: str | pathlib.Path) -> Trace:
  """The device events of a trace file or directory (see the module docstring)."""
  file = find_trace_file(path)
  if file.name.endswith(".xplane.pb"):
    events = _read_xplane(file)
  elif file.name.endswith((".json.gz", ".json")):
    events = _read_chrome_json(file)
  else:
    raise ValueError(f"trace {str(file)!r}: expected an .xplane.pb or a .json(.gz) trace")
  platform = "gpu" if any(e.device.startswith("gpu") for e in events) else "cpu"
  events = [e for e in events if e.device.startswith(platform)]
  events.sort(key=lambda e: (e.device, e.start_ns))
  return Trace(platform, events, str(file))


def _event(device, stream, name, start_ns, duration_ns, stats: dict) -> DeviceEvent:
  fields = {}
  for value in [name, *map(str, stats.values())]:
    if "#" in value and "=" in value:  # an XLA annotation, e.g. Thunk:#name=...,hlo_op=...#
      for key, found in _ANNOTATION_FIELD.findall(value):
        # Annotations nest outer::inner: the module from the outermost, the op innermost.
        if key == "hlo_module":
          fields.setdefault(key, found)
        else:
          fields[key] = found
  hlo_op = stats.get("hlo_op") or fields.get("hlo_op")
  hlo_module = stats.get("hlo_module") or fields.get("hlo_module")
  return DeviceEvent(device=device, stream=stream, name=name, start_ns=float(start_ns),
                     duration_ns=float(duration_ns), hlo_op=_str(hlo_op),
                     hlo_module=_str(hlo_module), scope=_str(fields.get("name")),
                     run_id=_str(stats.get("run_id")))


def _str(value) -> str | None:
  return None if value is None else str(value)


def _gpu_device(plane_name: str) -> str | None:
  match = re.match(r"^/device:GPU:(\d+)", plane_name)
  return f"gpu:{match.group(1)}" if match else None


def _read_xplane(file: pathlib.Path) -> list[DeviceEvent]:
  from jax.profiler import ProfileData  # noqa: PLC0415  (jax only where a trace is read)

  data = ProfileData.from_file(str(file))
  events = []
  for plane in data.planes:
    device = _gpu_device(plane.name)
    if device is not None:
      lines = [line for line in plane.lines if not _DERIVED_LINES.match(line.name)]
      streams = [line for line in lines if line.name.lower().startswith("stream")]
      for line in streams or lines:
        for e in line.events:
          events.append(_event(device, line.name, e.name, e.start_ns, e.duration_ns,
                               dict(e.stats)))
    elif plane.name == "/host:CPU":
      for line in plane.lines:
        for e in line.events:
          stats = dict(e.stats)
          if "hlo_op" in stats and not _CPU_NOISE.match(e.name):
            device_id = stats.get("device_ordinal", 0)
            events.append(_event(f"cpu:{device_id}", line.name, e.name, e.start_ns,
                                 e.duration_ns, stats))
  return events


def _read_chrome_json(file: pathlib.Path) -> list[DeviceEvent]:
  opener = gzip.open if file.name.endswith(".gz") else open
  with opener(file, "rt") as f:
    trace = json.load(f)
  raw = trace["traceEvents"] if isinstance(trace, dict) else trace
  processes, threads = {}, {}
  for e in raw:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      processes[e["pid"]] = e.get("args", {}).get("name", "")
    elif e.get("ph") == "M" and e.get("name") == "thread_name":
      threads[(e["pid"], e.get("tid"))] = e.get("args", {}).get("name", "")
  events = []
  for e in raw:
    if e.get("ph") != "X":
      continue
    process = processes.get(e.get("pid"), "")
    stream = threads.get((e.get("pid"), e.get("tid")), str(e.get("tid")))
    args = e.get("args", {}) or {}
    start, duration = float(e.get("ts", 0)) * 1e3, float(e.get("dur", 0)) * 1e3  # us -> ns
    device = _gpu_device(process)
    if device is not None:
      if not _DERIVED_LINES.match(stream):
        events.append(_event(device, stream, e.get("name", ""), start, duration, args))
    elif "hlo_op" in args and not _CPU_NOISE.match(e.get("name", "")):
      events.append(_event(f"cpu:{args.get('device_ordinal', 0)}", stream, e.get("name", ""),
                           start, duration, args))
  return events

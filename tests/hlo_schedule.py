"""What a compiled (scheduled) XLA program runs, in order, read from its HLO text
(`jax.jit(f).lower(...).compile().as_text()`): for tests that must know whether XLA placed an
operation inside an asynchronous collective's window, i.e. whether the two can run at the same
time. A scheduled module lists each computation's instructions in execution order; the entry
computation's calls (command buffers, called computations, loop bodies) are inlined where they
are called."""

from __future__ import annotations

import re

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLED = re.compile(r"(?:to_apply|calls|body|condition|called_computations)="
                     r"\{?([^,}\s]+(?:,\s*%[\w.\-]+)*)\}?")


def computations(hlo: str) -> tuple[str, dict[str, list[str]]]:
  """(the entry computation's name, {name: its instruction lines in order})."""
  comps: dict[str, list[str]] = {}
  entry, current = None, None
  for line in hlo.splitlines():
    if current is None:
      m = _COMPUTATION.match(line)
      if m and not line.startswith(("HloModule", " ")):
        current = m.group(2)
        comps[current] = []
        if m.group(1):
          entry = current
      continue
    if line.strip() == "}":
      current = None
    elif line.strip():
      comps[current].append(line.strip())
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  return entry, comps


def flat_schedule(hlo: str) -> list[str]:
  """The entry computation's instruction lines in execution order, each called computation's
  lines inlined after the instruction that calls it (recursively)."""
  entry, comps = computations(hlo)
  out: list[str] = []

  def walk(name: str, depth: int) -> None:
    if depth > 32:
      raise ValueError("computations nested too deep")
    for line in comps[name]:
      out.append(line)
      for group in _CALLED.findall(line):
        for callee in group.split(","):
          callee = callee.strip().lstrip("%")
          if callee in comps:
            walk(callee, depth + 1)

  walk(entry, 0)
  return out


def op_inside_async_window(hlo: str, start_op: str, marker: str) -> tuple[bool, str]:
  """Whether a line containing `marker` (e.g. a custom call's target) runs between an
  asynchronous `start_op` (e.g. "all-gather-start") and its done, in schedule order, with the
  start not converted to a synchronous collective ("is_sync":true). Returns (verdict, why)."""
  done_op = start_op.replace("-start", "-done")
  lines = flat_schedule(hlo)
  starts = [i for i, l in enumerate(lines) if f" {start_op}(" in l]
  dones = [i for i, l in enumerate(lines) if f" {done_op}(" in l]
  marks = [i for i, l in enumerate(lines) if marker in l]
  if not starts:
    return False, f"no {start_op} in the program"
  if not marks:
    return False, f"no instruction with {marker} in the program"
  for s in starts:
    later_dones = [d for d in dones if d > s]
    if not later_dones:
      continue
    d = later_dones[0]
    if '"is_sync":true' in lines[s]:
      continue
    if any(s < m < d for m in marks):
      return True, f"{start_op} at {s}, {marker} at {[m for m in marks if s < m < d]}, done at {d}"
  summary = "; ".join(f"{i}: {lines[i][:160]}" for i in sorted(set(starts + dones + marks)))
  return False, f"no asynchronous {start_op} window holds {marker} ({summary})"

"""What each instruction of a compiled HLO module is, read from its text (`compiled.as_text()`,
or an XLA dump's *after_optimizations.txt): opcode, custom-call target, the JAX op names
(named scopes) of the work it does, and whether it is a GEMM, a pure dtype cast or a collective.

A profiler trace names the instruction a kernel ran for (its `hlo_op`); this says what that
instruction was. For a fusion, the op names and opcodes of the instructions it fuses count.

  module = parse_hlo_text(text)
  module.ops["fusion.12"].op_names   # ("jit(train_step)/jvp(moe)/router/dot_general", ...)
"""

from __future__ import annotations

import dataclasses
import re

COLLECTIVE_OPCODES = frozenset({
    "all-reduce", "all-reduce-start", "all-reduce-done", "all-gather", "all-gather-start",
    "all-gather-done", "reduce-scatter", "all-to-all", "ragged-all-to-all",
    "collective-permute", "collective-permute-start", "collective-permute-done",
    "collective-broadcast", "send", "send-done", "recv", "recv-done"})
GEMM_OPCODES = frozenset({"dot", "convolution", "ragged-dot"})
# Instructions that move or relabel data without computing: they neither make a fusion a
# computation nor keep it from being a pure cast.
_LAYOUT_OPCODES = frozenset({
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "copy", "transpose",
    "reshape", "broadcast", "slice", "iota", "concatenate", "pad", "dynamic-slice"})
_CONTROL_FLOW_OPCODES = frozenset({"while", "conditional", "call"})
# Custom-call targets that are GEMMs (cuBLAS / cuBLASLt / Triton / XLA:CPU oneDNN, YNNPACK).
_GEMM_TARGET = re.compile(r"gemm|matmul|cublas|__triton|onednn.*matmul", re.IGNORECASE)

_MODULE = re.compile(r"^HloModule\s+([^\s,]+)")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"(?<![\w.\-\[])([a-z][a-z0-9\-]*)\(")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition|called_computations|"
                    r"branch_computations|true_computation|false_computation)="
                    r"(\{[^}]*\}|%?[\w.\-]+)")
_FUSION_KIND = re.compile(r"\bkind=(k\w+)")


@dataclasses.dataclass
class HloOp:
  """One instruction. `op_names`: the JAX op names of this instruction and of every
  instruction of the computations it calls (a fusion's body), in order, without duplicates;
  `opcodes` likewise (its own first)."""

  name: str
  opcode: str
  computation: str
  target: str | None = None
  fusion_kind: str | None = None
  op_names: tuple[str, ...] = ()
  opcodes: tuple[str, ...] = ()
  called: tuple[str, ...] = ()

  @property
  def is_collective(self) -> bool:
    return bool(COLLECTIVE_OPCODES & set(self.opcodes))

  @property
  def is_gemm(self) -> bool:
    return bool(GEMM_OPCODES & set(self.opcodes)) or bool(
        self.target and _GEMM_TARGET.search(self.target))

  @property
  def is_cast(self) -> bool:
    """Only converts (and data movement): what a dtype cast compiles to."""
    computing = [op for op in self.opcodes if op not in _LAYOUT_OPCODES and op != "fusion"]
    return bool(computing) and all(op == "convert" for op in computing)


@dataclasses.dataclass
class HloModuleInfo:
  name: str
  ops: dict[str, HloOp]


def parse_hlo_text(text: str) -> HloModuleInfo:
  """Parses one module's HLO text. Raises ValueError when the text has no HloModule line."""
  match = _MODULE.search(text.lstrip()) if text.lstrip().startswith("HloModule") else None
  if match is None:
    first = text.lstrip().splitlines()[0][:80] if text.strip() else ""
    raise ValueError(f"not HLO text (no 'HloModule' line first): {first!r}")
  module_name = match.group(1)
  raw: dict[str, dict] = {}        # instruction -> fields
  bodies: dict[str, list[str]] = {}  # computation -> its instructions
  computation = None
  for line in text.splitlines():
    header = _COMPUTATION.match(line)
    if header and "=" not in line.split("(")[0]:
      computation = header.group(2)
      bodies[computation] = []
      continue
    if line.strip() == "}":
      computation = None
      continue
    inst = _INSTRUCTION.match(line) if computation else None
    if inst is None:
      continue
    name, rest = inst.groups()
    opcode = _OPCODE.search(rest)
    if opcode is None:
      continue
    target = _TARGET.search(rest)
    kind = _FUSION_KIND.search(rest)
    raw[name] = dict(opcode=opcode.group(1), computation=computation,
                     target=target.group(1) if target else None,
                     fusion_kind=kind.group(1) if kind else None,
                     op_names=_split_op_names(rest), called=_called(rest))
    bodies[computation].append(name)

  def gather(name: str, seen: set[str]) -> tuple[list[str], list[str]]:
    fields = raw[name]
    op_names, opcodes = list(fields["op_names"]), [fields["opcode"]]
    # A loop's or a call's body runs as instructions (kernels, thunks) of their own.
    called = () if fields["opcode"] in _CONTROL_FLOW_OPCODES else fields["called"]
    for comp in called:
      if comp in seen or comp not in bodies:
        continue
      seen.add(comp)
      for inner in bodies[comp]:
        names, codes = gather(inner, seen)
        op_names += names
        opcodes += codes
    return op_names, opcodes

  ops = {}
  for name, fields in raw.items():
    op_names, opcodes = gather(name, set())
    ops[name] = HloOp(name=name, opcode=fields["opcode"], computation=fields["computation"],
                      target=fields["target"], fusion_kind=fields["fusion_kind"],
                      op_names=tuple(dict.fromkeys(op_names)),
                      opcodes=tuple(dict.fromkeys(opcodes)), called=tuple(fields["called"]))
  return HloModuleInfo(module_name, ops)


def _split_op_names(rest: str) -> list[str]:
  """op_name metadata; XLA joins the names of merged instructions with ';'."""
  match = _OP_NAME.search(rest)
  if not match:
    return []
  return [part for part in match.group(1).split(";") if part]


def _called(rest: str) -> list[str]:
  names = []
  for match in _CALLS.finditer(rest):
    names += [n.strip().lstrip("%") for n in match.group(1).strip("{}").split(",") if n.strip()]
  return names

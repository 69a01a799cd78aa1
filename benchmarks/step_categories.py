"""Where a training step's device work belongs: the categories of a step profile and the rules
that put a kernel (or an XLA:CPU thunk) into one.

The rules read, in this order: the kernel's name (this project's MoE kernels, NCCL, cuDNN), the
HLO instruction it ran for (custom-call target, opcode: collective, pure dtype cast, GEMM) and
the JAX named scopes in its op names, which the model sets ("attention/core", "moe/router",
"moe/experts", "lm_head", "cross_entropy", "rms_norm", "rope", "embed", "dense_mlp") and the
training step ("aux_losses", "optimizer"). The direction of MoE work comes from the op name
(`transpose(...)`: backward; `rematted_computation`: forward recomputed in the backward pass)
or from the custom call (`*_bwd`, wgrad).
"""

from __future__ import annotations

import dataclasses
import re

from benchmarks.hlo_ops import HloOp

# Table order, as issue 15 lists them. MoE rows are "MoE <direction>: <kind>".
ORDER = ("moe", "attention", "attention_proj", "dense_mlp", "embedding", "lm_head",
         "elementwise", "router", "optimizer", "casts", "collectives", "unattributed")
LABELS = {
    "moe": "MoE",
    "attention": "attention (softmax(QK)V: cuDNN flash / XLA)",
    "attention_proj": "attention projections (q, k, v, o)",
    "dense_mlp": "dense MLP layers",
    "embedding": "embedding lookup",
    "lm_head": "LM head + cross-entropy",
    "elementwise": "norms, RoPE, residual adds, other elementwise",
    "router": "router + aux losses",
    "optimizer": "optimizer update (AdamW, clipping, non-finite guard)",
    "casts": "dtype casts",
    "collectives": "collectives (XLA / NCCL)",
    "unattributed": "unattributed (no HLO op or scope)",
}
MOE_DIRECTIONS = ("forward", "recompute", "backward")

# This project's kernels (ffi/impls, ffi/scheduler, ffi/comm), by kind. First match wins: the
# FP8 quantisers before SwiGLU (SwigluQuantizeKernel is a quantiser).
# The tile engine's dgrad core (ffi/impls/sm90_moe_dgrad.cu): GEMMs with the SwiGLU backward in
# an epilogue, so it counts as GEMM time.
_DGRAD_CORE = "dgrad GEMMs + SwiGLU bwd (tile engine)"
_MOE_KERNEL_KINDS = (
    (r"FusedMoe", "fused dispatch + GEMMs + combine"),
    (r"MoeDgradKernel", _DGRAD_CORE),
    (r"Quantize\w*Kernel", "FP8 quantise"),
    (r"Swiglu(Forward|Backward)Kernel", "SwiGLU"),
    (r"Dispatch(Send|Count|Place)Kernel|ExpertScanKernel", "EP dispatch"),
    (r"Combine(Send|Recv|BwdRecv)Kernel", "EP combine"),
    (r"ReleaseKernel", "EP signal release"),
    (r"Prepare(Bf16Gemm|RowsTimesWeights|Wgrad)|GroupOffsetsKernel|PaddedOffsetsKernel",
     "GEMM set-up (group offsets, pointer arrays)"),
    (r"Zero(PaddingRows|EmptyGroups)Kernel", "zero fill"),
)
_OUR_KERNEL = re.compile("|".join(pattern for pattern, _ in _MOE_KERNEL_KINDS))
# Our custom calls outside the MoE layer, and the category of their work.
_NON_MOE_TARGETS = {"megamoe_cross_entropy_grad": "lm_head", "megamoe_balance_offsets": "router"}
# Inside one of our custom calls, a CUTLASS kernel is a grouped GEMM.
_CUTLASS = re.compile(r"cutlass|GemmUniversal|device_kernel")
_NCCL = re.compile(r"nccl|AllReduce|AllGather|ReduceScatter|SendRecv|AllToAll", re.IGNORECASE)
_CUDNN_ATTENTION = re.compile(r"cudnn|flash|fmha|sdpa", re.IGNORECASE)
_GEMM_KERNEL = re.compile(r"gemm|xmma|cutlass|cublas|matmul|wgmma", re.IGNORECASE)
_CAST_NAME = re.compile(r"^(wrapped_)?convert|convert(_bitcast)?_fusion", re.IGNORECASE)
_TRANSFORM = re.compile(r"^[\w.]*\((.*)\)$")


@dataclasses.dataclass(frozen=True)
class Placement:
  """category: a key of LABELS; kind and direction for MoE work; gemm: a matrix multiply."""

  category: str
  kind: str | None = None
  direction: str | None = None
  gemm: bool = False

  @property
  def label(self) -> str:
    if self.category == "moe":
      return f"MoE {self.direction}: {self.kind}"
    return LABELS[self.category]


def scopes(op_name: str) -> tuple[list[str], str]:
  """(scope names, direction) of a JAX op name such as
  "jit(train_step)/transpose(jvp(jvp()))/checkpoint/attention/core/dot_general": transform
  wrappers unwrapped ("jvp(moe)" -> "moe"), direction "backward" under transpose(...),
  "recompute" in a rematerialised computation, else "forward"."""
  names, direction = [], "forward"
  for part in op_name.split("/"):
    if part.startswith("transpose("):
      direction = "backward"
    while (match := _TRANSFORM.match(part)) is not None:
      part = match.group(1)
    if part == "rematted_computation" and direction == "forward":
      direction = "recompute"
    if part:
      names.append(part)
  if "rematted_computation" in names:
    direction = "recompute"
  return names, direction


def _scope_category(names: list[str], op: HloOp | None) -> str | None:
  """The category the innermost meaningful named scope says, None if none does."""
  found = set(names)
  if "optimizer" in found:
    return "optimizer"
  if "router" in found or "aux_losses" in found:
    return "router"
  if "experts" in found:
    return "moe"
  if "lm_head" in found or "cross_entropy" in found:
    return "lm_head"
  if "qkv_proj" in found or "out_proj" in found:
    return "attention_proj"
  if "rms_norm" in found or "rope" in found:
    return "elementwise"
  if "core" in found and "attention" in found:
    return "attention"
  if "dense_mlp" in found:
    return "dense_mlp"
  if "embed" in found:
    return "embedding"
  if "attention" in found or "moe" in found:
    return "elementwise"  # reshapes and casts between the scoped parts
  return None


def _vote(op_names: list[str], op: HloOp | None) -> tuple[str | None, str]:
  """Most common scope category among a fused instruction's op names (ties: the first)."""
  votes: dict[str | None, list[str]] = {}
  for name in op_names:
    names, direction = scopes(name)
    votes.setdefault(_scope_category(names, op), []).append(direction)
  scoped = {k: v for k, v in votes.items() if k is not None}
  if not scoped:
    return None, _direction(votes.get(None, []))
  best = max(scoped, key=lambda k: len(scoped[k]))  # dicts keep order: ties go to the first
  return best, _direction(scoped[best])


def _direction(directions: list[str]) -> str:
  for d in ("backward", "recompute"):
    if d in directions:
      return d
  return "forward"


def _moe_xla_kind(op: HloOp | None, name: str) -> str:
  if op is None:
    return "XLA GEMMs" if _GEMM_KERNEL.search(name) else "XLA ops"
  if op.is_gemm:
    return "XLA GEMMs (ragged_dot)"
  if "sort" in op.opcodes:
    return "XLA sort (token layout)"
  if {"gather", "scatter", "dynamic-update-slice"} & set(op.opcodes):
    return "XLA gather/scatter (token layout)"
  return "XLA elementwise (routing weights, top-k sum)"


def place(kernel: str, op: HloOp | None, scope: str | None = None) -> Placement:
  """The category of one kernel or thunk.

  kernel: the event's name (GPU kernel or XLA:CPU thunk); op: its HLO instruction, when the
  compiled HLO is known; scope: the op-name path from XLA's kernel annotation, when present.
  """
  target = op.target if op is not None else None
  op_names = list(op.op_names) if op is not None and op.op_names else ([scope] if scope else [])
  gemm = op.is_gemm if op is not None else bool(_GEMM_KERNEL.search(kernel))
  if target in _NON_MOE_TARGETS:
    return Placement(_NON_MOE_TARGETS[target])
  ours = bool(_OUR_KERNEL.search(kernel)) or bool(target and target.startswith("megamoe_"))

  if not ours and ((op is not None and op.is_collective) or (op is None and _NCCL.search(kernel))):
    return Placement("collectives")
  if ours:
    kind = next((k for pattern, k in _MOE_KERNEL_KINDS if re.search(pattern, kernel)), None)
    if kind is None and _CUTLASS.search(kernel):
      kind, gemm = "grouped GEMM (CUTLASS)", True
    gemm = gemm or kind == _DGRAD_CORE
    if kind is None:
      kind = f"custom call {target}" if target else "other MoE kernel"
      gemm = gemm or bool(target and re.search(r"gemm|mlp|wgrad", target))
    direction = ("backward" if target and re.search(r"_bwd|wgrad", target)
                 else _vote(op_names, op)[1])
    return Placement("moe", kind, direction, gemm)
  if (op is not None and op.is_cast) or (op is None and _CAST_NAME.search(kernel)):
    return Placement("casts")
  category, direction = _vote(op_names, op)
  if category == "moe":
    return Placement("moe", _moe_xla_kind(op, kernel), direction, gemm)
  if category is not None:
    return Placement(category, gemm=gemm)
  if _CUDNN_ATTENTION.search(kernel):
    return Placement("attention", gemm=False)
  if op is not None:  # an XLA op outside every scope: residual adds, copies, broadcasts
    return Placement("elementwise", gemm=gemm)
  return Placement("unattributed", gemm=gemm)

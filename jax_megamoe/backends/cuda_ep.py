"""The NVLink exchange of backend "cuda": dispatch -> the expert MLP it is given -> combine.

Per device (inside `jax.shard_map` over the mesh), with R ranks along the expert axis, T tokens
per device, E experts (E / R per rank):

  dispatch(x, topk_ids, topk_weights)
      each token travels once to every rank that holds one of its experts (CUDA kernels write
      straight into the peers' symmetric workspace, jax_megamoe.symmetric); the receiver sorts
      what it got by local expert -> x_sorted [n_cap, H] (groups in (expert, source rank, token)
      order, rows past the total zero), group_sizes [E/R], slot_pos [R*T, k] (row of x_sorted of
      received slot (source s, token t, slot j), -1 not here, -2 dropped), recv_w [R*T, k]
  mlp(x_sorted, group_sizes, w_gate_up_local, w_down_local) -> y_sorted   (a parameter)
  combine(y_sorted, ...)
      the expert rank sums each token's local slots weighted by the routing weights (fp32, slot
      order), sends the partial back in x's dtype; the source adds its ranks' partials in rank
      order -> y [T, H]. Deterministic: bitwise identical run to run.

Backward: dispatch's VJP is combine-shaped (dx rows summed over slots, sent back, d_recv_w
returned to the source as d topk_weights); combine's VJP is dispatch-shaped (d_out travels to the
expert ranks, which form dy_sorted = w * d_out and d_recv_w = <d_out, y_sorted>).

Capacity: x_sorted has n_cap rows. By default n_cap = R * T * min(k, E/R), the most any routing can
send to one rank (dropless, but a large buffer); `capacity_factor` c sets n_cap = ceil(c * T * k)
(rounded up to 128 rows, at most the dropless size). More rows than n_cap is detected on the
device (`stats`) and raised as an error by a host callback when `check_capacity` (default: on
whenever overflow is possible); the surplus slots are dropped, never written out of bounds.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_megamoe import _ffi, parallel, symmetric
from jax_megamoe.backends import cuda_fp8
from jax_megamoe.validation import LayerShape, check_layer_args

_SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
MAX_TOP_K = 32  # a token's slots are handled by one warp (ffi/impls/ep_send.cuh)


@dataclasses.dataclass(frozen=True)
class EpConfig:
  """Static configuration of one EP op (hashable: a nondiff argument of the custom VJPs).

  stacked: the workspace is a virtual group (jax_megamoe.virtual_ranks): one call runs all R
  ranks on one GPU, every operand with a leading axis of one entry per rank."""
  workspace_id: int
  num_ranks: int
  num_experts: int
  stacked: bool = False

  @property
  def experts_per_rank(self) -> int:
    return self.num_experts // self.num_ranks

  @property
  def lead(self) -> tuple[int, ...]:
    """The leading axes of every operand: (R,) on a virtual group, () on a GPU."""
    return (self.num_ranks,) if self.stacked else ()

  def per_rank(self, fn: Callable, *args):
    """fn applied to each rank's slice of `args` (stacked), or to `args` as they are."""
    if not self.stacked:
      return fn(*args)
    # Operands may be pytrees (cuda_fp8.QuantizedRows): slice every leaf, not the tuple.
    outs = [fn(*jax.tree.map(lambda a: a[r], args)) for r in range(self.num_ranks)]
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *outs)

  def attrs(self) -> dict[str, Any]:
    return dict(workspace_id=np.int64(self.workspace_id), num_experts=np.int64(self.num_experts))


# slot_pos entries that are not pool rows (ffi/layout/ep_layout.h: kSlotNotRouted, kSlotDropped):
# the slot's expert is another rank's (or the slot is masked), or it is this rank's but the slot
# was dropped (capacity, or a repeated expert of its token). The combine kernels tell them
# apart: a rank sends a token's partial when any of its slots is not SLOT_NOT_ROUTED.
SLOT_NOT_ROUTED = -1
SLOT_DROPPED = -2


class Dispatched(NamedTuple):
  x_sorted: jax.Array     # [n_cap, H]
  group_sizes: jax.Array  # [E/R] int32
  slot_pos: jax.Array     # [R*T, k] int32: pool row, SLOT_NOT_ROUTED or SLOT_DROPPED
  recv_w: jax.Array       # [R*T, k] float32
  stats: jax.Array        # [4] int32: rows needed, n_cap, overflow, repeated expert ids


def dropless_capacity(num_ranks: int, tokens: int, top_k: int, experts_per_rank: int) -> int:
  """Rows one rank can receive at most: every token of every rank sends all its slots here."""
  return num_ranks * tokens * min(top_k, experts_per_rank)


def capacity_rows(num_ranks: int, tokens: int, top_k: int, experts_per_rank: int,
                  capacity_factor: float | None) -> int:
  """Rows of x_sorted on each rank (see the module doc)."""
  worst = dropless_capacity(num_ranks, tokens, top_k, experts_per_rank)
  if capacity_factor is None:
    return worst
  if capacity_factor <= 0:
    raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
  rows = math.ceil(capacity_factor * tokens * top_k)
  rows = (rows + 127) // 128 * 128
  return max(1, min(rows, worst))


def _scratch_ints(num_rows: int, experts_per_rank: int) -> int:
  return ((num_rows + 31) // 32) * experts_per_rank + experts_per_rank


# --- raw FFI calls (per device) ---------------------------------------------------------------


def _dispatch_call(x, ids, w, cfg: EpConfig, n_cap: int) -> Dispatched:
  tokens, hidden = x.shape[-2:]
  k = ids.shape[-1]
  rows = cfg.num_ranks * tokens
  epr = cfg.experts_per_rank
  lead = cfg.lead
  out_types = (
      jax.ShapeDtypeStruct((*lead, n_cap, hidden), x.dtype),
      jax.ShapeDtypeStruct((*lead, epr), jnp.int32),
      jax.ShapeDtypeStruct((*lead, rows, k), jnp.int32),
      jax.ShapeDtypeStruct((*lead, rows, k), jnp.float32),
      jax.ShapeDtypeStruct((*lead, 4), jnp.int32),
      jax.ShapeDtypeStruct((*lead, _scratch_ints(rows, epr)), jnp.int32),
  )
  outs = jax.ffi.ffi_call("megamoe_ep_dispatch_fwd", out_types)(x, ids, w, **cfg.attrs())
  return Dispatched(*outs[:5])


def _dispatch_bwd_call(dx_sorted, d_recv_w, slot_pos, ids, cfg: EpConfig):
  tokens, k = ids.shape[-2:]
  out_types = (jax.ShapeDtypeStruct((*cfg.lead, tokens, dx_sorted.shape[-1]), dx_sorted.dtype),
               jax.ShapeDtypeStruct((*cfg.lead, tokens, k), jnp.float32))
  return jax.ffi.ffi_call("megamoe_ep_dispatch_bwd", out_types)(
      dx_sorted, d_recv_w, slot_pos, ids, **cfg.attrs())


def _combine_call(y_sorted, slot_pos, recv_w, ids, cfg: EpConfig):
  out_type = jax.ShapeDtypeStruct((*cfg.lead, ids.shape[-2], y_sorted.shape[-1]),
                                  y_sorted.dtype)
  return jax.ffi.ffi_call("megamoe_ep_combine_fwd", out_type)(
      y_sorted, slot_pos, recv_w, ids, **cfg.attrs())


def _combine_bwd_call(d_out, y_sorted, slot_pos, recv_w, ids, group_sizes, cfg: EpConfig):
  out_types = (jax.ShapeDtypeStruct(y_sorted.shape, y_sorted.dtype),
               jax.ShapeDtypeStruct(recv_w.shape, jnp.float32))
  return jax.ffi.ffi_call("megamoe_ep_combine_bwd", out_types)(
      d_out, y_sorted, slot_pos, recv_w, ids, group_sizes, **cfg.attrs())


def dispatch_rows(x, ids, w, cfg: EpConfig, n_cap: int) -> Dispatched:
  """Dispatch on the kernels, not differentiated (per device): the rows, their layout and the
  received weights (a backward that needs them again)."""
  return _dispatch_call(x, ids, w, cfg, n_cap)


def combine_backward(d_out, y_sorted, slot_pos, recv_w, ids, group_sizes, cfg: EpConfig):
  """Combine's VJP on the kernels (per device): (dy_sorted = w * d_out by slot, d recv_w =
  <d_out, y_sorted> by slot), for rows laid out as dispatch lays them out (slot_pos)."""
  return _combine_bwd_call(d_out.astype(y_sorted.dtype), y_sorted, slot_pos, recv_w, ids,
                           group_sizes, cfg)


def dispatch_backward(dx_sorted, d_recv_w, slot_pos, ids, cfg: EpConfig):
  """Dispatch's VJP on the kernels (per device): (dx summed over each token's slots, d topk
  weights)."""
  return _dispatch_bwd_call(dx_sorted, d_recv_w.astype(jnp.float32), slot_pos, ids, cfg)


# --- differentiable per-device ops ------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _dispatch(x, ids, w, cfg, n_cap):
  return _dispatch_call(x, ids, w, cfg, n_cap)


def _dispatch_fwd(x, ids, w, cfg, n_cap):
  out = _dispatch_call(x, ids, w, cfg, n_cap)
  return out, (out.slot_pos, ids)


def _dispatch_bwd(cfg, n_cap, res, cts):
  slot_pos, ids = res
  dx_sorted, _, _, d_recv_w, _ = cts
  dx, dw = dispatch_backward(dx_sorted, d_recv_w, slot_pos, ids, cfg)
  return dx, None, dw


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _combine(y_sorted, slot_pos, recv_w, ids, group_sizes, cfg):
  return _combine_call(y_sorted, slot_pos, recv_w, ids, cfg)


def _combine_fwd(y_sorted, slot_pos, recv_w, ids, group_sizes, cfg):
  out = _combine_call(y_sorted, slot_pos, recv_w, ids, cfg)
  return out, (y_sorted, slot_pos, recv_w, ids, group_sizes)


def _combine_bwd(cfg, res, d_out):
  y_sorted, slot_pos, recv_w, ids, group_sizes = res
  dy_sorted, d_recv_w = combine_backward(d_out, y_sorted, slot_pos, recv_w, ids, group_sizes,
                                         cfg)
  return dy_sorted, None, d_recv_w, None, None


_combine.defvjp(_combine_fwd, _combine_bwd)


# --- recipe "fp8": rows travel in FP8 ---------------------------------------------------------
#
# The sender quantises its T token rows (1x128 blocks along H: a token's blocks are the same
# whichever expert it goes to) and dispatch moves e4m3 values + fp32 scales packed into one row
# (H + H/32 bytes instead of 2H); the receiver's grouped L1 GEMM reads them as they arrived.
# Backward: the FP8 MLP backward (cuda_fp8.mlp_backward; dW_gate_up's x operand from the
# dequantised rows, as x reaches the expert rank only as FP8 rows, read where dispatch put them
# and never stored in bf16), then the bf16 dispatch backward for dx.


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _dispatch_mlp_fp8(x, ids, w, w_gate_up, w_down, blocks, cfg, n_cap, mlp):
  return _dispatch_mlp_fp8_fwd(x, ids, w, w_gate_up, w_down, blocks, cfg, n_cap, mlp)[0]


def _dispatch_mlp_fp8_fwd(x, ids, w, w_gate_up, w_down, blocks, cfg, n_cap, mlp):
  """-> (y_sorted, group_sizes, slot_pos, recv_w, stats), residuals. mlp: a cuda_fp8.RowsMlp;
  blocks: its quantize_weights of w_gate_up / w_down (which take the weights' gradients)."""
  del w_gate_up, w_down  # their values are in blocks
  hidden_size = x.shape[-1]
  quantize = lambda x: cuda_fp8.pack_rows(cuda_fp8.quantize_rows(x, pow2=mlp.pow2))
  d = _dispatch_call(cfg.per_rank(quantize, x), ids, w, cfg, n_cap)
  x_rows = cfg.per_rank(lambda rows: cuda_fp8.unpack_rows(rows, hidden_size), d.x_sorted)
  y, mlp_res = cfg.per_rank(mlp.forward, x_rows, d.group_sizes, blocks)
  out = (y, d.group_sizes, d.slot_pos, d.recv_w, d.stats)
  return out, (x_rows, d.group_sizes, d.slot_pos, ids, mlp_res)


def _dispatch_mlp_fp8_bwd(cfg, n_cap, mlp, res, cts):
  del n_cap
  x_rows, group_sizes, slot_pos, ids, mlp_res = res
  dy_sorted, _, _, d_recv_w, _ = cts
  # dW_gate_up's operand straight from the FP8 rows as they arrived (dequantised as it reads).
  dx_sorted, dw_gate_up, dw_down = cfg.per_rank(mlp.backward, dy_sorted, x_rows, group_sizes,
                                                mlp_res)
  dx, dw = dispatch_backward(dx_sorted, d_recv_w, slot_pos, ids, cfg)
  return dx, None, dw, dw_gate_up, dw_down, cuda_fp8.zero_cotangent(mlp_res.blocks)


_dispatch_mlp_fp8.defvjp(_dispatch_mlp_fp8_fwd, _dispatch_mlp_fp8_bwd)


def _check_inputs(x, topk_ids, topk_weights, lead=()):
  if x.ndim != 2 + len(lead) or x.shape[:len(lead)] != lead:
    raise ValueError(f"x must be [{'ranks, ' if lead else ''}tokens, hidden], got shape "
                     f"{x.shape}")
  if x.dtype not in _SUPPORTED_DTYPES:
    raise TypeError(f"x dtype must be float32, bfloat16 or float16 for the EP kernels, got "
                    f"{x.dtype}")
  if topk_ids.shape != topk_weights.shape or topk_ids.shape[:-1] != x.shape[:-1]:
    raise ValueError(f"topk_ids {topk_ids.shape} and topk_weights {topk_weights.shape} must both "
                     f"be [{'ranks, ' if lead else ''}tokens={x.shape[-2]}, top_k]")
  if topk_ids.shape[-1] > MAX_TOP_K:
    raise ValueError(f"top_k must be <= {MAX_TOP_K} for the EP kernels, got {topk_ids.shape[-1]}")


def dispatch(x, topk_ids, topk_weights, *, workspace: symmetric.SymmetricWorkspace,
             num_experts: int, n_cap: int | None = None) -> Dispatched:
  """Per-device dispatch (call inside shard_map over the workspace's mesh); differentiable in x
  and topk_weights."""
  cfg = _config(workspace, num_experts, x, topk_ids)
  _check_inputs(x, topk_ids, topk_weights, cfg.lead)
  if n_cap is None:
    n_cap = dropless_capacity(cfg.num_ranks, x.shape[-2], topk_ids.shape[-1],
                              cfg.experts_per_rank)
  return _dispatch(x, topk_ids.astype(jnp.int32), topk_weights.astype(jnp.float32), cfg, n_cap)


def combine(y_sorted, dispatched: Dispatched, topk_ids, *, workspace: symmetric.SymmetricWorkspace,
            num_experts: int):
  """Per-device combine of the expert outputs (rows of y_sorted as laid out by `dispatch`)."""
  cfg = EpConfig(workspace.id, workspace.num_ranks, num_experts, workspace.virtual)
  return _combine(y_sorted, dispatched.slot_pos, dispatched.recv_w, topk_ids.astype(jnp.int32),
                  dispatched.group_sizes, cfg)


def _config(workspace, num_experts, x, topk_ids) -> EpConfig:
  tokens, hidden = x.shape[-2:]
  elem = jnp.dtype(x.dtype).itemsize
  if num_experts % workspace.num_ranks:
    raise ValueError(f"num_experts={num_experts} must divide evenly over the "
                     f"{workspace.num_ranks} ranks of the expert axis")
  if not workspace.fits(num_ranks=workspace.num_ranks, max_tokens=tokens, hidden=hidden,
                        top_k=topk_ids.shape[-1], elem_bytes=elem):
    raise ValueError(
        f"the symmetric workspace {workspace.id} (max_tokens={workspace.max_tokens}, hidden="
        f"{workspace.hidden}, top_k={workspace.top_k}, {workspace.elem_bytes}-byte elements"
        f"{', closed' if workspace.closed else ''}) cannot hold {tokens} tokens x {hidden} of "
        f"{x.dtype} with top_k={topk_ids.shape[-1]} per rank")
  return EpConfig(workspace.id, workspace.num_ranks, num_experts, workspace.virtual)


def raise_on_bad_stats(stats):
  """Raises RuntimeError for what dispatch's `stats` report (capacity overflow, repeated ids)."""
  stats = np.asarray(stats).reshape(-1, 4)
  for rank, (needed, cap, overflow, repeated) in enumerate(stats):
    if overflow:
      raise RuntimeError(
          f"jax_megamoe EP dispatch overflow: a rank received {int(needed)} (token, expert) rows "
          f"but its capacity is {int(cap)} rows; the surplus was dropped. Raise capacity_factor "
          f"(None = dropless).")
    if repeated:
      raise RuntimeError(
          f"jax_megamoe EP dispatch: {int(repeated)} slots repeat an expert id already chosen by "
          f"the same token; top-k expert ids must be distinct per token")


@dataclasses.dataclass(frozen=True)
class LayerPlan:
  """How one EP layer runs: receive capacity, whether overflow is checked, the row format."""
  n_cap: int            # rows of x_sorted per rank
  check_capacity: bool  # raise on overflow (a host callback on dispatch's stats)
  fp8_rows: bool        # rows travel in FP8 (the MLP is a cuda_fp8.RowsMlp)

  @classmethod
  def of(cls, shape: LayerShape, mlp, capacity_factor: float | None = None,
         check_capacity: bool | None = None, fp8_dispatch: bool | None = None) -> "LayerPlan":
    """capacity_factor / check_capacity / fp8_dispatch as in expert_parallel_moe."""
    fp8_reason = fp8_rows_reason(mlp, shape)
    if fp8_dispatch and fp8_reason:
      raise ValueError(f"fp8_dispatch=True cannot be served: {fp8_reason}")
    tokens, top_k, epr = shape.tokens_per_device, shape.top_k, shape.experts_per_rank
    n_cap = capacity_rows(shape.ep_size, tokens, top_k, epr, capacity_factor)
    if check_capacity is None:
      check_capacity = n_cap < dropless_capacity(shape.ep_size, tokens, top_k, epr)
    fp8_rows = fp8_reason is None if fp8_dispatch is None else bool(fp8_dispatch)
    return cls(n_cap, bool(check_capacity), fp8_rows)


def layer_on_local_ranks(x, ids, w, w_gate_up, w_down,
                         blocks: cuda_fp8.ExpertWeightBlocks | None = None, *, workspace,
                         num_experts: int, mlp: Callable, plan: LayerPlan):
  """dispatch -> mlp -> combine for this device's local ranks of `workspace`: one rank inside
  shard_map (x [T, H], ids / w [T, k], its experts' weights), or all R ranks of a virtual group
  (every operand with a leading rank axis). The kernels are the same either way. `blocks` may
  give the weights as already quantised (mlp.quantize_weights of w_gate_up and w_down, stacked
  like them: jax_megamoe.weight_blocks), so that they are not quantised again."""
  cfg = _config(workspace, num_experts, x, ids)
  _check_inputs(x, ids, w, cfg.lead)
  if plan.fp8_rows:
    # The weight blocks outside the VJP, named for remat policies (cuda_fp8 module doc).
    if blocks is None:
      blocks = cfg.per_rank(mlp.quantize_weights, w_gate_up, w_down)
    y_sorted, group_sizes, slot_pos, recv_w, stats = _dispatch_mlp_fp8(
        x, ids, w, w_gate_up, w_down, blocks, cfg, plan.n_cap, mlp)
    d = Dispatched(None, group_sizes, slot_pos, recv_w, stats)
  else:
    d = _dispatch(x, ids, w, cfg, plan.n_cap)
    if blocks is None:
      y_sorted = cfg.per_rank(mlp, d.x_sorted, d.group_sizes, w_gate_up, w_down)
    else:  # bf16 rows (fp8_dispatch=False) into the FP8 MLP
      y_sorted = cfg.per_rank(lambda *a: mlp(*a[:4], blocks=a[4]), d.x_sorted, d.group_sizes,
                              w_gate_up, w_down, blocks)
  if plan.check_capacity:
    jax.debug.callback(raise_on_bad_stats, d.stats)
  return _combine(y_sorted.astype(x.dtype), d.slot_pos, d.recv_w, ids, d.group_sizes, cfg)


def unavailable_reason(mesh, expert_axis: str = "expert", shape: LayerShape | None = None
                       ) -> str | None:
  """Why the NVLink kernels cannot serve this mesh (and layer, when `shape` is given): None when
  they can; else backends.cuda uses the collective exchange of jax_megamoe.parallel."""
  reason = _ffi.cuda_unavailable_reason()
  if reason is not None:
    return reason
  if not _ffi.has_target("megamoe_ep_dispatch_fwd", "CUDA"):
    return "the extension has no EP dispatch/combine kernels"
  if expert_axis not in mesh.axis_names:
    return f"expert_axis {expert_axis!r} is not an axis of the mesh {mesh.axis_names}"
  groups = symmetric.ep_groups(mesh, expert_axis)
  if groups.shape[1] > symmetric.MAX_RANKS:
    return (f"an EP group of {groups.shape[1]} GPUs is larger than one NVLink domain "
            f"({symmetric.MAX_RANKS})")
  if any(d.platform != "gpu" for d in groups.reshape(-1)):
    return "the mesh has non-GPU devices"
  if shape is not None and shape.top_k > MAX_TOP_K:
    return f"top_k={shape.top_k} > {MAX_TOP_K}, the most the EP kernels take"
  return None


def fp8_rows_reason(mlp, shape: LayerShape) -> str | None:
  """Why the token rows cannot travel in FP8 for this MLP and layer (None when they can)."""
  if not isinstance(mlp, cuda_fp8.RowsMlp):
    return "the expert MLP is not the blockwise-FP8 CUDA MLP (cuda_fp8.RowsMlp)"
  if shape.dtype != jnp.bfloat16:
    return f"x is {shape.dtype}, the FP8 kernels take bfloat16"
  if shape.hidden % cuda_fp8.BLOCK or shape.ffn % cuda_fp8.BLOCK:
    return f"H={shape.hidden} and F={shape.ffn} must be multiples of {cuda_fp8.BLOCK}"
  return None


def expert_parallel_moe(x, topk_ids, topk_weights, w_gate_up, w_down, *, mesh,
                        expert_axis: str = "expert", mlp: Callable,
                        shape: LayerShape | None = None,
                        workspace: symmetric.SymmetricWorkspace | None = None,
                        capacity_factor: float | None = None,
                        check_capacity: bool | None = None,
                        fp8_dispatch: bool | None = None, weight_blocks=None):
  """The whole EP MoE layer over `mesh` with the NVLink exchange around `mlp`:
  y [T_total, H] (contract: jax_megamoe.moe).

  mlp: the expert MLP (parallel.GroupedMlp: (x_sorted, group_sizes, w_gate_up, w_down) ->
    y_sorted, recipe bound). A cuda_fp8.RowsMlp lets the rows travel in FP8.
  shape: the validated sizes (jax_megamoe.validation); None validates the arguments here.
  workspace: the symmetric workspace; None creates (and caches) one at trace time.
  capacity_factor, check_capacity: see the module doc.
  fp8_dispatch: rows travel in FP8 (quantised once on the sender); None = whenever `mlp`
    allows it, True = required (ValueError naming why not), False = bf16 rows.
  weight_blocks: the weights already quantised for an FP8 `mlp` (jax_megamoe.weight_blocks).
  """
  if shape is None:
    shape = check_layer_args(x, topk_ids, topk_weights, w_gate_up, w_down, mesh, expert_axis)
  _check_inputs(x, topk_ids, topk_weights)
  plan = LayerPlan.of(shape, mlp, capacity_factor, check_capacity, fp8_dispatch)
  tokens = shape.tokens_per_device
  if workspace is None:
    workspace = symmetric.workspace_for(mesh, expert_axis, max_tokens=tokens,
                                        hidden=shape.hidden, top_k=shape.top_k,
                                        dtype=shape.dtype)
  mesh_ids = tuple(int(d.id) for d in symmetric.ep_groups(mesh, expert_axis).reshape(-1))
  if workspace.device_ids and workspace.device_ids != mesh_ids:
    raise ValueError(f"the symmetric workspace {workspace.id} was created for devices "
                     f"{workspace.device_ids} (EP groups in rank order), but this mesh's EP "
                     f"groups are {mesh_ids}: create the workspace from this mesh and expert_axis")
  per_device = functools.partial(layer_on_local_ranks, workspace=workspace,
                                 num_experts=shape.num_experts, mlp=mlp, plan=plan)
  args = (x, topk_ids.astype(jnp.int32), topk_weights.astype(jnp.float32), w_gate_up, w_down)
  if weight_blocks is not None:
    args += (weight_blocks,)
  return parallel.shard_over_mesh(per_device, mesh, expert_axis, args, check_vma=False)

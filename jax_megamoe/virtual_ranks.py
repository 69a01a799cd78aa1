"""Expert parallelism at any rank count on one GPU: virtual ranks, for testing every EP kernel.

A virtual group is R symmetric workspaces on one GPU, each rank's peer bases pointing at the
others' workspaces (ffi/comm/workspace_registry.cu). One EP custom call then runs all R ranks
on rank-stacked operands ([R, T, H], [R, T, k], ...), with the kernels of the real path: the
launchers issue them stage by stage, every rank's kernel of a stage before any rank's next
stage, so each wait on another rank is satisfied by a kernel that ran before it
(ffi/impls/ep_dispatch_combine.h). Bugs that only show at R = 3..8 (rank arithmetic, offsets,
signal counts, pool sizes, the order of the rank reduction) then show on one GPU.

  ws = virtual_ranks.create_workspace(R, max_tokens=T, hidden=H, top_k=k, dtype=jnp.bfloat16)
  y = virtual_ranks.expert_parallel_moe(x, ids, weights, w_gate_up, w_down, workspace=ws,
                                        mlp=reference.grouped_mlp)   # y [R, T, H]
  virtual_ranks.set_absent_rank(ws, q)   # rank q's kernels never launch: the others time out
  ws.close()

The layer is the EP layer of R GPUs with rank r holding tokens x[r] and experts
[r * E / R, (r + 1) * E / R): the same function as jax_megamoe.moe over x.reshape(R * T, H).
It is differentiable (the dispatch/combine VJPs run on the virtual group too).
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_megamoe import symmetric
from jax_megamoe.backends import cuda_ep, fused
from jax_megamoe.validation import check_layer_args


def _virtual_library() -> ctypes.CDLL:
  lib = symmetric._library()
  i64, i32, p = ctypes.c_int64, ctypes.c_int, ctypes.c_char_p
  if not hasattr(lib, "megamoe_ep_ws_new_virtual"):
    raise RuntimeError("jax_megamoe: this extension has no virtual-rank workspaces (rebuild it)")
  lib.megamoe_ep_ws_new_virtual.argtypes = [i64, i64, i64, i64, i64, i64, i32, ctypes.c_double,
                                            i32, ctypes.POINTER(i64), p, i32]
  lib.megamoe_ep_ws_set_absent.argtypes = [i64, i32, p, i32]
  return lib


def create_workspace(num_ranks: int, *, max_tokens: int, hidden: int, top_k: int,
                     dtype: Any = "bfloat16", device: jax.Device | None = None,
                     comm_blocks: int | None = None, timeout_s: float | None = None,
                     fused_rows: int = 0) -> symmetric.SymmetricWorkspace:
  """A virtual group of `num_ranks` (1..8) ranks on one GPU (default: the first). Sizes as in
  symmetric.create_workspace; memory on that GPU: num_ranks times one rank's workspace."""
  if isinstance(num_ranks, bool) or not isinstance(num_ranks, (int, np.integer)):
    raise ValueError(f"num_ranks must be an int in [1, {symmetric.MAX_RANKS}], got {num_ranks!r}")
  elem_bytes = int(np.dtype(dtype).itemsize)
  one_rank = symmetric.workspace_bytes(int(num_ranks), max_tokens, hidden, top_k, elem_bytes,
                                       fused_rows)  # validates the sizes
  comm_blocks, timeout_s = symmetric.send_settings(comm_blocks, timeout_s,
                                                   "virtual_ranks.create_workspace")
  if device is None:
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
      raise ValueError("virtual ranks need a GPU; JAX sees none")
    device = gpus[0]
  if device.platform != "gpu":
    raise ValueError(f"device must be a GPU, got {device}")
  ws_id = ctypes.c_int64(0)
  symmetric._call(_virtual_library().megamoe_ep_ws_new_virtual, int(num_ranks), max_tokens,
                  hidden, top_k, elem_bytes, fused_rows, comm_blocks, timeout_s,
                  symmetric._ordinal(device), ctypes.byref(ws_id))
  return symmetric.SymmetricWorkspace(
      id=ws_id.value, num_ranks=int(num_ranks), max_tokens=max_tokens, hidden=hidden,
      top_k=top_k, elem_bytes=elem_bytes, comm_blocks=comm_blocks, timeout_s=timeout_s,
      device_ids=(), expert_axis="", multiprocess=False, virtual=True, fused_rows=fused_rows,
      bytes_per_device=int(num_ranks) * one_rank)


def set_absent_rank(workspace: symmetric.SymmetricWorkspace, rank: int | None) -> None:
  """From the next call on, rank `rank`'s kernels are not launched (None: every rank runs), as
  if its GPU had died: the others' waits on it time out and report (tests of the timeout path).
  Takes effect when a call is launched (a compiled program replayed later sees the setting of
  its own launch)."""
  if not workspace.virtual:
    raise ValueError(f"workspace {workspace.id} is not a virtual group")
  rank = -1 if rank is None else int(rank)
  if not -1 <= rank < workspace.num_ranks:
    raise ValueError(f"rank must be None or in [0, {workspace.num_ranks}), got {rank}")
  symmetric._call(_virtual_library().megamoe_ep_ws_set_absent, workspace.id, rank)


def _virtual_layer_args(x, topk_ids, topk_weights, w_gate_up, w_down, workspace, mlp,
                        capacity_factor, check_capacity, fp8_dispatch):
  """Validates a virtual group's layer: (shape, plan, per-rank w_gate_up, per-rank w_down)."""
  if not workspace.virtual:
    raise ValueError(f"workspace {workspace.id} is not a virtual group "
                     "(virtual_ranks.create_workspace)")
  num_ranks = workspace.num_ranks
  if x.ndim != 3 or x.shape[0] != num_ranks:
    raise ValueError(f"x must be [ranks={num_ranks}, tokens, hidden], got shape {x.shape}")
  _, tokens, _ = x.shape
  flat = lambda a: a.reshape(num_ranks * tokens, *a.shape[2:])
  if topk_ids.shape[:2] != (num_ranks, tokens) or topk_weights.shape != topk_ids.shape:
    raise ValueError(f"topk_ids {topk_ids.shape} and topk_weights {topk_weights.shape} must "
                     f"both be [ranks={num_ranks}, tokens={tokens}, k]")
  shape = check_layer_args(flat(x), flat(topk_ids), flat(topk_weights), w_gate_up, w_down)
  if shape.num_experts % num_ranks:
    raise ValueError(f"the number of experts {shape.num_experts} must divide evenly over the "
                     f"{num_ranks} virtual ranks")
  shape = dataclasses.replace(shape, ep_size=num_ranks, num_devices=num_ranks)
  plan = cuda_ep.LayerPlan.of(shape, mlp, capacity_factor, check_capacity, fp8_dispatch)
  epr = shape.experts_per_rank
  w_gu = w_gate_up.reshape(num_ranks, epr, *w_gate_up.shape[1:])
  w_dn = w_down.reshape(num_ranks, epr, *w_down.shape[1:])
  return shape, plan, w_gu, w_dn


def expert_parallel_moe(x, topk_ids, topk_weights, w_gate_up, w_down, *,
                        workspace: symmetric.SymmetricWorkspace, mlp: Callable,
                        capacity_factor: float | None = None,
                        check_capacity: bool | None = None,
                        fp8_dispatch: bool | None = None) -> jax.Array:
  """The EP layer of the virtual group `workspace` (R ranks) on the separate EP kernels:
  x [R, T, H] (rank r's tokens), topk_ids / topk_weights [R, T, k] (global expert ids),
  w_gate_up [E, H, 2F] and w_down [E, F, H] (all experts; rank r holds E / R of them)
  -> y [R, T, H]. mlp, capacity_factor, check_capacity and fp8_dispatch as in
  backends.cuda_ep.expert_parallel_moe."""
  shape, plan, w_gu, w_dn = _virtual_layer_args(x, topk_ids, topk_weights, w_gate_up, w_down,
                                                workspace, mlp, capacity_factor,
                                                check_capacity, fp8_dispatch)
  return cuda_ep.layer_on_local_ranks(
      x, topk_ids.astype(jnp.int32), topk_weights.astype(jnp.float32), w_gu, w_dn,
      workspace=workspace, num_experts=shape.num_experts, mlp=mlp, plan=plan)


def fused_moe(x, topk_ids, topk_weights, w_gate_up, w_down, *,
              workspace: symmetric.SymmetricWorkspace, capacity_factor: float | None = None,
              check_capacity: bool | None = None, max_ctas: int = 0,
              recipe: str | None = None) -> jax.Array:
  """The same layer on the fused kernel (backend "fused"; one launch runs all R ranks, its CTAs
  split into R groups): arguments as in expert_parallel_moe, bf16 (recipe None, "fp8" or
  "fp8_pow2"); the workspace needs fused regions (create_workspace(..., fused_rows=n_cap)).
  Differentiable (backward on the separate kernels, as backend "fused" does)."""
  if recipe is not None and recipe not in fused.FP8_RECIPES:
    raise ValueError(f"recipe must be None or one of {fused.FP8_RECIPES}, got {recipe!r}")
  shape, plan, w_gu, w_dn = _virtual_layer_args(x, topk_ids, topk_weights, w_gate_up, w_down,
                                                workspace, fused.cuda_mlp(recipe),
                                                capacity_factor, check_capacity, None)
  reason = fused.layer_unavailable_reason(shape)
  if reason is not None:
    raise ValueError(f"the fused kernel cannot take this layer: {reason}")
  if workspace.fused_rows < plan.n_cap:
    raise ValueError(f"workspace {workspace.id} has fused_rows={workspace.fused_rows}, the layer "
                     f"needs {plan.n_cap} pool rows per rank")
  cfg = fused.FusedConfig(workspace, shape.num_experts, plan, max_ctas, recipe=recipe)
  return fused.fused_layer(x, topk_ids, topk_weights, w_gu, w_dn, cfg)

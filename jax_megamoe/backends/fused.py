"""Backend "fused": the layer's forward as one persistent sm_90a kernel per GPU.

The kernel (ffi/impls/sm90_fused_moe_fwd.cu) routes on the device, sends each token's row over
NVLink straight into the pool of every rank that holds one of its experts (rows in expert
order), runs L1 with SwiGLU in its epilogue and L2 on its tile engine as soon as a tile's rows
have arrived (per-block arrival counters, acquire/release), stores every L2 row into its source
rank's comb buffer, and reduces each token's slots at the source in slot order: no XLA sort,
gather or permute, and bitwise reproducible. One custom call per forward per GPU, one
cooperative launch (every CTA co-resident; at most MEGAMOE_FUSED_MAX_CTAS CTAs, default one per
SM on one GPU and all but 8 SMs when EP spans GPUs, so that a collective XLA runs beside it on
another stream keeps room).

Backward (until the fused backward exists) runs backend "cuda"'s kernels, from residuals:
- one rank (no mesh, or an expert axis of size 1): the kernel keeps what cuda's backward reads
  (FusedResiduals; per layer at 16,384 tokens, k = 8, n_cap = T * k = 131,072 rows, 30B shape
  H = 2048, F = 768: x_sorted n_cap x H x 2 B = 512 MiB, gate_up n_cap x 2F x 2 B = 384 MiB,
  h n_cap x F x 2 B = 192 MiB, y_sorted 512 MiB, slot_dest T x k x 4 B = 0.5 MiB, group_sizes
  4 B per expert: 1.6 GiB, what backend "cuda" keeps), and the backward is cuda's EP backward
  on one rank: combine's VJP (dy_sorted = w * dy by slot, d topk_weights = <dy, y_sorted>), the
  grouped MLP backward, dispatch's VJP (dx summed over slots). No forward is recomputed.
- several ranks (EP across GPUs, virtual ranks): the kernel keeps gate_up, h and y_sorted (L2's
  rows, a second store of its epilogue) but not the pool (symmetric memory the next layer
  overwrites) nor expert-side slot tables, so the backward runs cuda's dispatch again (x_sorted,
  slot_pos, recv_w: the same (expert, source, token) row order as the kernel's pool), then
  cuda's EP backward. No GEMM is recomputed. (benchmarks/kernels/FUSED_BACKWARD_PLAN.md: what
  the fused backward will keep.)

What it takes: bfloat16, H a multiple of 256, F a multiple of 128, E <= 1024, top_k <= 32, no
recipe. Other layers (and meshes the NVLink kernels cannot serve) run on backend "cuda", the
same function. Memory of the workspace's fused regions per GPU (R ranks, T tokens per GPU,
n_cap = R * T * min(k, E / R) pool rows by default, dropless):
  n_cap * H * 2 (pool) + T * k * H * 2 (comb) + 16 * (n_cap / 128 + 1024) + 65 KB
e.g. 30B shape at EP=1 (T=16,384, k=8, H=2048): 0.54 + 0.54 GB.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jax_megamoe import _ffi, parallel, symmetric, varying
from jax_megamoe.backends import cuda, cuda_bf16, cuda_ep
from jax_megamoe.validation import LayerShape

NAME = "fused"
TARGET = "megamoe_fused_moe_fwd"
MAX_EXPERTS = symmetric.FUSED_MAX_EXPERTS
CHUNK = 32  # tokens of a routing chunk (the kernel's chunk_counts layout)
# SMs left to other kernels when EP spans GPUs (a collective on another stream must find room:
# DESIGN.md §7, deadlock across GPUs).
SMS_LEFT_FOR_COLLECTIVES = 8


@functools.cache
def unavailable_reason(recipe: str | None = None) -> str | None:
  """Why this backend cannot run `recipe` here (None when it can)."""
  reason = _ffi.cuda_unavailable_reason()
  if reason is not None:
    return reason
  if not _ffi.has_target(TARGET, "CUDA"):
    return f"the extension has no CUDA target {TARGET!r} (rebuild the package)"
  capabilities = sorted({str(getattr(d, "compute_capability", "?")) for d in _ffi.gpu_devices()})
  if capabilities != ["9.0"]:
    return (f"the fused kernel is sm_90a only (Hopper: wgmma, TMA); the GPUs here are compute "
            f"capability {', '.join(capabilities)}")
  if recipe is not None:
    return (f"recipe {recipe!r} has no fused kernel yet (bf16 only); backend 'cuda' runs it "
            "with its FP8 kernels")
  return None


def layer_unavailable_reason(shape: LayerShape) -> str | None:
  """Why the fused kernel cannot take this layer (None when it can)."""
  if shape.dtype != jnp.bfloat16:
    return f"x is {shape.dtype}; the fused kernel takes bfloat16"
  if shape.hidden % 256 or shape.ffn % 128:
    return f"H={shape.hidden} must be a multiple of 256 and F={shape.ffn} of 128"
  if shape.num_experts > MAX_EXPERTS:
    return f"{shape.num_experts} experts > {MAX_EXPERTS}"
  if shape.top_k > cuda_ep.MAX_TOP_K:
    return f"top_k={shape.top_k} > {cuda_ep.MAX_TOP_K}"
  return None


# What "auto" gains from fused is measured per training step, not per forward: with its backward
# recomputing the forward (session 5) the example's step ran 88.9k tok/s with fused vs 94.8k with
# cuda; with the one-rank residuals (session 6) 102.8k vs 104.8k, within run-to-run spread (its
# forward saves ~0.15 ms of GPU time per layer). So "auto" leaves it to explicit requests until a
# step measures faster (benchmarks/RESULTS.md).
AUTO_PICKS_FUSED = False


def auto_reason(shape: LayerShape | None, mesh, expert_axis: str) -> str | None:
  """Why backend "auto" should not pick "fused" for this layer (None: pick it; shape None: any
  layer): layers the kernel does not take, EP across GPUs (not run on two GPUs yet), and for
  now every layer (AUTO_PICKS_FUSED). backend="fused" still runs what the kernel takes."""
  if shape is not None:
    reason = layer_unavailable_reason(shape)
    if reason is not None:
      return reason
    if mesh is not None and shape.ep_size > 1:
      return ("the fused kernel has not been run across GPUs yet (EP > 1); backend 'cuda' "
              "serves it")
  if not AUTO_PICKS_FUSED:
    return ("a training step with 'fused' has not measured faster than with 'cuda' (the fused "
            "backward does not exist yet); backend 'cuda' serves it")
  return None


def max_ctas(spans_gpus: bool) -> int:
  """The launch's CTA budget attribute: > 0 at most that many, <= 0 every SM but -value."""
  env = os.environ.get("MEGAMOE_FUSED_MAX_CTAS")
  if env is not None:
    value = int(env)
    if value < 1:
      raise ValueError(f"MEGAMOE_FUSED_MAX_CTAS must be a positive number of CTAs, got {env!r}")
    return value
  return -SMS_LEFT_FOR_COLLECTIVES if spans_gpus else 0


@dataclasses.dataclass(frozen=True)
class FusedConfig:
  """Static configuration of one fused call (a nondiff argument of the custom_vjp)."""
  workspace: symmetric.SymmetricWorkspace  # hashed by identity
  num_experts: int
  plan: cuda_ep.LayerPlan  # n_cap, check_capacity (the backward's cuda path uses it too)
  max_ctas: int

  @property
  def stacked(self) -> bool:
    return self.workspace.virtual

  @property
  def one_rank(self) -> bool:
    """One rank alone: the forward also keeps its pool rows and slot table (x_sorted,
    slot_dest)."""
    return self.workspace.num_ranks == 1 and not self.stacked

  def ep_config(self) -> cuda_ep.EpConfig:
    """The cuda EP kernels' configuration on this workspace (the backward's exchange)."""
    return cuda_ep.EpConfig(self.workspace.id, self.workspace.num_ranks, self.num_experts,
                            self.stacked)


class FusedResiduals(NamedTuple):
  """What the forward keeps for the backward (rows in the pool's expert order; with one rank,
  slot (t, j) of the token-major input is row slot_dest[t, j], -1 for none). x_sorted and
  slot_dest are None with several ranks."""
  gate_up: jax.Array      # [.., n_cap, 2F] L1's output before SwiGLU
  h: jax.Array            # [.., n_cap, F] SwiGLU's output, L2's input
  y_sorted: jax.Array     # [.., n_cap, H] L2's output rows
  group_sizes: jax.Array  # [.., E/R] int32 pool rows per local expert
  x_sorted: jax.Array | None = None   # [n_cap, H] the dispatched rows
  slot_dest: jax.Array | None = None  # [T, k] int32


PHASES = ("start", "route", "counts exchanged", "slot positions", "rows copied",
          "GEMM tiles done", "results here", "combine done")  # fused_moe.h: kFusedPhases


def _fused_call(x, ids, w, w_gate_up, w_down, cfg: FusedConfig, *, residuals: bool = False):
  """The custom call: (y, stats [.., 4], phase clock [.., len(PHASES)], FusedResiduals or
  None). residuals: keep them (the pool rows too with one rank)."""
  lead = (cfg.workspace.num_ranks,) if cfg.stacked else ()
  tokens, hidden = x.shape[-2:]
  top_k = ids.shape[-1]
  ffn = w_down.shape[-2]
  n_cap = cfg.plan.n_cap
  n_chunks = -(-tokens // CHUNK)
  kept = lambda keep, *shape: jax.ShapeDtypeStruct((*lead, *shape) if keep else (0,), x.dtype)
  rows = residuals and cfg.one_rank
  out_types = (
      jax.ShapeDtypeStruct((*lead, tokens, hidden), x.dtype),
      jax.ShapeDtypeStruct((*lead, n_cap, ffn), x.dtype),  # h
      jax.ShapeDtypeStruct((*lead, cfg.num_experts * n_chunks), jnp.int32),  # scratch
      jax.ShapeDtypeStruct((*lead, tokens, top_k), jnp.int32),  # slot_rows (scratch)
      jax.ShapeDtypeStruct((*lead, tokens, top_k), jnp.int32),  # slot_dest
      jax.ShapeDtypeStruct((*lead, w_gate_up.shape[-3]), jnp.int32),  # group_sizes
      jax.ShapeDtypeStruct((*lead, 4), jnp.int32),
      jax.ShapeDtypeStruct((*lead, len(PHASES)), jnp.int32),
      kept(rows, n_cap, hidden), kept(residuals, n_cap, 2 * ffn),
      kept(residuals, n_cap, hidden),
  )
  y, h, _, _, slot_dest, group_sizes, stats, phases, x_sorted, gate_up, y_sorted = (
      jax.ffi.ffi_call(TARGET, out_types)(
          x, ids, w, w_gate_up, w_down, workspace_id=np.int64(cfg.workspace.id),
          num_experts=np.int64(cfg.num_experts), n_cap=np.int64(n_cap),
          max_ctas=np.int64(cfg.max_ctas)))
  kept_res = None
  if residuals:
    kept_res = FusedResiduals(gate_up, h, y_sorted, group_sizes)
    if rows:
      kept_res = kept_res._replace(x_sorted=x_sorted, slot_dest=slot_dest)
  return y, stats, phases, kept_res


def _checked_call(x, ids, w, w_gate_up, w_down, cfg, residuals: bool):
  y, stats, _, kept = _fused_call(x, ids, w, w_gate_up, w_down, cfg, residuals=residuals)
  if cfg.plan.check_capacity:
    jax.debug.callback(cuda_ep.raise_on_bad_stats, stats)
  return y, kept


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _fused_layer(x, ids, w, w_gate_up, w_down, cfg):
  return _checked_call(x, ids, w, w_gate_up, w_down, cfg, residuals=False)[0]  # not differentiated


def _fused_layer_fwd(x, ids, w, w_gate_up, w_down, cfg):
  y, kept = _checked_call(x, ids, w, w_gate_up, w_down, cfg, residuals=True)
  return y, (x, ids, w, w_gate_up, w_down, kept)


def _fused_layer_bwd(cfg, residuals, dy):
  x, ids, w, w_gate_up, w_down, kept = residuals
  dy = dy.astype(x.dtype)
  ep = cfg.ep_config()
  if kept.x_sorted is not None:  # one rank: every row kept (slot_dest is dispatch's slot_pos)
    x_sorted, slot_pos, recv_w = kept.x_sorted, kept.slot_dest, w
  else:  # several ranks: cuda's dispatch lays the rows out as the kernel's pool
    d = cuda_ep.dispatch_rows(x, ids, w, ep, cfg.plan.n_cap)
    x_sorted, slot_pos, recv_w = d.x_sorted, d.slot_pos, d.recv_w
  group_sizes = kept.group_sizes
  dy_sorted, d_w_slots = cuda_ep.combine_backward(dy, kept.y_sorted, slot_pos, recv_w, ids,
                                                  group_sizes, ep)
  dx_sorted, dwgu, dwd = ep.per_rank(cuda_bf16.backward, dy_sorted, x_sorted, group_sizes,
                                     w_gate_up, w_down, kept.gate_up, kept.h)
  dx, dw = cuda_ep.dispatch_backward(dx_sorted, d_w_slots, slot_pos, ids, ep)
  return dx, None, dw, dwgu, dwd


_fused_layer.defvjp(_fused_layer_fwd, _fused_layer_bwd)


def fused_layer(x, ids, w, w_gate_up, w_down, cfg: FusedConfig):
  """The fused layer on this device's local ranks of cfg.workspace (one rank inside shard_map,
  or the R ranks of a virtual group, operands stacked), differentiable."""
  x, w_gate_up, w_down = varying.align_varying(x, w_gate_up, w_down)
  return _fused_layer(x, ids.astype(jnp.int32), w.astype(jnp.float32), w_gate_up, w_down, cfg)


def forward_with_phases(x, topk_ids, topk_weights, w_gate_up, w_down):
  """One device, no mesh (for the breakdown benchmark): (y, phase clock [8] int32: ns from the
  kernel's start to the end of each of PHASES, on its CTA 0). Forward only."""
  from jax_megamoe.validation import check_layer_args
  shape = check_layer_args(x, topk_ids, topk_weights, w_gate_up, w_down)
  reason = layer_unavailable_reason(shape) or unavailable_reason()
  if reason is not None:
    raise ValueError(f"the fused kernel cannot take this layer: {reason}")
  plan = cuda_ep.LayerPlan.of(shape, cuda_bf16.grouped_mlp)
  cfg = FusedConfig(_local_workspace(shape, plan.n_cap), shape.num_experts, plan,
                    max_ctas(False))
  y, _, phases, _ = _fused_call(x, topk_ids.astype(jnp.int32),
                                topk_weights.astype(jnp.float32), w_gate_up, w_down, cfg)
  return y, phases


def _local_workspace(shape: LayerShape, n_cap: int) -> symmetric.SymmetricWorkspace:
  """A one-rank workspace on every local GPU (whichever device XLA runs the call on: the fused
  regions, ~1 GB at the 30B shape, are then allocated on each GPU of the process; with several
  GPUs give a mesh, or free them with symmetric.close_all())."""
  gpus = [d for d in jax.local_devices() if d.platform == "gpu"]
  mesh = Mesh(np.array(gpus).reshape(-1, 1), ("data", "expert"))
  return symmetric.workspace_for(mesh, "expert", max_tokens=shape.tokens, hidden=shape.hidden,
                                 top_k=shape.top_k, dtype=shape.dtype, fused_rows=n_cap)


def moe(x, topk_ids, topk_weights, w_gate_up, w_down, *, mesh, expert_axis, recipe,
        shape: LayerShape):
  """The layer (backend protocol: jax_megamoe.backends). Layers or meshes the kernel cannot
  take run on backend "cuda" (see the module doc)."""
  args = (x, topk_ids, topk_weights, w_gate_up, w_down)
  fallback = functools.partial(cuda.moe, *args, mesh=mesh, expert_axis=expert_axis,
                               recipe=recipe, shape=shape)
  if recipe is not None or layer_unavailable_reason(shape) is not None:
    return fallback()
  if mesh is None:
    plan = cuda_ep.LayerPlan.of(shape, cuda_bf16.grouped_mlp)
    cfg = FusedConfig(_local_workspace(shape, plan.n_cap), shape.num_experts, plan,
                      max_ctas(False))
    return fused_layer(*args, cfg)
  if cuda_ep.unavailable_reason(mesh, expert_axis, shape) is not None:
    return fallback()
  plan = cuda_ep.LayerPlan.of(shape, cuda_bf16.grouped_mlp)
  workspace = symmetric.workspace_for(mesh, expert_axis, max_tokens=shape.tokens_per_device,
                                      hidden=shape.hidden, top_k=shape.top_k, dtype=shape.dtype,
                                      fused_rows=plan.n_cap)
  cfg = FusedConfig(workspace, shape.num_experts, plan, max_ctas(shape.ep_size > 1))
  args = (x, topk_ids.astype(jnp.int32), topk_weights.astype(jnp.float32), w_gate_up, w_down)
  return parallel.shard_over_mesh(functools.partial(fused_layer, cfg=cfg), mesh, expert_axis,
                                  args, check_vma=False)

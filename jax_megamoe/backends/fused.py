"""Backend "fused": the layer's forward, and with several ranks its bf16 backward's exchange and
dgrads, as one persistent sm_90a kernel per GPU.

The kernel (ffi/impls/sm90_fused_moe.cu) routes on the device, sends each token's row over
NVLink straight into the pool of every rank that holds one of its experts (rows in expert
order), runs L1 with SwiGLU in its epilogue and L2 on its tile engine as soon as a tile's rows
have arrived (per-block arrival counters, acquire/release), stores every L2 row into its source
rank's comb buffer, and reduces each token's slots at the source in slot order: no XLA sort,
gather or permute, and bitwise reproducible. One custom call per forward per GPU, one
cooperative launch (every CTA co-resident; at most MEGAMOE_FUSED_MAX_CTAS CTAs, default one per
SM on one GPU and all but 8 SMs when EP spans GPUs, so that a collective XLA runs beside it on
another stream keeps room). Besides its outputs and residuals the call takes an int32 scratch
of E x ceil(T / 32) + 4 x T x k ints per rank (2.25 MiB at 16,384 tokens, 128 experts, top-8):
the routing's chunk counts and the copy plan (each slot's token row, pool row and M-block, in
pool order: the rows are copied beside the GEMMs, in the order the tiles consume them).

Backward: the fused kernel's backward pass where MEGAMOE_FUSED_BACKWARD (below) picks it,
otherwise backend "cuda"'s kernels, from residuals:
- one rank (no mesh, or an expert axis of size 1): the kernel keeps what cuda's backward reads
  (FusedResiduals; per layer at 16,384 tokens, k = 8, n_cap = T * k = 131,072 rows, 30B shape
  H = 2048, F = 768: x_sorted n_cap x H x 2 B = 512 MiB, gate_up n_cap x 2F x 2 B = 384 MiB,
  h n_cap x F x 2 B = 192 MiB, y_sorted 512 MiB, slot_dest T x k x 4 B = 0.5 MiB, group_sizes
  4 B per expert: 1.6 GiB, what backend "cuda" keeps), and the backward is cuda's EP backward
  on one rank: combine's VJP (dy_sorted = w * dy by slot, d topk_weights = <dy, y_sorted>), the
  grouped MLP backward, dispatch's VJP (dx summed over slots). No forward is recomputed.
- several ranks (EP across GPUs, virtual ranks), bf16: the kernel keeps gate_up, h, y_sorted
  (L2's rows, a second store of its epilogue) and x_sorted (the pool is symmetric memory the
  next layer overwrites, so the kernel copies its rows out after every source's rows landed:
  one more read and write of the pool per forward in residual mode), the same per rank as one
  rank keeps. The expert side's slot tables (slot_pos, recv_w: where each source's slot went in
  this rank's pool) come from every source's slot_dest, ids and weights (an all_gather over the
  expert axis of 3 x T x k x 4 bytes per rank; a virtual group has them stacked). The backward
  is then cuda's EP backward, with no dispatch and no GEMM recomputed.
  (benchmarks/kernels/FUSED_BACKWARD_PLAN.md: the fused backward's design and measurements.)
- MEGAMOE_FUSED_BACKWARD=auto (the default: several ranks only, where it measured faster;
  1: also at one rank; 0: never), bf16 with F a multiple of 256: the backward is instead the
  fused kernel's backward pass, one launch per GPU (route again, w * dy to the pools, both
  dgrads with the SwiGLU backward, dx summed at the sources, d topk_weights from the forward's
  comb rows), then the two wgrads per rank. With several ranks the forward then keeps its comb
  rows (y_comb, [T * k, H] at the source: 512 MiB per layer at the 30B shape and 16,384 tokens,
  what y_sorted took) instead of y_sorted.
- Under jax.checkpoint (a rematerialised step) the forward pass's call, whose residuals nothing
  reads, runs the kernel without them (custom_vjp optimize_remat: the primal), and the
  backward's recomputation keeps them: one residual-mode forward per layer and step, not two.

Recipes "fp8" / "fp8_pow2" (jax_megamoe.fp8 defines them; the same function as backend "cuda"'s
FP8 path): the token rows are quantised before they travel (1 x 128 blocks, cuda_fp8.quantize_rows)
and reach the pool as e4m3 rows + fp32 scales; the weights are quantised once per forward
outside the VJP (cuda_fp8.quantize_expert_weights, named fp8.QUANTIZED_WEIGHTS_NAME for remat
policies); both GEMMs run on the e4m3 tile engine (fp32 accumulation promoted every 128 of K
with the blocks' scales), L1's epilogue quantises h (after SwiGLU, from its bf16 rounding, as
the definition does) into e4m3 + 1 x 128 scales for L2; combine stays bf16. Backward: backend
"cuda"'s FP8 backward (cuda_fp8.mlp_backward, the dgrad GEMMs on the forward's weight blocks):
- one rank: from residuals the kernel keeps (gate_up and y_sorted): no forward GEMM
  recomputed; dW_gate_up from x's bf16 rows, as backend cuda without a mesh computes it. The
  wgrads' operands are quantised straight from x's rows, read by pool row (the pool's tokens
  from slot_dest), and from gate_up (cuda_fp8.swiglu_wgrad_operand: h's SwiGLU on the fly), so
  neither the bf16 x_sorted nor h is stored (at the 30B shape and 16,384 tokens 512 + 192 MiB
  per layer that the backward wrote and read again until session 42).
- several ranks: the kernel keeps gate_up and y_sorted as with bf16, and its pool's e4m3 rows
  with their scales (copied out, as bf16's rows); the tables as with bf16; then the same FP8
  backward. dW_gate_up is computed from those FP8 rows, the rows that reached the expert rank,
  as in backend cuda's EP path: its operand is quantised from them dequantised as read, never
  stored in bf16 (until session 43 a bf16 copy was, n_cap x H x 2 bytes per rank). No dispatch
  and no forward GEMM run again (until session 18 the backward ran cuda's dispatch of the same
  FP8 rows; until session 14 cuda's whole FP8 layer).

What it takes: bfloat16, H a multiple of 256, F a multiple of 128, E <= 1024, top_k <= 32, recipe
None, "fp8" or "fp8_pow2". Other layers (and meshes the NVLink kernels cannot serve) run on
backend "cuda", the same function. Memory of the workspace's fused regions per GPU (R ranks,
T tokens per GPU, n_cap = R * T * min(k, E / R) pool rows by default, dropless; FP8 rows and
their scales fit in the same pool):
  n_cap * H * 2 (pool) + T * k * H * 2 (comb) + 16 * (n_cap / 128 + 1024) + 65 KB
e.g. 30B shape at EP=1 (T=16,384, k=8, H=2048): 0.54 + 0.54 GB.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jax_megamoe import _ffi, env_overrides, parallel, symmetric, varying
from jax_megamoe.backends import cuda, cuda_bf16, cuda_ep, cuda_fp8
from jax_megamoe.validation import LayerShape

NAME = "fused"
TARGET = "megamoe_fused_moe_fwd"
BWD_TARGET = "megamoe_fused_moe_bwd"
MAX_EXPERTS = symmetric.FUSED_MAX_EXPERTS
CHUNK = 32  # tokens of a routing chunk (the layout of the kernel's scratch)
FP8_RECIPES = cuda_fp8.RECIPES
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
  if recipe is not None and recipe not in FP8_RECIPES:
    return (f"recipe {recipe!r} has no fused kernel (it takes None, 'fp8' and 'fp8_pow2'); "
            "backend 'reference' emulates it")
  if recipe is not None:
    missing = [t for t in cuda_fp8.TARGETS if not _ffi.has_target(t, "CUDA")]
    if missing:
      return f"the extension has no CUDA target {missing[0]!r} (rebuild the package)"
  return None


def scale_pitch(rows: int) -> int:
  """Rows of the kernel's K-block-major FP8 scale matrices (fused_moe.h: FusedScalePitch)."""
  return -(-rows // 128) * 128


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


# What "auto" gains from fused is measured per training step, not per forward. Sessions 5-6 and
# 16-17 measured the example's step at parity or slower with fused. Session 41
# (benchmarks/RESULTS.md), both run orders: on an H100 (30B config x 4 layers) fused was
# 0.5-0.9% faster (bf16 and fp8), on an H200 it was not: 30B x 8 layers 272.23 / 271.54 ms
# against cuda 271.59 / 270.75, 235B x 1 layer 196.52 / 197.52 against 196.35 / 194.04 (under
# checkpointing both forwards then kept residuals). Session 42, H100s only, after
# optimize_remat (the first forward keeps none) and, for fp8, the backward's wgrad operands read
# in place: bf16 fused 0.4-2.1% faster, fp8 1.8-1.9%; the layer's forward + re-forward +
# backward faster with fused at both shapes and recipes (30B bf16 10.64 ms against 11.13). The
# H200, where the step was at parity, has not run since: "auto" keeps cuda until it has; where
# it is switched on, it picks fused only where the kernel has run (one GPU, one process).
AUTO_PICKS_FUSED = False


def auto_reason(shape: LayerShape | None, mesh, expert_axis: str) -> str | None:
  """Why backend "auto" should not pick "fused" for this layer (None: pick it; shape None: any
  layer): layers the kernel does not take, and meshes over several GPUs or processes (the fused
  kernel has not run on two GPUs yet). backend="fused" still runs what the kernel takes."""
  if not AUTO_PICKS_FUSED:
    return ("a training step with 'fused' has not measured faster than with 'cuda' on an H200 "
            "(parity); backend 'cuda' serves it")
  if jax.process_count() > 1:
    return ("the fused kernel has not run in a multi-process job yet; backend 'cuda' serves it")
  if shape is not None:
    reason = layer_unavailable_reason(shape)
    if reason is not None:
      return reason
    if mesh is not None and shape.num_devices > 1:
      return (f"the fused kernel has not run across GPUs yet (a mesh of {shape.num_devices} "
              "devices); backend 'cuda' serves it")
  return None


def max_ctas(spans_gpus: bool) -> int:
  """The launch's CTA budget attribute: > 0 at most that many, <= 0 every SM but -value."""
  value = env_overrides.positive_int("MEGAMOE_FUSED_MAX_CTAS", None, "a positive number of CTAs")
  if value is not None:
    return value
  return -SMS_LEFT_FOR_COLLECTIVES if spans_gpus else 0


def kernel_backward_requested() -> bool | None:
  """MEGAMOE_FUSED_BACKWARD, read when a FusedConfig is made: "1" the fused backward's kernel
  pass wherever it applies (bf16, F % 256 == 0; see _kernel_backward), "0" never (backend cuda's
  kernels on the forward's residuals), unset or "auto" (None): with several ranks only.
  Measured on one H200 (benchmarks/RESULTS.md, session 21), bf16 gradient pass, 4,096 tokens
  per virtual rank: 30B at R = 2 6.20 ms with it against 6.71 without, at R = 4 9.61 against
  11.12; 235B at R = 2 21.75 against 21.95. At one rank of 16,384 tokens (30B) they tie (7.86
  against 7.90 ms alone, 8.19 against 8.17 queued), and backend cuda's layer took 7.62 (session
  20): so one rank keeps cuda's kernels."""
  value = env_overrides.choice("MEGAMOE_FUSED_BACKWARD", ("0", "1", "auto"), "auto")
  return None if value == "auto" else value == "1"


@dataclasses.dataclass(frozen=True)
class FusedConfig:
  """Static configuration of one fused call (a nondiff argument of the custom_vjp)."""
  workspace: symmetric.SymmetricWorkspace  # hashed by identity
  num_experts: int
  plan: cuda_ep.LayerPlan  # n_cap, check_capacity (the backward's cuda path uses it too)
  max_ctas: int
  recipe: str | None = None  # None (bf16) or one of FP8_RECIPES
  # True / False: MEGAMOE_FUSED_BACKWARD 1 / 0; None: auto (kernel_backward_requested).
  kernel_backward: bool | None = dataclasses.field(default_factory=kernel_backward_requested)

  def fused_backward(self, ffn: int) -> bool:
    """Whether the backward runs the fused kernel's backward pass (requested, or by default with
    several ranks; bf16, and F a multiple of 256: its dh tiles) instead of backend cuda's
    kernels."""
    wanted = not self.one_rank if self.kernel_backward is None else self.kernel_backward
    return wanted and self.recipe is None and ffn % 256 == 0

  @property
  def stacked(self) -> bool:
    return self.workspace.virtual

  @property
  def pow2(self) -> bool:
    return self.recipe == "fp8_pow2"

  @property
  def one_rank(self) -> bool:
    """One rank alone: the kernel's pool and comb buffer are XLA buffers (x_sorted, y_sorted),
    and its slot table (slot_dest) is the expert side's (expert_rank_tables)."""
    return self.workspace.num_ranks == 1 and not self.stacked

  def mlp(self):
    """Backend cuda's expert MLP of this recipe (the backward's path; its LayerPlan)."""
    return cuda_mlp(self.recipe)

  def ep_config(self) -> cuda_ep.EpConfig:
    """The cuda EP kernels' configuration on this workspace (the backward's exchange)."""
    return cuda_ep.EpConfig(self.workspace.id, self.workspace.num_ranks, self.num_experts,
                            self.stacked)


class FusedResiduals(NamedTuple):
  """What the forward keeps for the backward (rows in the pool's expert order; slot (t, j) of
  the token-major input is row slot_dest[t, j] of its expert rank's pool, -1 for none). FP8
  keeps no h (the backward recomputes it from gate_up), and x_sorted is the pool's e4m3 rows
  with their scales (cuda_fp8.QuantizedRows) with several ranks, None with one (the backward
  scatters x's bf16 rows)."""
  gate_up: jax.Array      # [.., n_cap, 2F] L1's output before SwiGLU
  h: jax.Array | None     # [.., n_cap, F] SwiGLU's output, L2's input
  y_sorted: jax.Array | None  # [.., n_cap, H] L2's output rows (None: y_comb instead)
  group_sizes: jax.Array  # [.., E/R] int32 pool rows per local expert
  x_sorted: jax.Array | cuda_fp8.QuantizedRows | None = None  # [n_cap, H] the pool's rows
  slot_dest: jax.Array | None = None  # [T, k] int32
  y_comb: jax.Array | None = None  # [.., T * k, H] the comb rows (fused backward, several ranks)


def cuda_mlp(recipe: str | None):
  """Backend cuda's expert MLP for a layer the fused kernel takes (bf16, H and F multiples of
  128): the one its backward path runs."""
  return cuda_bf16.grouped_mlp if recipe is None else cuda_fp8.RowsMlp(pow2=recipe == "fp8_pow2")


def scratch_ints(tokens: int, experts: int, top_k: int) -> int:
  """Int32 scratch per rank of the kernel (fused_moe.h: FusedScratchInts): the chunk counts
  [E, ceil(T / 32)] padded to 4 ints, then the copy plan, 4 ints per slot."""
  return -(-experts * -(-tokens // CHUNK) // 4) * 4 + 4 * tokens * top_k


# fused_moe.h: kFusedPhases. "head copied": the copy plan's first rows, before the GEMMs;
# "rows copied": the rest, by CTA 0's first copy warp beside the tiles (MEGAMOE_FUSED_COPY_HEAD).
# The backward's pass copies all its rows before the GEMMs ("head copied").
PHASES = ("start", "route", "counts exchanged", "slot positions", "head copied", "rows copied",
          "GEMM tiles done", "results here", "combine done")


def _fused_call(x, ids, w, w_gate_up, w_down, cfg: FusedConfig, *, residuals: bool = False,
                fp8_scales=None):
  """The custom call: (y, stats [.., 4], phase clock [.., len(PHASES)], FusedResiduals or
  None). residuals: keep them (FusedResiduals). bf16: x, w_gate_up [.., E/R, H, 2F], w_down
  [.., E/R, F, H] bf16. FP8 (fp8_scales = (x_scale, w_gate_up_scale, w_down_scale)): x e4m3
  [.., T, H], the weights e4m3 and K-major as cuda_fp8.QuantizedWeights ([.., E/R, 2F, H],
  [.., E/R, H, F]); residuals without h, and with one rank without x_sorted."""
  fp8 = fp8_scales is not None
  lead = (cfg.workspace.num_ranks,) if cfg.stacked else ()
  tokens, hidden = x.shape[-2:]
  top_k = ids.shape[-1]
  ffn = w_down.shape[-1] if fp8 else w_down.shape[-2]
  n_cap = cfg.plan.n_cap
  kept = lambda keep, *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(
      (*lead, *shape) if keep else (0,), dtype)
  # The pool's rows: bf16 always; FP8 (e4m3 + scales) with several ranks only, since one rank's
  # backward reads x's bf16 rows (_pool_sources).
  rows = residuals and (not fp8 or not cfg.one_rank)
  # The fused backward with several ranks reads y at the source (y_comb), not at the expert rank.
  comb = residuals and not cfg.one_rank and cfg.fused_backward(ffn)
  none = jnp.zeros((0,), jnp.float32)
  scales = fp8_scales if fp8 else (none, none, none)
  out_types = (
      jax.ShapeDtypeStruct((*lead, tokens, hidden), jnp.bfloat16),
      jax.ShapeDtypeStruct((*lead, n_cap, ffn), x.dtype),  # h (FP8: e4m3)
      jax.ShapeDtypeStruct((*lead, scratch_ints(tokens, cfg.num_experts, top_k)), jnp.int32),
      jax.ShapeDtypeStruct((*lead, tokens, top_k), jnp.int32),  # slot_rows (scratch)
      jax.ShapeDtypeStruct((*lead, tokens, top_k), jnp.int32),  # slot_dest
      jax.ShapeDtypeStruct((*lead, w_gate_up.shape[-3]), jnp.int32),  # group_sizes
      jax.ShapeDtypeStruct((*lead, 4), jnp.int32),
      jax.ShapeDtypeStruct((*lead, len(PHASES)), jnp.int32),
      kept(rows, n_cap, hidden, dtype=x.dtype), kept(residuals, n_cap, 2 * ffn),
      kept(residuals and not comb, n_cap, hidden),  # y_sorted
      kept(comb, tokens * top_k, hidden),  # y_comb
      jax.ShapeDtypeStruct((*lead, ffn // cuda_fp8.BLOCK, scale_pitch(n_cap)) if fp8 else (0,),
                           jnp.float32),  # h_scale (scratch)
      kept(rows and fp8, n_cap, hidden // cuda_fp8.BLOCK, dtype=jnp.float32),  # x_sorted_scale
  )
  (y, h, _, _, slot_dest, group_sizes, stats, phases, x_sorted, gate_up, y_sorted, y_comb, _,
   x_sorted_scale) = (
      jax.ffi.ffi_call(TARGET, out_types)(
          x, ids, w, w_gate_up, w_down, *scales, workspace_id=np.int64(cfg.workspace.id),
          num_experts=np.int64(cfg.num_experts), n_cap=np.int64(n_cap),
          max_ctas=np.int64(cfg.max_ctas), pow2=np.int64(cfg.pow2)))
  kept_res = None
  if residuals:
    if rows and fp8:
      x_sorted = cuda_fp8.QuantizedRows(x_sorted, x_sorted_scale)
    kept_res = FusedResiduals(gate_up, None if fp8 else h, None if comb else y_sorted,
                              group_sizes, x_sorted if rows else None, slot_dest,
                              y_comb if comb else None)
  return y, stats, phases, kept_res


# The layers' custom_vjps return (y, stats) and the capacity check runs outside them
# (fused_layer): a debug callback inside a fwd rule makes the rule effectful, and jax.checkpoint
# never recomputes an effectful equation, so the forward pass would keep every residual.
@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _fused_layer(x, ids, w, w_gate_up, w_down, cfg):
  y, stats, _, _ = _fused_call(x, ids, w, w_gate_up, w_down, cfg)  # not differentiated
  return y, stats


def _fused_layer_fwd(x, ids, w, w_gate_up, w_down, cfg):
  y, stats, _, kept = _fused_call(x, ids, w, w_gate_up, w_down, cfg, residuals=True)
  return (y, stats), (x, ids, w, w_gate_up, w_down, kept)


def expert_rank_tables(slot_dest, ids, w, cfg: FusedConfig):
  """This rank's slot tables as cuda's dispatch lays them out (cuda_ep.Dispatched), from every
  source's slot table: slot_pos [R*T, k] (row s*T + t: the pool row here of source s's slot
  (t, j); cuda_ep.SLOT_NOT_ROUTED where its expert is another rank's or masked;
  cuda_ep.SLOT_DROPPED where it is this rank's but the kernel dropped it, at capacity or as a
  repeated expert: the combine kernels tell the two apart) and recv_w [R*T, k] (its weight, 0
  where slot_pos < 0). Operands as the layer's: stacked [R, T, k] for a virtual group, else
  this rank's [T, k] (several ranks: inside shard_map, gathered over the expert axis)."""
  ranks = cfg.workspace.num_ranks
  local = cfg.num_experts // ranks

  def tables(dest, ids, w, rank):  # every source's [R, T, k] -> this rank's [R*T, k]
    mine = (ids >= 0) & (ids // local == rank)
    pos = jnp.where(mine, jnp.where(dest >= 0, dest, cuda_ep.SLOT_DROPPED),
                    cuda_ep.SLOT_NOT_ROUTED)
    flat = lambda a: a.reshape(-1, a.shape[-1])
    return flat(pos), flat(jnp.where(pos >= 0, w, 0.0).astype(jnp.float32))

  if cfg.stacked:
    return jax.vmap(tables, in_axes=(None, None, None, 0))(slot_dest, ids, w,
                                                           jnp.arange(ranks))
  if ranks == 1:
    return tables(slot_dest[None], ids[None], w[None], 0)
  axis = cfg.workspace.expert_axis
  gather = lambda a: jax.lax.all_gather(a, axis)
  return tables(gather(slot_dest), gather(ids), gather(w), jax.lax.axis_index(axis))


def _residual_ep_backward(cfg, kept, ids, w, dy, mlp_backward, *mlp_args):
  """cuda's EP backward from the kernel's residuals (both recipes): combine's VJP on the expert
  side's slot tables, mlp_backward(dy_sorted, *mlp_args) per rank (-> dx_sorted, dW_gate_up,
  dW_down), dispatch's VJP. Returns (dx, d topk_weights, dW_gate_up, dW_down)."""
  ep = cfg.ep_config()
  slot_pos, recv_w = expert_rank_tables(kept.slot_dest, ids, w, cfg)
  dy_sorted, d_w_slots = cuda_ep.combine_backward(dy, kept.y_sorted, slot_pos, recv_w, ids,
                                                  kept.group_sizes, ep)
  dx_sorted, dwgu, dwd = ep.per_rank(mlp_backward, dy_sorted, *mlp_args)
  dx, dw = cuda_ep.dispatch_backward(dx_sorted, d_w_slots, slot_pos, ids, ep)
  return dx, dw, dwgu, dwd


def _fused_bwd_call(dy, ids, w, y_comb, gate_up, w_gate_up, w_down, cfg: FusedConfig):
  """The fused backward's custom call (bf16): (dx, d topk_weights, dy_sorted, dgate_up, phase
  clock [.., len(PHASES)]). y_comb: the forward's y rows in comb order (its y_sorted with one
  rank alone, its y_comb with several); gate_up its residual; the weights as stored."""
  lead = (cfg.workspace.num_ranks,) if cfg.stacked else ()
  tokens, hidden = dy.shape[-2:]
  top_k = ids.shape[-1]
  ffn = w_down.shape[-2]
  n_cap = cfg.plan.n_cap
  out_types = (
      jax.ShapeDtypeStruct((*lead, tokens, hidden), jnp.bfloat16),  # dx
      jax.ShapeDtypeStruct((*lead, tokens, top_k), jnp.float32),  # d topk_weights
      jax.ShapeDtypeStruct((*lead, n_cap, hidden), jnp.bfloat16),  # dy_sorted
      jax.ShapeDtypeStruct((*lead, n_cap, 2 * ffn), jnp.bfloat16),  # dgate_up
      jax.ShapeDtypeStruct((*lead, scratch_ints(tokens, cfg.num_experts, top_k)), jnp.int32),
      jax.ShapeDtypeStruct((*lead, tokens, top_k), jnp.int32),  # slot_rows (scratch)
      jax.ShapeDtypeStruct((*lead, tokens, top_k), jnp.int32),  # slot_dest (scratch)
      jax.ShapeDtypeStruct((*lead, w_gate_up.shape[-3]), jnp.int32),  # group_sizes
      jax.ShapeDtypeStruct((*lead, 4), jnp.int32),  # stats
      jax.ShapeDtypeStruct((*lead, len(PHASES)), jnp.int32),
  )
  dx, d_w, dy_sorted, dgate_up, *_, phases = jax.ffi.ffi_call(BWD_TARGET, out_types)(
      dy, ids, w, y_comb, gate_up, w_gate_up, w_down, workspace_id=np.int64(cfg.workspace.id),
      num_experts=np.int64(cfg.num_experts), n_cap=np.int64(n_cap),
      max_ctas=np.int64(cfg.max_ctas))
  return dx, d_w, dy_sorted, dgate_up, phases


def _kernel_backward(cfg, residuals, dy):
  """The backward on the fused kernel's backward pass (where FusedConfig.fused_backward picks
  it: bf16, F % 256 == 0, MEGAMOE_FUSED_BACKWARD): one launch routes again, sends w * dy to the pools, runs both dgrads with the SwiGLU backward and
  sums each token's dx rows at its source, with d topk_weights from the forward's comb rows;
  then the two wgrads (CUTLASS, per rank) on its dy_sorted and dgate_up."""
  x, ids, w, w_gate_up, w_down, kept = residuals
  y_comb = kept.y_sorted if cfg.one_rank else kept.y_comb
  dx, d_w, dy_sorted, dgate_up, _ = _fused_bwd_call(dy.astype(x.dtype), ids, w, y_comb,
                                                    kept.gate_up, w_gate_up, w_down, cfg)
  wgrad = lambda a, group_sizes, b: cuda_bf16.grouped_gemm(a, group_sizes, b, kind="wgrad")
  ep = cfg.ep_config()
  dwgu = ep.per_rank(wgrad, kept.x_sorted, kept.group_sizes, dgate_up)
  dwd = ep.per_rank(wgrad, kept.h, kept.group_sizes, dy_sorted)
  return dx, None, d_w, dwgu, dwd


def _fused_layer_bwd(cfg, residuals, cotangents):
  dy, _ = cotangents  # stats: int32, no cotangent
  if cfg.fused_backward(residuals[4].shape[-2]):
    return _kernel_backward(cfg, residuals, dy)
  x, ids, w, w_gate_up, w_down, kept = residuals
  dx, dw, dwgu, dwd = _residual_ep_backward(
      cfg, kept, ids, w, dy.astype(x.dtype), cuda_bf16.backward, kept.x_sorted,
      kept.group_sizes, w_gate_up, w_down, kept.gate_up, kept.h)
  return dx, None, dw, dwgu, dwd


# optimize_remat: under jax.checkpoint a forward whose residuals nothing reads (the first of a
# rematerialised step's two) runs the primal, i.e. the kernel without its residual stores
# (gate_up, the pool rows, y_sorted), instead of the residual mode's fwd rule.
_fused_layer.defvjp(_fused_layer_fwd, _fused_layer_bwd, optimize_remat=True)


# --- recipes "fp8" / "fp8_pow2" ---------------------------------------------------------------


def _over_ranks(fn, a, cfg: FusedConfig):
  """fn of an array whose leading axis it keeps (rows, experts) applied to a virtual group's
  stacked [R, n, ...] as one [R * n, ...] (both quantisers work per row / per expert)."""
  if not cfg.stacked:
    return fn(a)
  lead = a.shape[:2]
  return jax.tree.map(lambda o: o.reshape(*lead, *o.shape[1:]),
                      fn(a.reshape(-1, *a.shape[2:])))


def quantized_weights(w_gate_up, w_down, cfg: FusedConfig) -> cuda_fp8.ExpertWeightBlocks:
  """The layer's weight blocks (cuda_fp8.quantize_expert_weights: once per forward, named for
  remat policies), stacked like the weights."""
  if not cfg.stacked:
    return cuda_fp8.quantize_expert_weights(w_gate_up, w_down, pow2=cfg.pow2)
  flat = lambda a: a.reshape(-1, *a.shape[2:])
  blocks = cuda_fp8.quantize_expert_weights(flat(w_gate_up), flat(w_down), pow2=cfg.pow2)
  lead = w_gate_up.shape[:2]
  return jax.tree.map(lambda o: o.reshape(*lead, *o.shape[1:]), blocks)


def _fp8_call(x, ids, w, blocks: cuda_fp8.ExpertWeightBlocks, cfg: FusedConfig,
              residuals: bool = False):
  """The custom call on rows quantised here (1 x 128, before they travel) and `blocks`:
  (y, stats, FusedResiduals or None)."""
  rows = _over_ranks(lambda a: cuda_fp8.quantize_rows(a, pow2=cfg.pow2), x, cfg)
  y, stats, _, kept = _fused_call(
      rows.q, ids, w, blocks.w_gate_up.q, blocks.w_down.q, cfg, residuals=residuals,
      fp8_scales=(rows.scale, blocks.w_gate_up.scale, blocks.w_down.scale))
  return y, stats, kept


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _fused_fp8_layer(x, ids, w, w_gate_up, w_down, blocks, cfg):
  """(y, stats); w_gate_up / w_down take the weights' gradients, the kernel reads `blocks`."""
  del w_gate_up, w_down
  return _fp8_call(x, ids, w, blocks, cfg)[:2]


def _fused_fp8_layer_fwd(x, ids, w, w_gate_up, w_down, blocks, cfg):
  y, stats, kept = _fp8_call(x, ids, w, blocks, cfg, residuals=True)
  return (y, stats), (x, ids, w, w_gate_up, w_down, blocks, kept)


def _pool_sources(slot_dest, n_cap: int):
  """[n_cap] int32: the token whose FP8 row the kernel put in each pool row (slot_dest[t, j] =
  row -> t), -1 where no slot fills it: one scatter of T k int32 indices."""
  tokens, top_k = slot_dest.shape
  dest = jnp.where(slot_dest >= 0, slot_dest, n_cap).reshape(-1)
  token = jnp.arange(tokens * top_k, dtype=jnp.int32) // top_k
  return jnp.full((n_cap,), -1, jnp.int32).at[dest].set(token, mode="drop")


def _fused_fp8_layer_bwd(cfg, residuals, cotangents):
  """cuda's EP backward with its FP8 MLP backward, from the kernel's residuals; no dispatch and
  no forward GEMM run again. dW_gate_up's rows: x's bf16 rows at one rank (as backend cuda
  without a mesh), the dequantised FP8 rows that reached the expert rank with several (the
  kernel's pool rows, as backend cuda's EP path). The weight gradients' operands are quantised
  straight from x's rows (one rank: gathered by pool row; several: the pool's FP8 rows,
  dequantised as read) and from gate_up (h's SwiGLU), so neither x's rows in pool order nor h
  is stored in bf16 (the same bytes as if they were)."""
  dy, _ = cotangents  # stats: int32, no cotangent
  x, ids, w, w_gate_up, w_down, blocks, kept = residuals
  pow2 = cfg.pow2
  if cfg.one_rank:  # x's rows, gathered by pool row as the quantiser reads them
    x_rows = _pool_sources(kept.slot_dest, cfg.plan.n_cap)
    x_operand = lambda source, group_sizes: cuda_fp8.quantize_wgrad_operand(
        x, group_sizes, source=source, pow2=pow2)
  else:  # the pool's FP8 rows, which mlp_backward reads dequantised (as cuda's EP path passes)
    x_rows = kept.x_sorted
    x_operand = lambda rows, group_sizes: rows

  def mlp_backward(dy_sorted, x_rows, group_sizes, gate_up, blocks):
    hidden = cuda_fp8.swiglu_wgrad_operand(gate_up, group_sizes, pow2=pow2)
    res = cuda_fp8.MlpResiduals(gate_up, hidden, blocks)
    return cuda_fp8.mlp_backward(dy_sorted, x_operand(x_rows, group_sizes), group_sizes, res,
                                 pow2)

  dx, dw, dwgu, dwd = _residual_ep_backward(cfg, kept, ids, w, dy.astype(x.dtype), mlp_backward,
                                            x_rows, kept.group_sizes, kept.gate_up, blocks)
  return dx, None, dw, dwgu, dwd, cuda_fp8.zero_cotangent(blocks)


_fused_fp8_layer.defvjp(_fused_fp8_layer_fwd, _fused_fp8_layer_bwd, optimize_remat=True)


def fused_layer(x, ids, w, w_gate_up, w_down, cfg: FusedConfig,
                blocks: cuda_fp8.ExpertWeightBlocks | None = None):
  """The fused layer on this device's local ranks of cfg.workspace (one rank inside shard_map,
  or the R ranks of a virtual group, operands stacked), differentiable. FP8 recipes: the
  weights are quantised here, outside the VJP (quantized_weights), unless `blocks` gives them
  already quantised (jax_megamoe.weight_blocks; stacked like the weights)."""
  x, w_gate_up, w_down = varying.align_varying(x, w_gate_up, w_down)
  ids, w = ids.astype(jnp.int32), w.astype(jnp.float32)
  if cfg.recipe is None:
    y, stats = _fused_layer(x, ids, w, w_gate_up, w_down, cfg)
  else:
    if blocks is None:
      blocks = quantized_weights(w_gate_up, w_down, cfg)
    y, stats = _fused_fp8_layer(x, ids, w, w_gate_up, w_down, blocks, cfg)
  if cfg.plan.check_capacity:
    jax.debug.callback(cuda_ep.raise_on_bad_stats, stats)
  return y


def forward_with_phases(x, topk_ids, topk_weights, w_gate_up, w_down, recipe=None,
                        residuals: bool = False):
  """One device, no mesh (for the breakdown benchmark): (y, phase clock [len(PHASES)] int32: ns
  from the kernel's start to the end of each of PHASES, on its CTA 0). Forward only; FP8
  recipes: the kernel alone (rows and weights quantised before it, outside the clock).
  residuals: the kernel keeps the backward's residuals, as a training step's forward does (they
  are written, then dropped)."""
  from jax_megamoe.validation import check_layer_args
  shape = check_layer_args(x, topk_ids, topk_weights, w_gate_up, w_down)
  reason = layer_unavailable_reason(shape) or unavailable_reason(recipe)
  if reason is not None:
    raise ValueError(f"the fused kernel cannot take this layer: {reason}")
  cfg = _one_device_config(shape, recipe)
  ids, w = topk_ids.astype(jnp.int32), topk_weights.astype(jnp.float32)
  if recipe is None:
    y, _, phases, _ = _fused_call(x, ids, w, w_gate_up, w_down, cfg, residuals=residuals)
    return y, phases
  rows = cuda_fp8.quantize_rows(x, pow2=cfg.pow2)
  blocks = quantized_weights(w_gate_up, w_down, cfg)
  y, _, phases, _ = _fused_call(
      rows.q, ids, w, blocks.w_gate_up.q, blocks.w_down.q, cfg, residuals=residuals,
      fp8_scales=(rows.scale, blocks.w_gate_up.scale, blocks.w_down.scale))
  return y, phases


ENGINE_PROFILE_TARGET = "megamoe_fused_engine_profile"


def engine_profile() -> tuple[dict, np.ndarray]:
  """The tile engine's cycle accounting of the last fused kernel run on the default GPU (for the
  breakdown benchmark; ffi/gemm/sm90_engine_profile.cuh): (layout, values). values is uint64
  [layout["rows"], layout["slots"]], one row per CTA; layout names the slots
  (jax_megamoe._megamoe.engine_profile_slots()). Only an extension built with
  JAX_MEGAMOE_ENGINE_PROFILE=ON keeps the counters (build_info()["engine_profile"]); otherwise
  this raises and says so. Rows of CTAs the last kernel did not have keep older values."""
  ext = _ffi.extension()
  if ext is None or not _ffi.has_target(ENGINE_PROFILE_TARGET, "CUDA"):
    raise RuntimeError("the fused engine profile needs the CUDA extension")
  layout = dict(ext.engine_profile_slots())
  out = jax.ffi.ffi_call(ENGINE_PROFILE_TARGET, jax.ShapeDtypeStruct(
      (layout["rows"], layout["slots"], 2), jnp.uint32))()
  words = np.asarray(out).astype(np.uint64)
  return layout, words[..., 0] | (words[..., 1] << np.uint64(32))


def backward_with_phases(x, topk_ids, topk_weights, w_gate_up, w_down):
  """One device, no mesh (for the breakdown benchmark): runs the forward once in residual mode
  and returns bwd(dy) -> (dx, phase clock [len(PHASES)] int32), the fused backward's kernel pass
  alone on those residuals (bf16, F % 256 == 0; the wgrads after it are not run). Its phases:
  routing again, the w * dy copy (all of it before the tiles, in token order: "head copied"),
  the dh and dx tiles, the results, then the unweighted slot sum into dx."""
  from jax_megamoe.validation import check_layer_args
  shape = check_layer_args(x, topk_ids, topk_weights, w_gate_up, w_down)
  reason = layer_unavailable_reason(shape)
  if reason is None and shape.ffn % 256 != 0:
    reason = f"the backward's dh tiles need ffn a multiple of 256, got {shape.ffn}"
  if reason is not None:
    raise ValueError(f"the fused backward kernel cannot take this layer: {reason}")
  cfg = dataclasses.replace(_one_device_config(shape, None), kernel_backward=True)
  ids, w = topk_ids.astype(jnp.int32), topk_weights.astype(jnp.float32)
  forward = jax.jit(lambda *a: _fused_call(*a, cfg, residuals=True)[3])
  kept = forward(x, ids, w, w_gate_up, w_down)
  # One rank alone the forward's y_sorted is the comb buffer the backward reads.

  @jax.jit
  def call(dy, ids, w, y_comb, gate_up, wgu, wd):
    dx, _, _, _, phases = _fused_bwd_call(dy, ids, w, y_comb, gate_up, wgu, wd, cfg)
    return dx, phases
  return lambda dy: call(dy.astype(jnp.bfloat16), ids, w, kept.y_sorted, kept.gate_up,
                         w_gate_up, w_down)


def _one_device_config(shape: LayerShape, recipe: str | None) -> FusedConfig:
  """The breakdown benchmark's config: one rank on a local workspace, no mesh."""
  plan = cuda_ep.LayerPlan.of(shape, cuda_mlp(recipe))
  return FusedConfig(_local_workspace(shape, plan.n_cap), shape.num_experts, plan,
                     max_ctas(False), recipe=recipe)


def _local_workspace(shape: LayerShape, n_cap: int) -> symmetric.SymmetricWorkspace:
  """A one-rank workspace on every local GPU (whichever device XLA runs the call on: the fused
  regions, ~1 GB at the 30B shape, are then allocated on each GPU of the process; with several
  GPUs give a mesh, or free them with symmetric.close_all())."""
  gpus = [d for d in jax.local_devices() if d.platform == "gpu"]
  mesh = Mesh(np.array(gpus).reshape(-1, 1), ("data", "expert"))
  return symmetric.workspace_for(mesh, "expert", max_tokens=shape.tokens, hidden=shape.hidden,
                                 top_k=shape.top_k, dtype=shape.dtype, fused_rows=n_cap)


def moe(x, topk_ids, topk_weights, w_gate_up, w_down, *, mesh, expert_axis, recipe,
        shape: LayerShape, weight_blocks=None):
  """The layer (backend protocol: jax_megamoe.backends). Layers or meshes the kernel cannot
  take run on backend "cuda" (see the module doc)."""
  args = (x, topk_ids, topk_weights, w_gate_up, w_down)
  fallback = functools.partial(cuda.moe, *args, mesh=mesh, expert_axis=expert_axis,
                               recipe=recipe, shape=shape, weight_blocks=weight_blocks)
  if (recipe is not None and recipe not in FP8_RECIPES) or layer_unavailable_reason(shape):
    return fallback()
  # The environment overrides are read before a workspace (~1 GB at 30B) is allocated, so that
  # a mistyped one fails first.
  kernel_backward = kernel_backward_requested()
  if mesh is None:
    ctas = max_ctas(False)
    plan = cuda_ep.LayerPlan.of(shape, cuda_mlp(recipe))
    cfg = FusedConfig(_local_workspace(shape, plan.n_cap), shape.num_experts, plan, ctas,
                      recipe=recipe, kernel_backward=kernel_backward)
    return fused_layer(*args, cfg, weight_blocks)
  if cuda_ep.unavailable_reason(mesh, expert_axis, shape) is not None:
    return fallback()
  ctas = max_ctas(shape.ep_size > 1)
  plan = cuda_ep.LayerPlan.of(shape, cuda_mlp(recipe))
  workspace = symmetric.workspace_for(mesh, expert_axis, max_tokens=shape.tokens_per_device,
                                      hidden=shape.hidden, top_k=shape.top_k, dtype=shape.dtype,
                                      fused_rows=plan.n_cap)
  cfg = FusedConfig(workspace, shape.num_experts, plan, ctas, recipe=recipe,
                    kernel_backward=kernel_backward)
  args = (x, topk_ids.astype(jnp.int32), topk_weights.astype(jnp.float32), w_gate_up, w_down)
  if weight_blocks is not None:
    args += (weight_blocks,)
  per_device = lambda x, ids, w, a, b, blocks=None: fused_layer(x, ids, w, a, b, cfg, blocks)
  return parallel.shard_over_mesh(per_device, mesh, expert_axis, args, check_vma=False)

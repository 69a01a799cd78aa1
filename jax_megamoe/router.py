"""Top-k softmax router with Qwen3's renormalisation and the usual auxiliary losses."""

from __future__ import annotations

import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding

from jax_megamoe import _ffi, env_overrides, parallel


class RouterAux(NamedTuple):
  """Auxiliary outputs of `route`.

  load_balancing_loss: scalar, E * sum_e f_e * P_e (Switch/Qwen3 form): f_e is the fraction of
    routed slots that picked expert e, P_e the mean router probability of e. 1.0 when balanced.
  z_loss: scalar, mean over tokens of logsumexp(logits)^2 (ST-MoE), keeps logits small.
  expert_load: [E] float32, the fraction f_e (sums to 1); useful for logging imbalance.
  mean_logits: [E] float32, each expert's router logit averaged over the tokens (without the
    selection bias): the profile every token shares, which the "center" selection-bias rule
    cancels.
  selection_stats: [3, E] float32, the per-expert (mean, std, offset) that the top-k choice
    used: chooser = (logits - mean) / std + offset. From this batch under a selection_norm
    ((0, 1, 0) where a norm does not use one), or the given stored estimates
    (route(selection_stats=)); (0, 1, 0) without a norm. Their mean over a few batches is
    what a model stores for inference (jax_megamoe.models.calibrate_selection_stats).
  With no tokens (T = 0) all are zeros but the std, one: nothing was routed, so nothing to
  balance.
  """

  load_balancing_loss: jax.Array
  z_loss: jax.Array
  expert_load: jax.Array
  mean_logits: jax.Array
  selection_stats: jax.Array


SELECTION_NORMS = ("none", "center", "standardize", "balance")

# The name (jax.ad_checkpoint.checkpoint_name) of the top-k choice made from a chooser other
# than the probabilities (a selection_norm or selection_bias): int32 [T, k], 4 bytes per slot.
# The models' remat policies keep it, so a rematerialised backward does not solve "balance"'s
# offsets again (a few hundred microseconds per layer at 16,384 tokens).
ROUTER_CHOICE_NAME = "megamoe_router_choice"

# selection_norm "balance": the standardised logits, plus a fixed pseudo-random perturbation,
# plus per-expert offsets solved on each batch.
# - The perturbation (std BALANCE_NOISE in units of each expert's logit std; the same for every
#   call, drawn from key 0, so a step is reproducible) is noisy top-k gating (Shazeer et al.,
#   2017): tokens that look alike to the router, such as a frequent byte at the first layer,
#   would otherwise all choose the same experts, and no per-expert offset can split them.
# - The offsets, in two stages: Sinkhorn's alternating normalisation (at BALANCE_TEMPERATURE,
#   in BALANCE_SINKHORN's form) evens out the experts' soft shares; then steps on the hard
#   top-k loads (offset -= step * log(load / mean load), the step shrinking geometrically from
#   the first to the last value; the best offsets seen are kept) close the gap between soft
#   and hard shares.
# Chosen on synthetic logits shaped like a collapsing router's (a shared profile, a rank-1 or
# rank-2 spread, Zipf-distributed token identities) and on the CPU proxy of the collapse
# (benchmarks/ROUTING_COLLAPSE_NOTES.md, session 24). On the synthetic logits Sinkhorn alone left
# the largest load at 1.3-2.3x the mean, with the load steps 1.04-1.4x (2.1 where a quarter of
# the tokens are one tight cluster). On the proxy, without the perturbation the first layer
# stayed at 1.6-6.9 (its spaces), with it every layer at 1.09-1.53.
BALANCE_NOISE = 0.1
BALANCE_TEMPERATURE = 0.1
BALANCE_SINKHORN_ITERATIONS = 20
BALANCE_LOAD_STEPS = 16
BALANCE_LOAD_STEP_SIZE = (0.1, 0.01)  # the first and the last step
# The Sinkhorn stage's form (router._balancing_offsets' `sinkhorn`): "exp" iterates on the
# kernel exp(z / temperature) with one reduction per direction; "log" with log-sum-exps (two).
# The same offsets. The solve is launch-bound (~280 small kernels per layer): on an H100 at
# 16,384 x 128, route with balance took 0.730 ms queued with "log", 0.598 with "exp", the
# choice differing in 1e-4 of the tokens (benchmarks/bench_route.py; RESULTS.md, session 27).
# Counting the load steps' k-th largest among each row's 16 or 24 candidates instead of over
# every expert was slower there (0.651, 0.663) and was dropped.
BALANCE_SINKHORN = "exp"
# The solve (its "exp" form) as one cooperative CUDA kernel (ffi/impls/balance_offsets.cu): on
# GPUs the kernels were built for, up to BALANCE_KERNEL_MAX_EXPERTS experts, on one device or
# per device under route's `mesh`; elsewhere the JAX loops. On since its GPU tests passed on an
# H100 (session 29: 0.25 ms a call in the step against the loops' ~0.6; the same choice at
# 16,384 x 128); MEGAMOE_BALANCE_KERNEL=0 turns it off.
BALANCE_KERNEL = env_overrides.switch("MEGAMOE_BALANCE_KERNEL", True)
BALANCE_KERNEL_TARGET = "megamoe_balance_offsets"
BALANCE_KERNEL_MAX_EXPERTS = 512  # ffi/layout/balance_problem.h's kBalanceMaxExperts
# The platforms (jax.lax.platform_dependent's names) whose handler the kernel path calls; tests
# add "cpu", the handler's CPU twin, to run the path end to end in CI.
BALANCE_KERNEL_PLATFORMS = ("cuda",)


def _kth_largest(x: jax.Array, k: int) -> jax.Array:
  """[T, 1]: the k-th largest value of each row of x [T, E] (values tied with a row's maximum
  are removed together, so a tie makes it smaller: here, only a load estimate rests on it).
  k rounds of a row maximum: on XLA:CPU at 16,384 x 128 and k = 8, lax.top_k on a value that
  depends on the loop took 300 ms a call (47 ms at the top level), this 31 ms."""
  for _ in range(k - 1):
    x = jnp.where(x >= jnp.max(x, axis=1, keepdims=True), -jnp.inf, x)
  return jnp.max(x, axis=1, keepdims=True)


def _perturbed(z: jax.Array) -> jax.Array:
  """z plus balance's fixed perturbation (BALANCE_NOISE)."""
  if not BALANCE_NOISE:
    return z
  return z + BALANCE_NOISE * jax.random.normal(jax.random.key(0), z.shape, jnp.float32)


def _sinkhorn_log(scaled: jax.Array, top_k: int, iterations: int, unroll) -> jax.Array:
  """Column log-scalings b [E] under which exp(scaled + a + b) has rows summing to k and
  columns to T k / E: alternating log-sum-exps (two reductions per direction on XLA)."""
  num_tokens, num_experts = scaled.shape
  log_row = jnp.log(jnp.float32(top_k))
  log_col = jnp.log(jnp.float32(num_tokens * top_k / num_experts))

  def step(_, b):
    a = log_row - jax.nn.logsumexp(scaled + b, axis=1, keepdims=True)
    return log_col - jax.nn.logsumexp(scaled + a, axis=0)

  return jax.lax.fori_loop(0, iterations, step, jnp.zeros((num_experts,), jnp.float32),
                           unroll=unroll)


def _sinkhorn_exp(scaled: jax.Array, top_k: int, iterations: int, unroll) -> jax.Array:
  """The same b, iterated on the kernel K = exp(scaled - row max) (entries in (0, 1], each
  row's largest 1) with plain matrix-vector sums: one reduction per direction. z is
  standardised per expert, so a column usually has entries near its rows' maxima; where none
  is (an expert no token ranks near its top), its sum falls towards float32's smallest
  normals (4.8e-29 seen on a spiky synthetic router, where the log domain balanced no better)
  and the floor (1e-30) keeps the scaling finite. Sums of products rather than matmuls, which
  XLA:GPU may run in TF32."""
  num_tokens, num_experts = scaled.shape
  kernel = jnp.exp(scaled - jnp.max(scaled, axis=1, keepdims=True))
  col = num_tokens * top_k / num_experts
  tiny = jnp.float32(1e-30)

  def step(_, v):
    u = top_k / jnp.maximum(jnp.sum(kernel * v, axis=1, keepdims=True), tiny)
    return col / jnp.maximum(jnp.sum(kernel * u, axis=0), tiny)

  v = jax.lax.fori_loop(0, iterations, step, jnp.ones((num_experts,), jnp.float32),
                        unroll=unroll)
  return jnp.log(v)


def _loads_from_kth(z: jax.Array, b: jax.Array, top_k: int) -> jax.Array:
  """[E] rows per expert choosing it in the top k of z + b: rows whose k-th largest (k row
  maxima) it reaches, a dense compare and column sum."""
  chooser = z + b
  return jnp.sum((chooser >= _kth_largest(chooser, top_k)).astype(jnp.float32), axis=0)


def _load_step_sizes() -> tuple[float, float]:
  """(first, decay): load step i moves the offsets by first * decay**i (BALANCE_LOAD_STEP_SIZE
  from its first value to its last over BALANCE_LOAD_STEPS steps)."""
  first, last = BALANCE_LOAD_STEP_SIZE
  return first, (last / first) ** (1.0 / max(BALANCE_LOAD_STEPS - 1, 1))


def _balancing_offsets(z: jax.Array, top_k: int, *, sinkhorn: str | None = None,
                       sinkhorn_iterations: int | None = None,
                       unroll: bool | int = 1) -> jax.Array:
  """Per-expert offsets b [E] under which the top k of the rows of z + b (z [T, E], T >= 1:
  the standardised, perturbed logits) load the experts about evenly over these tokens.

  The keywords (defaults: the BALANCE_* constants) choose how it is computed, for
  benchmarks/bench_route.py: sinkhorn "exp" or "log" (_sinkhorn_exp / _sinkhorn_log), its
  iterations, and the loops' unrolling (lax.fori_loop's)."""
  sinkhorn = BALANCE_SINKHORN if sinkhorn is None else sinkhorn
  iterations = BALANCE_SINKHORN_ITERATIONS if sinkhorn_iterations is None else sinkhorn_iterations
  num_tokens, num_experts = z.shape
  solve = {"log": _sinkhorn_log, "exp": _sinkhorn_exp}[sinkhorn]
  b = BALANCE_TEMPERATURE * solve(z / BALANCE_TEMPERATURE, top_k, iterations, unroll)
  mean_load = num_tokens * top_k / num_experts
  first, decay = _load_step_sizes()

  def load_step(i, carry):
    b, best_b, best = carry
    load = _loads_from_kth(z, b, top_k) / mean_load
    peak = jnp.max(load)
    better = peak < best
    best_b, best = jnp.where(better, b, best_b), jnp.minimum(peak, best)
    # An idle expert's log load is clipped (at 1/4 of the mean) so that one step stays small.
    return b - first * decay ** i * jnp.log(jnp.maximum(load, 0.25)), best_b, best

  # The best offsets seen are kept: where many tokens share one row, a step moves them all at
  # once and can overshoot.
  _, best_b, _ = jax.lax.fori_loop(0, BALANCE_LOAD_STEPS, load_step,
                                   (b, b, jnp.float32(jnp.inf)), unroll=unroll)
  return best_b


def _balancing_offsets_kernel(z: jax.Array, top_k: int) -> jax.Array:
  """_balancing_offsets (its default settings) by the CUDA kernel (or the CPU twin): the same
  offsets within float32 rounding of its sums' order."""
  first, decay = _load_step_sizes()
  num_experts = z.shape[1]
  out = (jax.ShapeDtypeStruct((num_experts,), jnp.float32),
         jax.ShapeDtypeStruct((_ffi.scratch_bytes(BALANCE_KERNEL_TARGET, num_experts),),
                              jnp.uint8))
  offsets, _ = jax.ffi.ffi_call(BALANCE_KERNEL_TARGET, out, vmap_method="sequential")(
      z, top_k=np.int64(top_k), temperature=np.float32(BALANCE_TEMPERATURE),
      sinkhorn_iterations=np.int64(BALANCE_SINKHORN_ITERATIONS),
      load_steps=np.int64(BALANCE_LOAD_STEPS), step_first=np.float32(first),
      step_decay=np.float32(decay))
  return offsets


def _kernel_platforms(num_experts: int, mesh: Mesh | None) -> tuple[str, ...]:
  """The platforms on which _solve_offsets calls the kernel (BALANCE_KERNEL); () for none."""
  if not BALANCE_KERNEL or BALANCE_SINKHORN != "exp" or num_experts > BALANCE_KERNEL_MAX_EXPERTS:
    return ()
  return _ffi.custom_call_platforms(BALANCE_KERNEL_TARGET, BALANCE_KERNEL_PLATFORMS, mesh)


def _solve_offsets(z: jax.Array, top_k: int, mesh: Mesh | None) -> jax.Array:
  """balance's offsets [E] of z [T, E]: by the kernel where _kernel_platforms says, else (and
  on other platforms) by the JAX loops of _balancing_offsets."""
  platforms = _kernel_platforms(z.shape[1], mesh)
  if not platforms:
    return _balancing_offsets(z, top_k)
  return jax.lax.platform_dependent(
      z, default=lambda z: _balancing_offsets(z, top_k),
      **{p: lambda z: _balancing_offsets_kernel(z, top_k) for p in platforms})


def _offset_chooser(z: jax.Array, top_k: int, mesh: Mesh | None
                    ) -> tuple[jax.Array, jax.Array]:
  """(z + offsets [T, E], offsets [E]): balance's offsets solved over all of z's tokens, or with
  a mesh on each device's own tokens (no collective inside the solve; the [E] result is their
  mean over the devices, for the statistics)."""
  if mesh is None:
    offset = _solve_offsets(z, top_k, None)
    return z + offset, offset

  def per_device(z_local):
    offset = _solve_offsets(z_local, top_k, mesh)
    return z_local + offset, offset[None]

  # The solve's loops start from invariant constants and it runs no collective: nothing for
  # shard_map's varying-axes check to protect.
  chooser, offsets = parallel.shard_over_tokens(per_device, mesh, (z,), 2, check_vma=False)
  if not parallel.auto_axes(mesh):  # explicit axes type the result: back to z's own sharding
    chooser = jax.reshard(chooser, NamedSharding(mesh, jax.typeof(z).sharding.spec))
  return chooser, jnp.mean(offsets, axis=0)


def route(logits: jax.Array, top_k: int, *, norm_topk_prob: bool = True,
          selection_bias: jax.Array | None = None, selection_norm: str = "none",
          selection_stats: tuple[jax.Array, jax.Array, jax.Array] | None = None,
          mesh: Mesh | None = None) -> tuple[jax.Array, jax.Array, RouterAux]:
  """Routes tokens to experts.

  Args:
    logits: [T, E] router logits, any float dtype (computed in float32).
    top_k: experts per token, an integer (Python or numpy, not bool) with 1 <= top_k <= E.
    norm_topk_prob: renormalise the k selected probabilities to sum to 1 (Qwen3's
      norm_topk_prob); otherwise they keep their softmax values.
    selection_bias: optional [E] per-expert bias added to the logits only to choose the top k
      (DeepSeek-V3's auxiliary-loss-free balancing; see update_selection_bias): the weights are
      still the unbiased softmax probabilities of the chosen experts, and no gradient reaches
      the bias. None or zeros: the same routing as without it.
    selection_norm: what the top k are chosen from (an experiment against routing collapse,
      benchmarks/ROUTING_COLLAPSE_NOTES.md; not Qwen3's routing unless "none"): "none" the
      logits; "center" each expert's logit minus its mean over these tokens (cancels the
      profile that every token shares, in this very batch); "standardize" that divided by the
      expert's std over these tokens; "balance" that plus a fixed small perturbation and
      per-expert offsets solved on these tokens (Sinkhorn iterations, then steps on the top-k
      loads: BALANCE_*), so that the experts' loads come out about even. The weights stay the
      softmax of `logits`, no gradient flows through the choice, and the result depends on the
      batch (as batch norm's does), unless selection_stats are given. A selection_bias is
      added after the norm.
    selection_stats: optional stored estimates (mean, std, offset), each [E], of what
      selection_norm computes on a batch (RouterAux.selection_stats averaged over calibration
      batches, models.calibrate_selection_stats): with them the choice is made from
      (logits - mean) / std + offset, without batch statistics and without balance's
      perturbation, as batch norm does at inference. Ignored when selection_norm is "none".
    mesh: the device mesh the tokens are sharded over (all its axes, as jax_megamoe.moe takes
      them; the token count a multiple of its size). With it, "balance" solves its offsets on
      each device's own tokens: balanced per device is balanced in sum, and the solve needs no
      collective, where over all tokens each of its ~40-60 reductions over tokens is an
      all-reduce of [E] values, in sequence (session 26, benchmarks/ROUTING_COLLAPSE_NOTES.md).
      The statistics' offset is then the devices' mean. The mean and std stay over all tokens.

  Returns:
    (topk_weights float32 [T, k], topk_ids int32 [T, k], RouterAux). Ties pick the lower id.
  """
  if logits.ndim != 2:
    raise ValueError(f"logits must be [tokens, experts], got shape {logits.shape}")
  num_experts = logits.shape[1]
  if (isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral)
      or not 1 <= top_k <= num_experts):
    raise ValueError(f"top_k must be an int in [1, {num_experts}] (the number of experts), "
                     f"got {top_k!r}")
  if selection_norm not in SELECTION_NORMS:
    raise ValueError(f"selection_norm must be one of {SELECTION_NORMS}, got {selection_norm!r}")
  if (mesh is not None and selection_norm == "balance" and selection_stats is None
      and logits.shape[0] % mesh.size):
    raise ValueError(f"logits' token count ({logits.shape[0]}) must be a multiple of the mesh's "
                     f"{mesh.size} devices (mesh {dict(mesh.shape)}): each holds its share")
  top_k = int(top_k)
  logits = logits.astype(jnp.float32)
  probs = jax.nn.softmax(logits, axis=-1)
  mean = std = offset = None  # the chooser's statistics (None: not used, 0 / 1 / 0)
  if selection_bias is None and selection_norm == "none":
    topk_weights, topk_ids = jax.lax.top_k(probs, top_k)
  else:
    chooser = jax.lax.stop_gradient(logits)
    if selection_norm != "none" and selection_stats is not None:
      mean, std, offset = (jax.lax.stop_gradient(jnp.asarray(v, jnp.float32))
                           for v in selection_stats)
      if not mean.shape == std.shape == offset.shape == (num_experts,):
        raise ValueError(f"selection_stats must be three [num_experts={num_experts}] arrays, "
                         f"got shapes {[jnp.shape(v) for v in selection_stats]}")
      chooser = (chooser - mean) / std + offset
    elif selection_norm != "none" and logits.shape[0] > 0:
      mean = jnp.mean(chooser, axis=0)
      chooser = chooser - mean
      if selection_norm in ("standardize", "balance"):
        std = jnp.std(chooser, axis=0) + 1e-6
        chooser = chooser / std
      if selection_norm == "balance":
        chooser, offset = _offset_chooser(_perturbed(chooser), top_k, mesh)
    if selection_bias is not None:
      if selection_bias.shape != (num_experts,):
        raise ValueError(f"selection_bias must be [num_experts={num_experts}], got shape "
                         f"{selection_bias.shape}")
      chooser = chooser + jax.lax.stop_gradient(selection_bias.astype(jnp.float32))
    _, topk_ids = jax.lax.top_k(chooser, top_k)
    topk_ids = checkpoint_name(topk_ids, ROUTER_CHOICE_NAME)
    topk_weights = jnp.take_along_axis(probs, topk_ids, axis=-1)
  zeros, ones = jnp.zeros((num_experts,), jnp.float32), jnp.ones((num_experts,), jnp.float32)
  selection_stats_out = jnp.stack([zeros if mean is None else mean,
                                   ones if std is None else std,
                                   zeros if offset is None else offset])
  if norm_topk_prob:
    topk_weights = topk_weights / jnp.sum(topk_weights, axis=-1, keepdims=True)
  topk_ids = topk_ids.astype(jnp.int32)
  if logits.shape[0] == 0:  # the means below would be 0 / 0
    zero = jnp.zeros((), jnp.float32)
    return topk_weights, topk_ids, RouterAux(zero, zero, zeros, zeros, selection_stats_out)

  one_hot = jax.nn.one_hot(topk_ids, num_experts, dtype=jnp.float32)  # [T, k, E]
  expert_load = jnp.mean(jnp.sum(one_hot, axis=1), axis=0) / top_k    # [E], sums to 1
  mean_prob = jnp.mean(probs, axis=0)                                  # [E]
  load_balancing_loss = num_experts * jnp.sum(jax.lax.stop_gradient(expert_load) * mean_prob)
  z_loss = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
  mean_logits = jax.lax.stop_gradient(jnp.mean(logits, axis=0))
  return topk_weights, topk_ids, RouterAux(load_balancing_loss, z_loss, expert_load, mean_logits,
                                           selection_stats_out)


SELECTION_BIAS_RULES = ("sign", "proportional", "center")


def update_selection_bias(bias: jax.Array, expert_load: jax.Array, rate: float,
                          rule: str = "sign", mean_logits: jax.Array | None = None
                          ) -> jax.Array:
  """One step of auxiliary-loss-free load balancing on the selection bias.

  rule "sign": DeepSeek-V3's (arXiv:2412.19437, sec. 2.1.2): every expert whose share of the
  routed slots is above the mean (1/E) has its bias lowered by `rate`, every one below it
  raised by `rate`: bias + rate * sign(1/E - expert_load).
  rule "proportional": the step is the expert's relative deficit, bias + rate * (1 - E *
  expert_load): +rate for an idle expert, -rate * (E / k - 1) for one in every token's top k.
  A fixed step cannot follow a router whose shared logit profile grows faster than `rate` per
  step (the collapse of benchmarks/ROUTING_COLLAPSE_NOTES.md); this one moves an expert as far as
  it is off balance.
  rule "center": moves the biased mean logits (mean_logits + bias) toward their mean over the
  experts, bias + rate * (mean_e(m) - m) with m = mean_logits + bias; rate 1 cancels the
  step's shared logit profile outright. It works on the logits, not on the load: when every
  token's router input is one common direction (the collapse), all tokens move together and a
  load-driven step overshoots (benchmarks/ROUTING_COLLAPSE_NOTES.md), while the common
  direction's contribution to each expert's logit is exactly its mean over the tokens.

  bias, expert_load, mean_logits: [..., E] (RouterAux.expert_load, rows summing to one, and
  RouterAux.mean_logits; the latter needed by rule "center" only).
  Returns float32."""
  if rule not in SELECTION_BIAS_RULES:
    raise ValueError(f"rule must be one of {SELECTION_BIAS_RULES}, got {rule!r}")
  bias = bias.astype(jnp.float32)
  load = expert_load.astype(jnp.float32)
  num_experts = load.shape[-1]
  if rule == "sign":
    step = jnp.sign(1.0 / num_experts - load)
  elif rule == "proportional":
    step = 1.0 - num_experts * load
  else:
    if mean_logits is None or mean_logits.shape != load.shape:
      raise ValueError(f"rule 'center' needs mean_logits of expert_load's shape {load.shape}, "
                       f"got {None if mean_logits is None else mean_logits.shape}")
    biased = mean_logits.astype(jnp.float32) + bias
    step = jnp.mean(biased, axis=-1, keepdims=True) - biased
  return bias + rate * step

"""Trains a Qwen3-style MoE language model with jax_megamoe.

  python examples/train_qwen3_moe.py            # tiny model, CPU, a few minutes, falling loss

Runs a jit-compiled train step over a (data, expert) device mesh: batch sharded over every
device, experts over `expert`, every other weight FSDP-sharded over `data`. AdamW on float32
master weights with bfloat16 compute, global-norm clipping, warm-up + cosine schedule, the
router's load-balancing and z losses. With --compute-copy (the default in bfloat16) the train
state also holds the weights in their compute dtypes (TrainState.compute,
models.compute_copy): the forward reads them, the update writes them from the new master, so
no step casts every weight and every gradient on its own (checkpoints hold the master only).
Several processes (one per host or per GPU) are joined through jax.distributed when the
environment says so, each driving the GPUs that launch.py picks (JAX_COORDINATOR_ADDRESS +
JAX_NUM_PROCESSES + JAX_PROCESS_ID, or SLURM / Open MPI; MEGAMOE_LOCAL_DEVICE_IDS; see
examples/README.md).

Writes to --out: metrics.jsonl (one line per step), losses.json (the whole curve, for
compare_losses.py), loss_curve.png, expert_load.png and checkpoints/ (orbax, each sealed with
the checksums of its files and verified before --resume restores it; see checkpoints.py). The
batches depend only on --seed and the step, so two runs that differ only in --backend see the
same data (loss parity). A step whose loss or gradient norm is not finite stops the run (exit
status 1) before its update is applied and before anything later is saved.

Flags are absl flags (--name=value or --name value; dashes and underscores alike: --seq-len,
--seq_len); --help lists them.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import types
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags, logging
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

try:
  import jax_megamoe  # noqa: F401
except ImportError:  # run from a source checkout without installing
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jax_megamoe import BACKENDS, RECIPES  # noqa: E402
from jax_megamoe.models import (CONFIGS, REMAT_POLICIES, Qwen3Moe, compute_copy,  # noqa: E402
                                calibrate_selection_stats, get_config,
                                update_selection_biases)
from jax_megamoe.models.hf_import import load_hf_checkpoint, read_hf_config  # noqa: E402
from jax_megamoe.models.attention_impl import ATTENTION_CHOICES, resolve_attention  # noqa: E402
from jax_megamoe.models.losses import auto_ce_chunk, chunked_cross_entropy  # noqa: E402
from jax_megamoe.models.sharding import param_shardings  # noqa: E402
from jax_megamoe.router import SELECTION_BIAS_RULES, SELECTION_NORMS  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkpoints as checkpoints_lib  # noqa: E402
import data as data_lib  # noqa: E402
import launch  # noqa: E402
import plots  # noqa: E402

# Dense bf16 peak FLOP/s per device for the MFU estimate (vendor figures), by device_kind.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12,
                   "B200": 2250e12, "GB200": 2500e12}


class RunError(RuntimeError):
  """The run cannot start or go on; the message says why (the command exits 1 with it)."""


# --- command line -----------------------------------------------------------------------------

# (kind, name, default, help, options). Names keep the argparse-era spellings: --seq-len and
# --seq_len both reach seq_len (see _underscored).
_FLAGS = (
    ("enum", "config", "tiny", "model configuration", dict(enum_values=sorted(CONFIGS))),
    ("integer", "num_layers", None, "override the layer count", dict(lower_bound=1)),
    ("enum", "backend", "auto", "MoE backend", dict(enum_values=list(BACKENDS))),
    ("enum", "recipe", "none", "MoE GEMM recipe",
     dict(enum_values=["none", *filter(None, RECIPES)])),
    ("enum", "dtype", "bfloat16", "compute dtype (master weights are always float32)",
     dict(enum_values=["bfloat16", "float32"])),
    ("boolean", "compute_copy", None,
     "keep the weights also in the dtypes the model computes them in (bf16; the router's "
     "float32), read by the forward and written by the update from the new float32 master: "
     "no step casts every weight and gradient (~12 bytes/param of traffic), for 2 bytes/param "
     "of state. Same loss; gradients the same but the LM head's, rounded once to bf16. "
     "Checkpoints hold the master only. Default: on with --dtype bfloat16 (float32 needs none)",
     {}),
    ("integer", "steps", 150, "training steps", dict(lower_bound=1)),
    ("integer", "batch", 16, "global batch (sequences)", dict(lower_bound=1)),
    ("integer", "seq_len", 128, "tokens per sequence", dict(lower_bound=1)),
    ("float", "lr", 3e-3, "peak learning rate", {}),
    ("integer", "warmup_steps", None, "default: 10% of --steps", dict(lower_bound=0)),
    ("float", "min_lr_ratio", 0.1, "final lr / peak lr", {}),
    ("float", "weight_decay", 0.1, "AdamW weight decay", {}),
    ("float", "clip_norm", 1.0, "global gradient norm clip", {}),
    ("float", "aux_loss_coef", None,
     "load-balancing loss weight (default: the config's: 1e-1 for the published configs "
     "trained from scratch, where 1e-3 lets a layer collapse onto one expert for good (1e-1 "
     "pulls it back within ~60 steps); a --init-from checkpoint's config.json value, 1e-3 "
     "for Qwen3; tiny 1e-2)", {}),
    ("float", "router_bias_rate", None,
     "auxiliary-loss-free balancing: the per-expert selection bias's update rate "
     "(Qwen3MoeConfig.router_bias_update_rate; default: the config's, 0 = off)", {}),
    ("enum", "router_bias_rule", None,
     "how that update is sized: sign, proportional (to the load's deficit) or center (on "
     "the mean logits) (Qwen3MoeConfig.router_bias_update_rule; default: the config's, sign)",
     dict(enum_values=list(SELECTION_BIAS_RULES))),
    ("enum", "router_selection_norm", None,
     "what the routers pick the top k from: none (Qwen3's logits), center or standardize "
     "(each expert's logit over the step's tokens), balance (standardize plus a small fixed "
     "perturbation and per-expert offsets that even out the step's expert loads; "
     "examples/README.md, \"Routing balance\") "
     "(Qwen3MoeConfig.router_selection_norm; default: the config's: balance for the "
     "published configs from scratch, none for tiny and --init-from)",
     dict(enum_values=list(SELECTION_NORMS))),
    ("integer", "calibration_batches", 8,
     "with a router_selection_norm other than none: before each checkpoint, the routers' "
     "selection statistics are measured on the inputs of this many of the latest steps and "
     "stored in the model, which routes with them under model.eval() "
     "(models.calibrate_selection_stats)", dict(lower_bound=1)),
    ("float", "z_loss_coef", 1e-3, "router z-loss weight", {}),
    ("integer", "ce_chunk", None,
     "compute the cross-entropy this many positions at a time, never holding the full "
     "[batch, seq, vocab] logits; 0: full logits; default: full logits when one device's "
     "float32 logits fit 1 GiB, else the largest chunk that does (Qwen3's 152k vocabulary)",
     dict(lower_bound=0)),
    ("enum", "remat", "none",
     "rematerialisation policy of every decoder layer (each also keeps the MoE layers' FP8 "
     "weight blocks with --recipe fp8, so a step quantises each weight once)",
     dict(enum_values=sorted(REMAT_POLICIES))),
    ("enum", "attention", "auto",
     "attention kernel: auto (cuDNN flash attention where it runs: GPU, bf16; else xla, "
     "saying why), xla (any platform) or cudnn", dict(enum_values=list(ATTENTION_CHOICES))),
    ("string", "init_from", None, "Hugging Face Qwen3-MoE checkpoint dir", {}),
    ("string", "data", None,
     "text file or .npy token ids; default: the Python standard library's sources (no "
     "download)", {}),
    ("enum", "tokenizer", "bytes",
     "how text (the default corpus or a --data text file) becomes ids: bytes, or words (the "
     "most frequent words of that text, the rest hashed; no token is a lone space)",
     dict(enum_values=list(data_lib.TOKENIZERS))),
    ("string", "mesh", None,
     "e.g. data=2,expert=4; default: expert = the devices of one host (at most the expert "
     "count), data = the rest", {}),
    ("string", "out", "runs/qwen3_moe", "run directory", {}),
    ("integer", "checkpoint_every", 100, "steps between checkpoints; 0: never",
     dict(lower_bound=0)),
    ("boolean", "resume", False,
     "continue from the newest intact checkpoint (verified against its checksums)", {}),
    ("integer", "stop_at", None,
     "stop after this step as if interrupted (the schedule still spans --steps); with "
     "--resume, for testing preemption", dict(lower_bound=1)),
    ("integer", "seed", 0, "seed of the initialisation and of the batches",
     dict(lower_bound=0)),
    ("integer", "log_every", 25, "steps between log lines (and per-layer expert loads)",
     dict(lower_bound=1)),
    ("float", "peak_tflops", None, "per-device peak for MFU (default: known GPUs' bf16 peak)",
     {}),
    ("boolean", "no_progress", False, "no progress bar", {}),
)
FLAG_NAMES = tuple(spec[1] for spec in _FLAGS)

# Float flags that absl would take as NaN or Inf: (name, smallest value, inclusive?).
_FINITE_FLAGS = (("lr", 0.0, True), ("min_lr_ratio", 0.0, True), ("weight_decay", 0.0, True),
                 ("clip_norm", 0.0, False), ("aux_loss_coef", 0.0, True),
                 ("router_bias_rate", 0.0, True),
                 ("z_loss_coef", 0.0, True), ("peak_tflops", 0.0, False))


def define_flags(flag_values: flags.FlagValues) -> None:
  """Defines the script's flags (and their checks) on `flag_values`."""
  for kind, name, default, help_, options in _FLAGS:
    getattr(flags, f"DEFINE_{kind}")(name, default, help=help_, flag_values=flag_values,
                                     **options)
  for name, low, inclusive in _FINITE_FLAGS:
    bound = f">= {low:g}" if inclusive else f"> {low:g}"
    flags.register_validator(
        name, lambda v, low=low, inclusive=inclusive: v is None or (
            math.isfinite(v) and (v >= low if inclusive else v > low)),
        message=f"--{name} must be a finite number {bound}", flag_values=flag_values)
  flags.register_validator("mesh", lambda v: v is None or parse_mesh(v) is not None,
                           message="--mesh must look like data=2,expert=4 (positive sizes of "
                                   "exactly the axes data and expert)",
                           flag_values=flag_values)
  flags.register_multi_flags_validator(
      ["ce_chunk", "seq_len"],
      lambda v: not v["ce_chunk"] or v["seq_len"] % v["ce_chunk"] == 0,
      message="--ce-chunk must be 0 or divide --seq-len", flag_values=flag_values)


def parse_flags(argv: list[str]) -> types.SimpleNamespace:
  """The run's arguments from a command line (argv[0] is the program), on fresh FlagValues:
  for calling train() from Python and for tests. Bad flags raise flags.Error."""
  flag_values = flags.FlagValues()
  define_flags(flag_values)
  rest = flag_values(_underscored(argv))
  if len(rest) > 1:
    raise flags.Error(f"unexpected arguments {rest[1:]}")
  return flags_to_args(flag_values)


def flags_to_args(flag_values: flags.FlagValues) -> types.SimpleNamespace:
  args = types.SimpleNamespace(**{name: flag_values[name].value for name in FLAG_NAMES})
  args.recipe = None if args.recipe == "none" else args.recipe
  return args


def _underscored(argv: list[str]) -> list[str]:
  """--seq-len=4 -> --seq_len=4 (absl names use underscores; the dashed names are the
  script's historical spelling and stay valid). Values and everything after "--" are kept."""
  out = list(argv[:1])
  for n, arg in enumerate(argv[1:], start=1):
    if arg == "--":
      return out + list(argv[n:])
    if arg.startswith("--"):
      name, eq, value = arg[2:].partition("=")
      arg = "--" + name.replace("-", "_") + eq + value
    out.append(arg)
  return out


def parse_mesh(spec: str) -> dict[str, int] | None:
  """"data=2,expert=4" -> {"data": 2, "expert": 4}; None unless both axes, positive sizes."""
  try:
    sizes = {k.strip(): int(v) for k, v in (part.split("=") for part in spec.split(","))}
  except ValueError:
    return None
  if set(sizes) != {"data", "expert"} or min(sizes.values()) < 1:
    return None
  return sizes


def make_mesh(spec: str | None, num_experts: int) -> Mesh:
  """A (data, expert) mesh with Auto axes (XLA propagates the FSDP shardings)."""
  num_devices = jax.device_count()
  if spec is None:
    expert = math.gcd(jax.local_device_count(), num_experts)
    sizes = {"data": num_devices // expert, "expert": expert}
  else:
    sizes = parse_mesh(spec)
    if sizes is None:
      raise RunError(f"--mesh must look like data=2,expert=4, got {spec!r}")
    if sizes["data"] * sizes["expert"] != num_devices:
      raise RunError(f"--mesh {spec!r} has {sizes['data'] * sizes['expert']} devices, this "
                     f"run has {num_devices}")
  if num_experts % sizes["expert"]:
    raise RunError(f"the expert axis ({sizes['expert']}) must divide the number of experts "
                   f"({num_experts})")
  return jax.make_mesh((sizes["data"], sizes["expert"]), ("data", "expert"),
                       axis_types=(AxisType.Auto, AxisType.Auto))


def build_params(args, config, mesh, dtype):
  """(graphdef, params): float32 parameters laid out by models/sharding.py, initialised or
  read from --init-from."""
  kwargs = dict(dtype=dtype, param_dtype=jnp.float32, backend=args.backend,
                recipe=args.recipe, mesh=mesh, remat=args.remat, attention=args.attention)
  if args.init_from:
    model = load_hf_checkpoint(args.init_from, fsdp_axis="data", num_layers=args.num_layers,
                               **kwargs)
    return nnx.split(model, nnx.Param)

  def build():
    return Qwen3Moe(config, rngs=nnx.Rngs(args.seed), **kwargs)

  graphdef, abstract = nnx.split(nnx.eval_shape(build), nnx.Param)
  shardings = param_shardings(abstract, mesh, fsdp_axis="data")
  params = jax.jit(lambda: nnx.state(build(), nnx.Param), out_shardings=shardings)()
  return graphdef, params


def make_optimizer(args) -> tuple[optax.GradientTransformation, optax.Schedule]:
  warmup = args.warmup_steps if args.warmup_steps is not None else max(1, args.steps // 10)
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=args.lr, warmup_steps=min(warmup, args.steps),
      decay_steps=max(args.steps, warmup + 1), end_value=args.lr * args.min_lr_ratio)
  decay_matrices = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)  # not norms
  tx = optax.chain(
      optax.clip_by_global_norm(args.clip_norm),
      optax.adamw(schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=args.weight_decay,
                  mask=decay_matrices))
  return tx, schedule


def init_optimizer_state(tx, params, mesh):
  """AdamW moments laid out like their parameters, step counters replicated."""
  replicated = NamedSharding(mesh, P())
  shardings = optax.tree_map_params(
      tx, lambda _, sharding: sharding, jax.eval_shape(tx.init, params),
      jax.tree.map(lambda x: x.sharding, params), transform_non_params=lambda _: replicated)
  return jax.jit(tx.init, out_shardings=shardings)(params)


class TrainState(NamedTuple):
  """What a training step carries and returns (make_train_step).

  params: the float32 master weights (the nnx.State of the model's nnx.Params).
  opt_state: the optimizer's state of params.
  compute: params as the model computes with them (models.compute_copy: bf16 but for the
    router's float32 weights), which the forward reads and the update rewrites from the new
    master; None: the forward reads params and casts them itself. Derived: checkpoints hold
    params and opt_state, train_state remakes the copy.
  """

  params: Any
  opt_state: Any
  compute: Any = None


def train_state(params, opt_state, compute_dtype=None) -> TrainState:
  """The TrainState of params and opt_state, with the compute copy for `compute_dtype` (None:
  without one) laid out like params."""
  if compute_dtype is None:
    return TrainState(params, opt_state)
  copy = jax.jit(compute_copy, static_argnums=1,
                 out_shardings=jax.tree.map(lambda x: x.sharding, params))
  return TrainState(params, opt_state, copy(params, jnp.dtype(compute_dtype)))


def resolve_defaults(args: types.SimpleNamespace, config, mesh: Mesh
                     ) -> tuple[types.SimpleNamespace, list[str]]:
  """args with --attention auto and an unset --ce-chunk or --compute-copy replaced by what
  this run uses, and the lines that say what was picked where it was not asked for."""
  attention, note = resolve_attention(args.attention, dtype=args.dtype,
                                      num_heads=config.num_heads,
                                      num_kv_heads=config.num_kv_heads,
                                      head_dim=config.head_dim)
  notes = [note] if note else []
  ce_chunk = args.ce_chunk
  if ce_chunk is None:
    ce_chunk = auto_ce_chunk(config.vocab_size, max(1, args.batch // mesh.size), args.seq_len)
    if ce_chunk:
      notes.append(f"cross-entropy in chunks of {ce_chunk} positions (the full float32 logits "
                   f"would take more than 1 GiB per device; --ce-chunk 0 keeps them)")
  compute_copy = args.dtype != "float32" if args.compute_copy is None else args.compute_copy
  if compute_copy and args.dtype == "float32":
    compute_copy = False
    notes.append("--compute-copy does nothing with --dtype float32 (the model computes with "
                 "its float32 master weights): no copy is kept")
  return types.SimpleNamespace(**{**vars(args), "attention": attention, "ce_chunk": ce_chunk,
                                  "compute_copy": compute_copy}), notes


def expert_imbalance(expert_load) -> float:
  """Routing imbalance of ModelAux.expert_load [layers, E]: the largest expert's share of the
  routed slots over the balanced share 1/E, in the worst layer. 1 is balanced; E / top_k
  means one expert took every token. 1.0 without MoE layers."""
  load = np.asarray(expert_load)
  return float(load.max(axis=-1).max() * load.shape[-1]) if load.size else 1.0


def jit_train_step(graphdef, tx, state: TrainState, mesh: Mesh, *, aux_coef: float,
                   z_coef: float, ce_chunk: int):
  """(jitted make_train_step, batch sharding): the state keeps its shardings (the compute
  copy its master's) and is donated, the batch is sharded over every mesh axis."""
  state_shardings = jax.tree.map(lambda x: x.sharding, state)
  batch_sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
  train_step = jax.jit(make_train_step(graphdef, tx, aux_coef, z_coef, ce_chunk),
                       in_shardings=(state_shardings, batch_sharding, batch_sharding),
                       out_shardings=(state_shardings, None), donate_argnums=0)
  return train_step, batch_sharding


def make_train_step(graphdef, tx, aux_coef: float, z_coef: float, ce_chunk: int):
  """(TrainState, inputs, targets) -> (TrainState, metrics).

  With a compute copy (state.compute) the forward reads it, so the gradients come in its
  dtypes; the update casts them to float32, updates the master and writes the next copy from
  it, elementwise work that XLA can fuse into the update's loops. Without one the forward
  reads the master.

  A step whose loss or gradient norm is not finite changes nothing: it returns the state it
  was given (the host then stops on the step's metrics, see train), so no NaN reaches the
  parameters, the optimizer moments, the copy or a checkpoint.
  """

  def loss_fn(params, inputs, targets):
    model = nnx.merge(graphdef, params)
    hidden, aux = model(inputs, return_aux=True, return_hidden=True)
    # ce_chunk 0 (full logits) is one chunk: the same loss, and its backward's GEMMs in bf16.
    ce = chunked_cross_entropy(hidden, model.head(), targets,
                               chunk=ce_chunk or targets.shape[1], mesh=model.mesh)
    with jax.named_scope("aux_losses"):
      layers = max(1, aux.z_loss.shape[0])  # mean over MoE layers (none: zero, not NaN)
      balance, z = jnp.sum(aux.load_balancing_loss) / layers, jnp.sum(aux.z_loss) / layers
    loss = ce + aux_coef * balance + z_coef * z
    return loss, dict(loss=loss, ce=ce, aux=balance, z=z, expert_load=aux.expert_load,
                      mean_logits=aux.mean_logits)

  def bias_update(params):
    config = nnx.merge(graphdef, params).config
    return config.router_bias_update_rate, config.router_bias_update_rule

  def train_step(state: TrainState, inputs, targets):
    params, opt_state, compute = state
    grads, metrics = jax.grad(loss_fn, has_aux=True)(
        params if compute is None else compute, inputs, targets)
    # The scope names what step profiles count as the optimizer (benchmarks/profile_step.py).
    with jax.named_scope("optimizer"):
      # The copy's gradients are bf16; the update is float32 (XLA can fuse the casts into it).
      grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
      updates, new_opt_state = tx.update(grads, opt_state, params)
      metrics["grad_norm"] = optax.global_norm(grads)
      finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
      keep = lambda new, old: jnp.where(finite, new, old)
      new_params = optax.apply_updates(params, updates)
      # Auxiliary-loss-free balancing (Qwen3MoeConfig.router_bias_update_rate > 0 only; no
      # gradient reaches the selection biases, this moves them): a no-op without them.
      new_params = update_selection_biases(new_params, metrics["expert_load"],
                                           *bias_update(params),
                                           mean_logits=metrics.pop("mean_logits"))
      new_params = jax.tree.map(keep, new_params, params)
      # From the kept master, in the copy's dtypes: after a bad step, the copy it was given.
      new_compute = None if compute is None else jax.tree.map(
          lambda p, c: p.astype(c.dtype), new_params, compute)
      return TrainState(new_params, jax.tree.map(keep, new_opt_state, opt_state),
                        new_compute), metrics

  return train_step


class Progress:
  """tqdm when installed, else a one-line text bar on stderr."""

  def __init__(self, total: int, initial: int, enabled: bool):
    self.total, self.n, self.bar = total, initial, None
    self.enabled = enabled
    if enabled:
      try:
        from tqdm import tqdm
        self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
      except ImportError:
        pass

  def update(self, postfix: str) -> None:
    self.n += 1
    if self.bar is not None:
      self.bar.set_postfix_str(postfix, refresh=False)
      self.bar.update(1)
    elif self.enabled:
      done = int(30 * self.n / self.total)
      print(f"\r[{'#' * done}{' ' * (30 - done)}] {self.n}/{self.total} {postfix}", end="",
            file=sys.stderr, flush=True)

  def write(self, line: str) -> None:
    if self.bar is not None:
      self.bar.write(line)
    else:
      print(("\n" if self.enabled else "") + line, flush=True)

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()
    elif self.enabled:
      print(file=sys.stderr)


def peak_flops(args) -> float | None:
  if args.peak_tflops:
    return args.peak_tflops * 1e12
  kind = jax.devices()[0].device_kind
  return next((v for k, v in PEAK_BF16_FLOPS.items() if k in kind), None)


def ep_workspaces() -> list:
  """The symmetric workspaces of this process's expert-parallel kernels (NVLink exchange)."""
  symmetric = sys.modules.get("jax_megamoe.symmetric")
  if symmetric is None:  # never imported: no EP kernel ran in this process
    return []
  return [*symmetric._cache.values(), *symmetric._retired]


def ep_workspaces_note() -> str:
  """For the run's last line: how many NVLink EP workspaces it used and how many of them span
  processes (CUDA IPC) and how many carry the fused kernel's pool, so that a multi-process run
  shows it took the NVLink path, not XLA's collectives, and a --backend fused run that its
  kernel did not take (backend fused runs those layers on cuda) shows it; "" when none."""
  workspaces = [w for w in ep_workspaces() if w.num_ranks > 1 and not w.virtual]
  if not workspaces:
    return ""
  across = sum(bool(w.multiprocess) for w in workspaces)
  fused = sum(w.fused_rows > 0 for w in workspaces)
  return (f"; NVLink EP workspaces {len(workspaces)} ({across} across processes, {fused} for "
          "the fused kernel)")


def ep_workspace_errors() -> list[str]:
  """Errors that expert-parallel kernels recorded in their symmetric workspaces (a wait on a
  peer GPU that timed out). Such a kernel returns normally after its timeout, so the step that
  ran it looks fine; the run must neither go on from it nor save it."""
  errors = []
  for workspace in ep_workspaces():
    try:
      workspace.check()
    except RuntimeError as e:
      errors.append(str(e))
  return errors


def read_metrics(path: str, up_to_step: int, log) -> list[dict]:
  """Rows 1..up_to_step of an earlier run segment (for --resume), each step once (the last
  row written for a step wins). A line cut short by an interrupt is dropped with a message;
  steps without a row are reported."""
  if not os.path.exists(path):
    log(f"--resume: no {path}; the curve starts at step {up_to_step + 1}")
    return []
  rows = {}
  with open(path) as f:
    for n, line in enumerate(f, start=1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except ValueError:
        log(f"{path} line {n} is not JSON (cut short by an interrupt?): dropped")
        continue
      step = row.get("step") if isinstance(row, dict) else None
      if isinstance(step, int) and 1 <= step <= up_to_step:
        rows[step] = row
  missing = [s for s in range(1, up_to_step + 1) if s not in rows]
  if missing:
    log(f"{path} has no rows for {len(missing)} of steps 1..{up_to_step} (first {missing[0]}); "
        f"the curve has gaps there")
  return [rows[s] for s in sorted(rows)]


def write_metrics(path: str, rows: list[dict]) -> None:
  """Replaces the metrics file with `rows` atomically (an interrupt leaves the old or the new)."""
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def main(argv: list[str]) -> None:
  """absl entry point; argv holds the arguments left after the flags (none are expected)."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:  # orbax logs every save at INFO; -v 0 shows them
    logging.set_verbosity(logging.WARNING)
  try:
    train(flags_to_args(flags.FLAGS))
  except (RunError, checkpoints_lib.CheckpointError) as e:
    sys.exit(f"train_qwen3_moe: {e}")


def model_config(args: types.SimpleNamespace):
  """The model's Qwen3MoeConfig: --config's (or --init-from's config.json) with the flags that
  override its fields."""
  config = (read_hf_config(args.init_from) if args.init_from else get_config(args.config))
  overrides = dict(num_layers=args.num_layers, router_bias_update_rate=args.router_bias_rate,
                   router_bias_update_rule=args.router_bias_rule,
                   router_selection_norm=args.router_selection_norm)
  return config.replace(**{k: v for k, v in overrides.items() if v is not None})


def train(args: types.SimpleNamespace) -> dict:
  """The run (args: parse_flags' result); returns the summary _report gives."""
  launch.init_distributed()
  is_main = jax.process_index() == 0
  log = print if is_main else (lambda *a, **k: None)

  config = model_config(args)
  mesh = make_mesh(args.mesh, config.num_experts)
  if args.batch % mesh.size:
    raise RunError(f"--batch {args.batch} must divide evenly over the {mesh.size} devices "
                   f"(every device holds its own sequences)")
  os.makedirs(args.out, exist_ok=True)
  checkpoints = checkpoints_lib.Checkpoints(os.path.join(args.out, "checkpoints"),
                                            every=args.checkpoint_every, keep=2, log=log)
  stop = args.steps if args.stop_at is None else min(args.stop_at, args.steps)
  start = 0
  if args.resume:
    start = checkpoints.latest_intact_step() or 0
    if not start:
      log(f"--resume: no checkpoint in {checkpoints.directory} yet, starting from step 0")
    if start >= stop:
      log(f"nothing to do: the newest checkpoint is step {start} and this run stops at step "
          f"{stop} (--steps {args.steps}" + (f", --stop-at {args.stop_at})" if args.stop_at
                                               else ")"))
      return dict(steps=0, nothing_to_do=True, resumed_from=start,
                  out=os.path.abspath(args.out))
  elif checkpoints.steps():
    raise RunError(f"{checkpoints.directory} already holds checkpoints (steps "
                   f"{checkpoints.steps()}) of an earlier run: pass --resume to continue it, "
                   f"or choose another --out. Nothing was changed")

  dtype = jnp.dtype(args.dtype)
  args, notes = resolve_defaults(args, config, mesh)
  for note in notes:
    log(note)
  aux_coef = config.router_aux_loss_coef if args.aux_loss_coef is None else args.aux_loss_coef
  tokens = data_lib.load_tokens(args.data, config.vocab_size, args.tokenizer)
  sampler = data_lib.BatchSampler(tokens, args.batch, args.seq_len, args.seed)
  log(f"model {args.config if not args.init_from else args.init_from}: {config.num_layers} "
      f"layers, hidden {config.hidden_size}, {config.num_experts} experts top-{config.top_k}, "
      f"{config.matmul_params_per_token() / 1e6:.2f}M active matmul params/token | "
      f"mesh {dict(mesh.shape)} on {jax.device_count()} {jax.devices()[0].platform} devices | "
      f"backend {args.backend}, recipe {args.recipe}, {args.dtype} compute"
      + (" (a compute copy of the weights)" if args.compute_copy else "")
      + f", remat {args.remat}, "
      f"attention {args.attention}, cross-entropy "
      + (f"in chunks of {args.ce_chunk} positions" if args.ce_chunk else "on full logits")
      + f" | data {tokens.size:,} tokens ({args.tokenizer})")

  graphdef, params = build_params(args, config, mesh, dtype)
  tx, schedule = make_optimizer(args)
  opt_state = init_optimizer_state(tx, params, mesh)
  metrics_path = os.path.join(args.out, "metrics.jsonl")
  history = []
  if start:
    restored = checkpoints.restore(start, {"params": params, "opt_state": opt_state})
    params, opt_state = restored["params"], restored["opt_state"]
    # Process 0 alone reads and rewrites the file (another reading it meanwhile could see it cut).
    history = read_metrics(metrics_path, start, log) if is_main else []
    log(f"resumed from step {start}")
  if is_main:
    write_metrics(metrics_path, history)
  state = train_state(params, opt_state, dtype if args.compute_copy else None)

  train_step, batch_sharding = jit_train_step(graphdef, tx, state, mesh, aux_coef=aux_coef,
                                              z_coef=args.z_loss_coef,
                                              ce_chunk=args.ce_chunk)

  def device_batch(step):
    inputs, targets = sampler(step)
    put = lambda a: jax.make_array_from_callback(a.shape, batch_sharding, lambda i: a[i])
    return put(inputs), put(targets)

  flops_per_step = config.train_flops_per_token(args.seq_len) * args.batch * args.seq_len
  peak = peak_flops(args)
  progress = Progress(args.steps, start, enabled=is_main and not args.no_progress)
  metrics_file = open(metrics_path, "a") if is_main else None
  t_start = time.perf_counter()
  last_time, compile_s, pending = None, None, None

  def newest_checkpoint() -> str:
    newest = checkpoints.newest_step()
    return (f"The newest checkpoint is step {newest} (continue from it with --resume)"
            if newest else "No checkpoint was saved")

  def stop_unless_ep_workspaces_are_clean(step, what):
    errors = ep_workspace_errors()
    if errors:
      raise RunError(f"step {step}: an expert-parallel kernel reported an error, so its results "
                     f"cannot be trusted and {what}: {'; '.join(errors)}. {newest_checkpoint()}")

  def finish(step, metrics):
    """Host side of one step, run once the next step is already queued."""
    nonlocal last_time, compile_s
    m = jax.device_get(metrics)
    now = time.perf_counter()
    dt = None if last_time is None else now - last_time
    if last_time is None:
      compile_s = now - t_start
    last_time = now
    load = np.asarray(m["expert_load"])
    row = dict(step=step, loss=float(m["loss"]), ce=float(m["ce"]), aux=float(m["aux"]),
               z=float(m["z"]), grad_norm=float(m["grad_norm"]), lr=float(schedule(step - 1)),
               imbalance=expert_imbalance(load), step_s=dt)
    if dt:
      row["tokens_per_s"] = args.batch * args.seq_len / dt
      row["tflops_per_device"] = flops_per_step / dt / jax.device_count() / 1e12
      row["mfu"] = row["tflops_per_device"] * 1e12 / peak if peak else None
    if step % args.log_every == 0 or step in (start + 1, stop):
      row["expert_load"] = np.round(load, 5).tolist()
      speed = (f"{row['tokens_per_s']:,.0f} tok/s | {row['tflops_per_device']:.3g} "
               f"TFLOP/s/device | MFU "
               + (f"{100 * row['mfu']:.1f}%" if row.get("mfu") else "n/a (--peak-tflops)")
               ) if dt else \
          f"compile+first step {compile_s:.1f}s"
      progress.write(f"step {step:5d} | loss {row['ce']:.4f} | aux {row['aux']:.4f} | "
                     f"z {row['z']:.2f} | grad norm {row['grad_norm']:.3f} | "
                     f"lr {row['lr']:.2e} | {speed} | imbalance {row['imbalance']:.2f}")
    history.append(row)
    if metrics_file:
      metrics_file.write(json.dumps(row) + "\n")
      metrics_file.flush()
    progress.update(f"loss {row['ce']:.3f} aux {row['aux']:.3f} "
                    + (f"{row['tokens_per_s']:,.0f} tok/s " if dt else "")
                    + f"imbalance {row['imbalance']:.2f}")
    if not (math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])):
      stop_unless_ep_workspaces_are_clean(step, "the step's loss is not finite")
      raise RunError(f"step {step}: the loss is {row['loss']} and the gradient norm "
                     f"{row['grad_norm']} (not finite); the step's update was not applied and "
                     f"nothing after it was saved. {newest_checkpoint()}; a lower --lr or "
                     f"--clip-norm may help")

  finished = False
  try:
    for step in range(start + 1, stop + 1):
      inputs, targets = device_batch(step)
      try:
        state, metrics = train_step(state, inputs, targets)
        if pending is not None:
          finish(*pending)
        pending = (step, metrics)
        if checkpoints.due(step, last=step == args.steps):
          # Row `step` is written, checked and on disk before checkpoint `step` is: a resume
          # from it finds every earlier row exactly once.
          finish(*pending)
          pending = None
          if metrics_file:
            os.fsync(metrics_file.fileno())
          stop_unless_ep_workspaces_are_clean(step, "it was not saved")
          # What model.eval() routes with, at this checkpoint's parameters (a model without
          # selection statistics: unchanged, nothing run).
          state = state._replace(params=calibrate_selection_stats(
              graphdef, state.params,
              (device_batch(s)[0]
               for s in range(max(1, step - args.calibration_batches + 1), step + 1))))
          checkpoints.save(step, {"params": state.params, "opt_state": state.opt_state})
      except jax.errors.JaxRuntimeError as e:
        raise RunError(f"step {step} (or the one before) failed on the device: "
                       f"{str(e).strip().splitlines()[0][:800]}. {newest_checkpoint()}") from e
    if pending is not None:
      finish(*pending)
    stop_unless_ep_workspaces_are_clean(stop, "the run's last steps cannot be trusted")
    finished = True
  finally:
    progress.close()
    if metrics_file:
      metrics_file.close()
    try:
      checkpoints.close()  # waits for the last checkpoint to be written and sealed
    except checkpoints_lib.CheckpointError as e:
      if finished:
        raise
      log(f"also: {e}")
  wall_s = time.perf_counter() - t_start
  return _report(args, config, history, wall_s, compile_s, is_main, log)


def _report(args, config, history, wall_s, compile_s, is_main, log) -> dict:
  """losses.json, the PNGs and a summary line; returns the summary."""
  steps = [r["step"] for r in history]
  # Single batches are noisy: the first and last ten steps' means summarise the run.
  ce = [r["ce"] for r in history]
  window = max(1, min(10, len(ce) // 4))
  summary = dict(first_loss=float(np.mean(ce[:window])) if ce else None,
                 last_loss=float(np.mean(ce[-window:])) if ce else None,
                 wall_s=wall_s, compile_s=compile_s, steps=len(steps),
                 out=os.path.abspath(args.out))
  if not is_main or not history:
    return summary
  speeds = [r["tokens_per_s"] for r in history if r.get("tokens_per_s")]
  summary["median_tokens_per_s"] = float(np.median(speeds)) if speeds else None
  curve = {key: [r[key] for r in history] for key in ("loss", "ce", "aux", "z", "grad_norm")}
  with open(os.path.join(args.out, "losses.json"), "w") as f:
    json.dump(dict(args=vars(args), config=config.__dict__ | {
        "mlp_only_layers": list(config.mlp_only_layers)}, step=steps, **curve,
        summary=summary), f)
  logged = [r for r in history if "expert_load" in r]
  plots.loss_curve(steps, curve["ce"], curve["aux"], os.path.join(args.out, "loss_curve.png"),
                   title=f"{args.config} | backend {args.backend} | batch {args.batch} x "
                         f"{args.seq_len}")
  if logged and np.asarray(logged[0]["expert_load"]).size:
    plots.expert_load_heatmap([r["step"] for r in logged],
                              np.stack([r["expert_load"] for r in logged]),
                              os.path.join(args.out, "expert_load.png"))
  speed = f", {summary['median_tokens_per_s']:,.0f} tok/s median" if speeds else ""
  log(f"done: {summary['steps']} steps in {wall_s:.1f}s (first step incl. compile "
      f"{compile_s:.1f}s{speed}); loss (mean of {window} steps) {summary['first_loss']:.4f} -> "
      f"{summary['last_loss']:.4f}; outputs in {args.out}{ep_workspaces_note()}")
  return summary


if __name__ == "__main__":
  define_flags(flags.FLAGS)
  app.run(main, flags_parser=lambda argv: app.parse_flags_with_usage(_underscored(argv)))

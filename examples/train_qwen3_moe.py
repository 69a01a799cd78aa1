"""Trains a Qwen3-style MoE language model with jax_megamoe.

  python examples/train_qwen3_moe.py            # tiny model, CPU, a few minutes, falling loss

Runs a jit-compiled train step over a (data, expert) device mesh: batch sharded over every
device, experts over `expert`, every other weight FSDP-sharded over `data`. AdamW on float32
master weights with bfloat16 compute, global-norm clipping, warm-up + cosine schedule, the
router's load-balancing and z losses. Several processes (one per host or per GPU) are joined
through jax.distributed when the environment says so, each driving the GPUs that launch.py picks
(JAX_COORDINATOR_ADDRESS + JAX_NUM_PROCESSES + JAX_PROCESS_ID, or SLURM / Open MPI;
MEGAMOE_LOCAL_DEVICE_IDS; see examples/README.md).

Writes to --out: metrics.jsonl (one line per step), losses.json (the whole curve, for
compare_losses.py), loss_curve.png, expert_load.png and checkpoints/ (orbax; --resume continues
from the latest one). The batches depend only on --seed and the step, so two runs that differ
only in --backend see the same data (loss parity).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

try:
  import jax_megamoe  # noqa: F401
except ImportError:  # run from a source checkout without installing
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jax_megamoe import BACKENDS, RECIPES  # noqa: E402
from jax_megamoe.models import CONFIGS, REMAT_POLICIES, Qwen3Moe, get_config  # noqa: E402
from jax_megamoe.models.hf_import import load_hf_checkpoint, read_hf_config  # noqa: E402
from jax_megamoe.models.losses import chunked_cross_entropy  # noqa: E402
from jax_megamoe.models.sharding import param_shardings  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import data as data_lib  # noqa: E402
import launch  # noqa: E402
import plots  # noqa: E402

# Dense bf16 peak FLOP/s per device for the MFU estimate (vendor figures), by device_kind.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12,
                   "B200": 2250e12, "GB200": 2500e12}


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--config", default="tiny", choices=sorted(CONFIGS))
  p.add_argument("--num-layers", type=int, default=None, help="override the layer count")
  p.add_argument("--backend", default="auto", choices=BACKENDS)
  p.add_argument("--recipe", default="none", choices=["none", *filter(None, RECIPES)])
  p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                 help="compute dtype (master weights are always float32)")
  p.add_argument("--steps", type=int, default=150)
  p.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
  p.add_argument("--seq-len", type=int, default=128)
  p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
  p.add_argument("--warmup-steps", type=int, default=None, help="default: 10%% of --steps")
  p.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr / peak lr")
  p.add_argument("--weight-decay", type=float, default=0.1)
  p.add_argument("--clip-norm", type=float, default=1.0, help="global gradient norm clip")
  p.add_argument("--aux-loss-coef", type=float, default=None,
                 help="load-balancing loss weight (default: the config's, 1e-3 as Qwen3)")
  p.add_argument("--z-loss-coef", type=float, default=1e-3, help="router z-loss weight")
  p.add_argument("--ce-chunk", type=int, default=0,
                 help="compute the cross-entropy this many positions at a time, never holding "
                      "the full [batch, seq, vocab] logits (for Qwen3's 152k vocabulary); "
                      "0: full logits")
  p.add_argument("--remat", default="none", choices=sorted(REMAT_POLICIES),
                 help="rematerialisation policy of every decoder layer")
  p.add_argument("--attention", default="xla", choices=["xla", "cudnn"],
                 help="attention kernel: xla (any platform) or cudnn (GPU flash attention, "
                      "bf16)")
  p.add_argument("--init-from", default=None, help="Hugging Face Qwen3-MoE checkpoint dir")
  p.add_argument("--data", default=None,
                 help="text file (byte tokens) or .npy token ids; default: the Python "
                      "standard library's sources, byte-tokenised (no download)")
  p.add_argument("--mesh", default=None,
                 help="e.g. data=2,expert=4; default: expert = the devices of one host "
                      "(at most the expert count), data = the rest")
  p.add_argument("--out", default="runs/qwen3_moe", help="run directory")
  p.add_argument("--checkpoint-every", type=int, default=100, help="0: never")
  p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
  p.add_argument("--stop-at", type=int, default=None,
                 help="stop after this step as if interrupted (the schedule still spans "
                      "--steps); with --resume, for testing preemption")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--log-every", type=int, default=25)
  p.add_argument("--peak-tflops", type=float, default=None,
                 help="per-device peak for MFU (default: known GPUs' bf16 peak)")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  args = p.parse_args(argv)
  for name in ("steps", "batch", "seq_len"):
    if getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
  if args.ce_chunk < 0 or (args.ce_chunk and args.seq_len % args.ce_chunk):
    p.error(f"--ce-chunk must be 0 or divide --seq-len {args.seq_len}, got {args.ce_chunk}")
  args.recipe = None if args.recipe == "none" else args.recipe
  return args


def make_mesh(spec: str | None, num_experts: int) -> Mesh:
  """A (data, expert) mesh with Auto axes (XLA propagates the FSDP shardings)."""
  num_devices = jax.device_count()
  if spec is None:
    expert = math.gcd(jax.local_device_count(), num_experts)
    sizes = {"data": num_devices // expert, "expert": expert}
  else:
    try:
      sizes = {k.strip(): int(v) for k, v in (part.split("=") for part in spec.split(","))}
    except ValueError:
      raise ValueError(f"--mesh must look like data=2,expert=4, got {spec!r}") from None
    if set(sizes) != {"data", "expert"}:
      raise ValueError(f"--mesh must name exactly the axes data and expert, got {spec!r}")
    if sizes["data"] * sizes["expert"] != num_devices:
      raise ValueError(f"--mesh {spec!r} has {sizes['data'] * sizes['expert']} devices, this "
                       f"run has {num_devices}")
  if num_experts % sizes["expert"]:
    raise ValueError(f"the expert axis ({sizes['expert']}) must divide the number of experts "
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


def make_train_step(graphdef, tx, aux_coef: float, z_coef: float, ce_chunk: int):
  """(params, opt_state, inputs, targets) -> (params, opt_state, metrics)."""

  def loss_fn(params, inputs, targets):
    model = nnx.merge(graphdef, params)
    if ce_chunk:
      hidden, aux = model(inputs, return_aux=True, return_hidden=True)
      ce = chunked_cross_entropy(hidden, model.head(), targets, chunk=ce_chunk)
    else:
      logits, aux = model(inputs, return_aux=True)
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    layers = max(1, aux.z_loss.shape[0])  # mean over MoE layers (none: zero, not NaN)
    balance, z = jnp.sum(aux.load_balancing_loss) / layers, jnp.sum(aux.z_loss) / layers
    loss = ce + aux_coef * balance + z_coef * z
    return loss, dict(loss=loss, ce=ce, aux=balance, z=z, expert_load=aux.expert_load)

  def train_step(params, opt_state, inputs, targets):
    grads, metrics = jax.grad(loss_fn, has_aux=True)(params, inputs, targets)
    updates, opt_state = tx.update(grads, opt_state, params)
    metrics["grad_norm"] = optax.global_norm(grads)
    return optax.apply_updates(params, updates), opt_state, metrics

  return train_step


class Checkpoints:
  """Orbax checkpoints of {params, opt_state} under <out>/checkpoints, keyed by step. Orbax is
  imported only when checkpoints are saved or resumed."""

  def __init__(self, directory: str, every: int, resume: bool):
    self.every, self.manager = every, None
    if every <= 0 and not resume:
      return
    import orbax.checkpoint as ocp
    self._ocp = ocp
    self.manager = ocp.CheckpointManager(
        os.path.abspath(directory),
        options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))

  def latest_step(self) -> int | None:
    return self.manager.latest_step() if self.manager else None

  def restore(self, step: int, like: dict) -> dict:
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like)
    return self.manager.restore(step, args=self._ocp.args.StandardRestore(abstract))

  def maybe_save(self, step: int, state: dict, last: bool) -> None:
    if self.every > 0 and (step % self.every == 0 or last):
      self.manager.save(step, args=self._ocp.args.StandardSave(state))

  def close(self) -> None:
    if self.manager:
      self.manager.wait_until_finished()
      self.manager.close()


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


def read_metrics(path: str, up_to_step: int) -> list[dict]:
  """Metrics of an earlier run segment (for --resume), steps 1..up_to_step."""
  if not os.path.exists(path):
    return []
  with open(path) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return [r for r in rows if r["step"] <= up_to_step]


def main(argv=None) -> dict:
  args = parse_args(argv)
  launch.init_distributed()
  is_main = jax.process_index() == 0
  log = print if is_main else (lambda *a, **k: None)

  config = (read_hf_config(args.init_from) if args.init_from else get_config(args.config))
  if args.num_layers is not None:
    config = config.replace(num_layers=args.num_layers)
  mesh = make_mesh(args.mesh, config.num_experts)
  if args.batch % mesh.size:
    raise ValueError(f"--batch {args.batch} must divide evenly over the {mesh.size} devices "
                     f"(every device holds its own sequences)")
  dtype = jnp.dtype(args.dtype)
  aux_coef = config.router_aux_loss_coef if args.aux_loss_coef is None else args.aux_loss_coef
  tokens = data_lib.load_tokens(args.data, config.vocab_size)
  sampler = data_lib.BatchSampler(tokens, args.batch, args.seq_len, args.seed)
  log(f"model {args.config if not args.init_from else args.init_from}: {config.num_layers} "
      f"layers, hidden {config.hidden_size}, {config.num_experts} experts top-{config.top_k}, "
      f"{config.matmul_params_per_token() / 1e6:.2f}M active matmul params/token | "
      f"mesh {dict(mesh.shape)} on {jax.device_count()} {jax.devices()[0].platform} devices | "
      f"backend {args.backend}, recipe {args.recipe}, {args.dtype} compute, remat {args.remat}, "
      f"attention {args.attention}"
      f" | data {tokens.size:,} tokens")

  graphdef, params = build_params(args, config, mesh, dtype)
  tx, schedule = make_optimizer(args)
  opt_state = init_optimizer_state(tx, params, mesh)
  os.makedirs(args.out, exist_ok=True)
  checkpoints = Checkpoints(os.path.join(args.out, "checkpoints"), args.checkpoint_every,
                            args.resume)
  metrics_path = os.path.join(args.out, "metrics.jsonl")
  start, history = 0, []
  if args.resume and checkpoints.latest_step() is not None:
    start = checkpoints.latest_step()
    state = checkpoints.restore(start, {"params": params, "opt_state": opt_state})
    params, opt_state = state["params"], state["opt_state"]
    # Process 0 alone reads and rewrites the file (another reading it meanwhile could see it cut).
    history = read_metrics(metrics_path, start) if is_main else []
    log(f"resumed from step {start}")
  elif args.resume:
    log(f"--resume: no checkpoint in {args.out}/checkpoints yet, starting from step 0")
  if is_main:
    with open(metrics_path, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in history)

  state_shardings = jax.tree.map(lambda x: x.sharding, (params, opt_state))
  batch_sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
  train_step = jax.jit(make_train_step(graphdef, tx, aux_coef, args.z_loss_coef,
                                       args.ce_chunk),
                       in_shardings=(*state_shardings, batch_sharding, batch_sharding),
                       out_shardings=(*state_shardings, None), donate_argnums=(0, 1))

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
               imbalance=float(load.max(axis=-1).max() * load.shape[-1]) if load.size else 1.0,
               step_s=dt)
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

  stop = args.steps if args.stop_at is None else min(args.stop_at, args.steps)
  for step in range(start + 1, stop + 1):
    inputs, targets = device_batch(step)
    params, opt_state, metrics = train_step(params, opt_state, inputs, targets)
    if pending is not None:
      finish(*pending)
    pending = (step, metrics)
    checkpoints.maybe_save(step, {"params": params, "opt_state": opt_state},
                           last=step == args.steps)
  if pending is not None:
    finish(*pending)
  progress.close()
  checkpoints.close()
  if metrics_file:
    metrics_file.close()
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
      f"{summary['last_loss']:.4f}; outputs in {args.out}")
  return summary


if __name__ == "__main__":
  main()

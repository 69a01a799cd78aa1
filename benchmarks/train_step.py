"""The example's training step (examples/train_qwen3_moe.py) at benchmark sizes, for
bench_step.py and profile_step.py: what they time and profile is what a training run executes
(its parameters and their FSDP layout, the bf16 compute copy of the weights, AdamW with
clipping, the loss with the cross-entropy chunked for large vocabularies and the router's aux
losses, the non-finite guard, the shardings and the donation), on one batch of the example's
default corpus or of random ids.

  setup = build(StepOptions(config="qwen3-30b-a3b", layers=8, tokens_per_gpu=16384))
  metrics = setup.run()          # one step; setup.state is replaced by the step's
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pathlib
import sys
import types
from typing import Any

REPO = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
# The learning rate of the step: issue 15's measured command (the example's own default, 3e-3,
# is tuned for the tiny config). Timing does not depend on it; the routing measured does.
LR = 3e-4


@dataclasses.dataclass(frozen=True)
class StepOptions:
  """config: a models.CONFIGS name; layers: decoder layers (0: the config's);
  tokens_per_gpu, seq: tokens per device per step and per sequence (seq must divide it);
  attention, ce_chunk: as the example's flags (auto / None pick as it does); data: "random"
  (uniform ids) or "corpus" (the example's default corpus); ep: expert-parallel size (0: all
  devices); compute_copy: the example's --compute-copy (on, as its bf16 default; off to
  measure the step that casts every weight and gradient itself); selection_norm: the routers'
  (Qwen3MoeConfig.router_selection_norm; None: the config's, "balance" for the published
  ones)."""

  config: str = "qwen3-30b-a3b"
  layers: int = 0
  tokens_per_gpu: int = 16384
  seq: int = 4096
  backend: str = "auto"
  recipe: str | None = None
  remat: str = "full"
  attention: str = "auto"
  ce_chunk: int | None = None
  data: str = "random"
  ep: int = 0
  seed: int = 0
  compute_copy: bool = True
  selection_norm: str | None = None


@functools.cache
def example_module() -> types.ModuleType:
  """examples/train_qwen3_moe.py, imported as a module (not run)."""
  if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))
  return importlib.import_module("train_qwen3_moe")


@dataclasses.dataclass
class StepSetup:
  """A built step. `args`: the example's arguments with attention and ce_chunk resolved;
  `notes`: what was picked for them; `step`: the jitted train step; `state`: the example's
  TrainState (master weights, optimizer state, compute copy), donated to and replaced by every
  step."""

  options: StepOptions
  config: Any
  mesh: Any
  args: types.SimpleNamespace
  notes: list[str]
  step: Any
  state: Any
  inputs: Any
  targets: Any

  @property
  def tokens_per_step(self) -> int:
    return int(self.inputs.size)

  def run(self, step_fn=None) -> dict:
    """One training step (with `step_fn`, e.g. the compiled step, instead of the jitted one);
    returns its metrics (device arrays)."""
    self.state, metrics = (step_fn or self.step)(self.state, self.inputs, self.targets)
    return metrics

  def imbalance(self, metrics) -> float:
    """The routing imbalance of a step's metrics (the example's expert_imbalance)."""
    import jax  # noqa: PLC0415
    return example_module().expert_imbalance(jax.device_get(metrics["expert_load"]))


def build(options: StepOptions) -> StepSetup:
  """Builds the model, optimizer state, batch and jitted step over all devices. Raises
  ValueError naming the option when the sizes do not fit."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  example = example_module()
  o = options
  if o.tokens_per_gpu < 1 or o.seq < 1 or o.tokens_per_gpu % o.seq:
    raise ValueError(f"tokens_per_gpu ({o.tokens_per_gpu}) must be a positive multiple of seq "
                     f"({o.seq}): every device holds whole sequences")
  if o.data not in ("corpus", "random"):
    raise ValueError(f"data must be 'corpus' or 'random', got {o.data!r}")
  devices = jax.device_count()
  ep = o.ep or devices
  if ep < 1 or devices % ep:
    raise ValueError(f"ep ({ep}) must divide the device count ({devices})")
  batch = o.tokens_per_gpu // o.seq * devices
  argv = ["bench", "--config", o.config, "--batch", str(batch), "--seq-len", str(o.seq),
          "--backend", o.backend, "--recipe", o.recipe or "none", "--remat", o.remat,
          "--attention", o.attention, "--mesh", f"data={devices // ep},expert={ep}",
          "--lr", str(LR), "--warmup-steps", "0", "--steps", "1000", "--seed", str(o.seed),
          "--compute-copy" if o.compute_copy else "--nocompute-copy"]
  if o.layers:
    argv += ["--num-layers", str(o.layers)]
  if o.ce_chunk is not None:
    argv += ["--ce-chunk", str(o.ce_chunk)]
  args = example.parse_flags(argv)
  config = example.get_config(o.config)
  if o.layers:
    config = config.replace(num_layers=o.layers)
  if o.selection_norm is not None:
    config = config.replace(router_selection_norm=o.selection_norm)
  mesh = example.make_mesh(args.mesh, config.num_experts)
  args, notes = example.resolve_defaults(args, config, mesh)
  graphdef, params = example.build_params(args, config, mesh, jnp.dtype(args.dtype))
  tx, _ = example.make_optimizer(args)
  state = example.train_state(params, example.init_optimizer_state(tx, params, mesh),
                              jnp.dtype(args.dtype) if args.compute_copy else None)
  step, batch_sharding = example.jit_train_step(
      graphdef, tx, state, mesh, aux_coef=config.router_aux_loss_coef,
      z_coef=args.z_loss_coef, ce_chunk=args.ce_chunk)
  if o.data == "corpus":
    tokens = example.data_lib.load_tokens(None, config.vocab_size)
    inputs, targets = example.data_lib.BatchSampler(tokens, batch, o.seq, o.seed)(1)
  else:
    ids = np.random.default_rng(o.seed).integers(0, config.vocab_size, (batch, o.seq + 1))
    inputs, targets = ids[:, :-1].astype(np.int32), ids[:, 1:].astype(np.int32)
  put = lambda a: jax.make_array_from_callback(a.shape, batch_sharding, lambda i: a[i])  # noqa: E731
  return StepSetup(options, config, mesh, args, notes, step, state, put(inputs), put(targets))

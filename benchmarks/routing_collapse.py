"""Routing collapse during training (issue 15 item 4), reproduced at a CPU-sized width.

Trains the qwen3-30b-a3b router shape (128 experts top-8, the config's init defaults) with a
narrower hidden size, narrow experts and few layers on the example's default corpus, with the
example's loss (chunked cross-entropy + aux * load-balancing + z * z-loss), optimizer (AdamW,
warm-up + cosine over --schedule-steps, clip 1.0) and learning rate, and logs every step's
per-layer imbalance (largest expert's share of the slots x E / k; 16 = one expert in every
token's top 8). Every --diag-every steps it also records, per MoE layer, what the router sees
and does: the logits' spread over experts and over tokens, logsumexp, the share of the router
input that is one direction common to every token and how much of the top expert's logit lead
that direction gives, and the gradient on the router from the cross-entropy, the aux loss and
the z-loss separately.

Remedies: --aux, --z, --router-lr-mult (the router's updates scaled), --bias-rate
(auxiliary-loss-free selection bias, DeepSeek-V3; Qwen3MoeConfig.router_bias_update_rate),
--selection-norm (the top k chosen from the logits centred or standardised over the batch).

  python3 benchmarks/routing_collapse.py --out /tmp/rc_default.json
  python3 benchmarks/routing_collapse.py --bias-rate 1e-2
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
import types

REPO = pathlib.Path(__file__).resolve().parent.parent
for p in (str(REPO), str(REPO / "examples")):
  if p not in sys.path:
    sys.path.append(p)


def parse_args(argv=None):
  from jax_megamoe.router import SELECTION_BIAS_RULES, SELECTION_NORMS  # noqa: PLC0415
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default="qwen3-30b-a3b")
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--hidden", type=int, default=256)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--kv-heads", type=int, default=2)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--moe-ffn", type=int, default=16)
  p.add_argument("--vocab", type=int, default=4096,
                 help="the corpus uses ids < 259; the rest of the head is learned down")
  p.add_argument("--seq", type=int, default=256)
  p.add_argument("--batch", type=int, default=2)
  p.add_argument("--steps", type=int, default=60)
  p.add_argument("--schedule-steps", type=int, default=150,
                 help="the schedule's length (the GPU command: --steps 150 --stop_at 60)")
  p.add_argument("--lr", type=float, default=3e-4)
  p.add_argument("--aux", type=float, default=None, help="default: the config's (1e-3)")
  p.add_argument("--z", type=float, default=1e-3)
  p.add_argument("--router-lr-mult", type=float, default=1.0)
  p.add_argument("--bias-rate", type=float, default=None,
                 help="selection-bias update rate (default: the config's)")
  p.add_argument("--selection-norm", choices=SELECTION_NORMS, default="none",
                 help="what the top k are chosen from (Qwen3MoeConfig.router_selection_norm)")
  p.add_argument("--balance", default=None,
                 help="selection norm balance's constants, NAME=VALUE,... (jax_megamoe.router."
                      "BALANCE_<NAME>, e.g. noise=0,load_steps=0,load_step_size=0.1:0.01; "
                      "default: the module's)")
  p.add_argument("--bias-rule", choices=SELECTION_BIAS_RULES, default=None,
                 help="selection-bias update rule (default: the config's)")
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument("--backend", default="reference", help="MoE backend (cuda on a GPU)")
  p.add_argument("--attention", default=None, choices=(None, "xla", "cudnn"))
  p.add_argument("--ce-chunk", type=int, default=0, help="0: full logits")
  p.add_argument("--data", default="corpus",
                 help="corpus (the example's default), words (the same corpus, word-level ids: "
                      "the example's --tokenizer words), random (uniform ids) or a .npy of ids")
  p.add_argument("--eval-norms", default="",
                 help="after training, the CE and imbalance of held-out batches with each of "
                      "these selection norms (comma-separated, e.g. none,balance,calibrated; "
                      "calibrated: the trained norm with statistics measured on --eval-batches "
                      "other batches and stored, model.eval()): "
                      "how the trained model routes at inference, without batch statistics")
  p.add_argument("--eval-batches", type=int, default=8)
  p.add_argument("--diag-every", type=int, default=10)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", help="JSON of the run")
  return p.parse_args(argv)


def build(args):
  import jax.numpy as jnp  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415
  from jax_megamoe.models import Qwen3Moe, get_config  # noqa: PLC0415
  overrides = dict(num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads,
                   num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                   moe_ffn_size=args.moe_ffn, vocab_size=args.vocab)
  if args.bias_rate is not None:
    overrides["router_bias_update_rate"] = args.bias_rate
  if args.bias_rule is not None:
    overrides["router_bias_update_rule"] = args.bias_rule
  overrides["router_selection_norm"] = args.selection_norm
  if args.balance:  # read when route() is traced
    from jax_megamoe import router  # noqa: PLC0415
    for item in args.balance.split(","):
      name, value = item.split("=")
      attr = "BALANCE_" + name.upper()
      old = getattr(router, attr)  # an unknown name fails here
      setattr(router, attr, tuple(map(float, value.split(":"))) if isinstance(old, tuple)
              else type(old)(value))
  config = get_config(args.config, **overrides)
  model = Qwen3Moe(config, rngs=nnx.Rngs(args.seed), dtype=jnp.dtype(args.dtype),
                   backend=args.backend, attention=args.attention)
  return config, model


def router_diagnostics(model, inputs):
  """Per MoE layer: statistics of the router's input and logits (see the module docstring)."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from jax_megamoe.models.qwen3 import rope_cos_sin  # noqa: PLC0415
  c = model.config
  seq = inputs.shape[1]
  cos, sin = rope_cos_sin(jnp.arange(seq)[None], c.head_dim, c.rope_theta)
  x = model.embed(inputs)
  rows = []
  for layer in model.layers:
    x = x + layer.attn(layer.input_norm(x), cos, sin)
    h = layer.post_attn_norm(x)
    if not layer.is_moe:
      x = x + layer.mlp(h)
      continue
    t = h.reshape(-1, c.hidden_size).astype(jnp.float32)
    w = layer.mlp.router[...].astype(jnp.float32)
    logits = t @ w
    bias = getattr(layer.mlp, "selection_bias", None)
    chosen = logits + (0 if bias is None else bias[...])
    _, ids = jax.lax.top_k(chosen, c.top_k)
    load = jnp.mean(jnp.sum(jax.nn.one_hot(ids, c.num_experts), 1), 0) / c.top_k
    top = jnp.argmax(load)
    common = jnp.mean(t, axis=0)                       # the direction shared by every token
    common_logits = common @ w                         # [E]: the logits' token-independent part
    own_logits = logits - common_logits                # what depends on the token
    kth = jnp.sort(logits, axis=-1)[:, -c.top_k]
    # the most frequent token id of the batch (the corpus: a space, 29% of its bytes)
    flat_ids = inputs.reshape(-1)
    frequent = jnp.argmax(jnp.bincount(flat_ids, length=c.vocab_size))
    is_frequent = (flat_ids == frequent).astype(jnp.float32)
    picks = jnp.sum(jax.nn.one_hot(ids, c.num_experts), 1)               # [T, E]
    rest_load = jnp.sum(picks * (1 - is_frequent)[:, None], 0) / (
        c.top_k * jnp.sum(1 - is_frequent))
    frequent_experts = jnp.sum(jnp.sum(picks * is_frequent[:, None], 0) > 0)
    _, own_ids = jax.lax.top_k(own_logits, c.top_k)
    own_load = jnp.mean(jnp.sum(jax.nn.one_hot(own_ids, c.num_experts), 1), 0) / c.top_k
    rows.append(dict(
        top_expert=top, top_load_x_E=load[top] * c.num_experts,
        lse=jnp.mean(jax.nn.logsumexp(logits, -1)),
        logit_std_over_experts=jnp.mean(jnp.std(logits, axis=1)),
        logit_std_over_tokens=jnp.mean(jnp.std(logits, axis=0)),
        common_share=jnp.linalg.norm(common) / jnp.sqrt(jnp.mean(jnp.sum(t * t, -1))),
        common_logit_std=jnp.std(common_logits),
        own_logit_std=jnp.sqrt(jnp.mean(jnp.var(own_logits, axis=1))),
        # the top expert's lead (its logit minus the mean logit, = its common part's), and
        # the imbalance if the common direction were removed from every token
        top_lead_common=common_logits[top] - jnp.mean(common_logits),
        imbalance_without_common=jnp.max(own_load) * c.num_experts,
        frequent_id_share=jnp.mean(is_frequent),
        top_slots_from_frequent_id=jnp.sum(picks[:, top] * is_frequent) / jnp.sum(picks[:, top]),
        imbalance_other_ids=jnp.max(rest_load) * c.num_experts,
        experts_used_by_frequent_id=frequent_experts,
        top_minus_kth=jnp.mean(logits[:, top] - kth),
        top_rank_in_common=jnp.sum(common_logits > common_logits[top]),
        router_col_norm_top=jnp.linalg.norm(w[:, top]),
        router_col_norm_median=jnp.median(jnp.linalg.norm(w, axis=0)),
        cos_col_top_common=jnp.dot(w[:, top], common)
        / (jnp.linalg.norm(w[:, top]) * jnp.linalg.norm(common)),
        bias_top=0.0 if bias is None else bias[...][top],
        bias_spread=0.0 if bias is None else jnp.std(bias[...]),
    ))
    y, _ = layer.mlp(h, return_aux=True)
    x = x + y
  return rows


def main(argv=None):
  args = parse_args(argv)
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  import optax  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415
  import data as data_lib  # noqa: PLC0415
  import train_qwen3_moe as example  # noqa: PLC0415
  from jax_megamoe.models import calibrate_selection_stats, update_selection_biases  # noqa: PLC0415
  from jax_megamoe.models.losses import chunked_cross_entropy  # noqa: PLC0415

  config, model = build(args)
  aux_coef = config.router_aux_loss_coef if args.aux is None else args.aux
  rate = config.router_bias_update_rate
  graphdef, params = nnx.split(model, nnx.Param)
  tx, schedule = example.make_optimizer(types.SimpleNamespace(
      lr=args.lr, steps=args.schedule_steps, warmup_steps=None, min_lr_ratio=0.1,
      weight_decay=0.1, clip_norm=1.0))
  opt_state = tx.init(params)
  if args.data in ("corpus", "words"):
    tokens = data_lib.load_tokens(None, config.vocab_size,
                                  "words" if args.data == "words" else "bytes")
  elif args.data == "random":
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, 1 << 20).astype(np.int32)
  else:
    tokens = data_lib.load_tokens(args.data, config.vocab_size)
  sampler = data_lib.BatchSampler(tokens, args.batch, args.seq, args.seed)

  def losses(params, inputs, targets):
    m = nnx.merge(graphdef, params)
    hidden, aux = m(inputs, return_aux=True, return_hidden=True)
    ce = chunked_cross_entropy(hidden, m.head(), targets,
                               chunk=args.ce_chunk or targets.shape[1], mesh=m.mesh)
    return ce, jnp.mean(aux.load_balancing_loss), jnp.mean(aux.z_loss), aux

  def loss_fn(params, inputs, targets):
    ce, balance, z, aux = losses(params, inputs, targets)
    loss = ce + aux_coef * balance + args.z * z
    return loss, dict(loss=loss, ce=ce, aux=balance, z=z, expert_load=aux.expert_load,
                      mean_logits=aux.mean_logits)

  def is_router(path):
    return any(getattr(k, "key", None) == "router" for k in path)

  @jax.jit
  def step(params, opt_state, inputs, targets):
    grads, metrics = jax.grad(loss_fn, has_aux=True)(params, inputs, targets)
    updates, opt_state = tx.update(grads, opt_state, params)
    if args.router_lr_mult != 1.0:
      updates = jax.tree_util.tree_map_with_path(
          lambda p, u: u * args.router_lr_mult if is_router(p) else u, updates)
    params = optax.apply_updates(params, updates)
    params = update_selection_biases(params, metrics["expert_load"], rate,
                                     config.router_bias_update_rule,
                                     mean_logits=metrics.pop("mean_logits"))
    metrics["grad_norm"] = optax.global_norm(grads)
    return params, opt_state, metrics

  @jax.jit
  def diag(params, inputs, targets):
    """Router statistics and the router's gradient from each loss term (unweighted and
    weighted by its coefficient), per MoE layer."""
    rows = router_diagnostics(nnx.merge(graphdef, params), inputs)
    terms = {}
    for n, (name, coef) in enumerate((("ce", 1.0), ("aux", aux_coef), ("z", args.z))):
      g = jax.grad(lambda p, n=n: losses(p, inputs, targets)[n])(params)
      m = nnx.merge(graphdef, g)
      terms[name] = [coef * jnp.linalg.norm(layer.mlp.router[...])
                     for layer in m.layers if layer.is_moe]
      terms[name + "_top_col"] = [
          coef * jnp.linalg.norm(layer.mlp.router[...][:, row["top_expert"]])
          for layer, row in zip([l for l in m.layers if l.is_moe], rows)]
    for i, row in enumerate(rows):
      for name, values in terms.items():
        row[f"grad_{name}"] = values[i]
    return rows

  history, diags = [], []
  t0 = time.perf_counter()
  for s in range(1, args.steps + 1):
    inputs, targets = (jnp.asarray(a) for a in sampler(s))
    if args.diag_every and (s == 1 or s % args.diag_every == 0):
      rows = jax.device_get(diag(params, inputs, targets))
      rows = [{k: float(v) for k, v in r.items()} for r in rows]
      diags.append(dict(step=s, layers=rows))
      for i, r in enumerate(rows):
        print(f"  diag step {s} layer {i}: top e{int(r['top_expert'])} load x E "
              f"{r['top_load_x_E']:.2f} | lse {r['lse']:.2f} | logit std experts "
              f"{r['logit_std_over_experts']:.3f} tokens {r['logit_std_over_tokens']:.3f} | "
              f"common share {r['common_share']:.2f}, common/own logit std "
              f"{r['common_logit_std']:.3f}/{r['own_logit_std']:.3f} | top lead "
              f"{r['top_lead_common']:.3f}, imbalance w/o common "
              f"{r['imbalance_without_common']:.2f}, most frequent id: {r['frequent_id_share']:.2f} "
              f"of tokens, {r['top_slots_from_frequent_id']:.2f} of the top expert's, uses "
              f"{int(r['experts_used_by_frequent_id'])} experts; imbalance over the other ids "
              f"{r['imbalance_other_ids']:.2f} | top-kth "
              f"{r['top_minus_kth']:.3f}, rank in common {int(r['top_rank_in_common'])} | "
              f"col norm {r['router_col_norm_top']:.3f}/{r['router_col_norm_median']:.3f} "
              f"cos(col, common) {r['cos_col_top_common']:.2f} | grad ce {r['grad_ce']:.2e} "
              f"aux {r['grad_aux']:.2e} z {r['grad_z']:.2e} | top col: ce "
              f"{r['grad_ce_top_col']:.2e} aux {r['grad_aux_top_col']:.2e} | bias top "
              f"{r['bias_top']:.3f} spread {r['bias_spread']:.3f}", flush=True)
    params, opt_state, m = step(params, opt_state, inputs, targets)
    m = jax.device_get(m)
    load = np.asarray(m["expert_load"])
    per_layer = (load.max(-1) * load.shape[-1]).tolist()
    row = dict(step=s, ce=float(m["ce"]), aux=float(m["aux"]), z=float(m["z"]),
               grad_norm=float(m["grad_norm"]), imbalance=example.expert_imbalance(load),
               imbalance_per_layer=per_layer, top_expert=load.argmax(-1).tolist())
    history.append(row)
    if s in (1, 2, 5) or s % 5 == 0:
      print(f"step {s:3d} | ce {row['ce']:.4f} | aux {row['aux']:.3f} | z {row['z']:.2f} | "
            f"imbalance {row['imbalance']:.2f} per layer "
            + " ".join(f"{v:.1f}(e{e})" for v, e in zip(per_layer, row["top_expert"]))
            + f" | {time.perf_counter() - t0:.0f}s", flush=True)
  ce = [r["ce"] for r in history]
  summary = dict(
      imbalance={s: history[s - 1]["imbalance"] for s in (1, 10, 20, 50, 60)
                 if s <= len(history)},
      ce_last=ce[-1], ce_last10=float(np.mean(ce[-10:])), wall_s=time.perf_counter() - t0)
  if args.eval_norms:
    # Held-out batches: windows drawn with another seed (the byte corpus has 8.4M tokens; 50
    # steps read 26k).
    held_out = data_lib.BatchSampler(tokens, args.batch, args.seq, args.seed + 1)
    summary["eval"] = {}
    for norm in args.eval_norms.split(","):
      eval_params = params
      if norm == "calibrated":  # the trained norm, statistics from a third seed's batches
        calib = data_lib.BatchSampler(tokens, args.batch, args.seq, args.seed + 2)
        eval_params = calibrate_selection_stats(
            graphdef, params, (jnp.asarray(calib(b)[0])
                               for b in range(1, args.eval_batches + 1)))
      model = nnx.merge(graphdef, eval_params)
      if norm == "calibrated":
        model.eval()
      else:
        for layer in model.layers:
          if layer.is_moe:
            layer.mlp.selection_norm = norm
      g_eval, p_eval = nnx.split(model, nnx.Param)

      @jax.jit
      def evaluate(p, inputs, targets, g_eval=g_eval):
        m = nnx.merge(g_eval, p)
        hidden, aux = m(inputs, return_aux=True, return_hidden=True)
        return chunked_cross_entropy(hidden, m.head(), targets,
                                     chunk=args.ce_chunk or targets.shape[1],
                                     mesh=m.mesh), aux.expert_load

      ces, imbalances = [], []
      for b in range(1, args.eval_batches + 1):
        inputs, targets = (jnp.asarray(a) for a in held_out(b))
        ce_b, load = jax.device_get(evaluate(p_eval, inputs, targets))
        ces.append(float(ce_b))
        imbalances.append(example.expert_imbalance(np.asarray(load)))
      summary["eval"][norm] = dict(ce=float(np.mean(ces)), imbalance=float(np.mean(imbalances)))
      print(f"eval with selection_norm {norm}: ce {np.mean(ces):.4f}, imbalance "
            f"{np.mean(imbalances):.2f} (mean over {args.eval_batches} held-out batches)",
            flush=True)
  print(json.dumps(summary))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(dict(args=vars(args), summary=summary, history=history, diags=diags), f)
  return summary


if __name__ == "__main__":
  main()

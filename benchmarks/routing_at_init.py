"""Routing of a freshly initialised Qwen3Moe, layer by layer: why it is (or is not) degenerate.

For each decoder layer, at initialisation, on one batch: the rms of the attention output and
the share of it that is one vector common to every token (|mean over tokens| / rms), the mean
cosine between tokens' normed hidden states (what the router sees), the router logits' spread
over experts and over tokens, and the routing imbalance (largest expert's share of the slots
over 1/E; 1 = balanced, E/top_k = one expert in every token's top k).

  python3 benchmarks/routing_at_init.py                          30B shapes, 4 layers, corpus
  python3 benchmarks/routing_at_init.py --init all-0.02          HF's initializer_range only
  python3 benchmarks/routing_at_init.py --data random --vocab 151936

Runs anywhere; on CPU the experts run one at a time over their own rows (exact, eager), since
XLA:CPU's ragged_dot computes every expert for every row. The vocabulary defaults to 512 (the
byte corpus uses ids < 259; other rows of the embedding are never read).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
  sys.path.append(str(REPO))

INITS = {"default": {}, "all-0.02": dict(embed_init_std=0.02, depth_scaled_init=False)}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default="qwen3-30b-a3b")
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--seq", type=int, default=2048)
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--vocab", type=int, default=512)
  p.add_argument("--moe-ffn", type=int, help="expert width (default: the config's)")
  p.add_argument("--init", choices=sorted(INITS), default="default",
                 help="default: the model's (embedding N(0,1), depth-scaled outputs); "
                      "all-0.02: every weight N(0, 0.02^2)")
  p.add_argument("--data", choices=("corpus", "random"), default="corpus")
  p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", help="JSON of the statistics")
  return p.parse_args(argv)


def _token_stats(x):
  """rms, |mean over tokens| / rms, mean cosine between (up to 512) tokens."""
  import jax.numpy as jnp  # noqa: PLC0415
  x = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
  rms = jnp.sqrt(jnp.mean(x * x))
  common = jnp.sqrt(jnp.mean(jnp.mean(x, axis=0) ** 2)) / rms
  unit = x[:: max(1, x.shape[0] // 512)]
  unit = unit / jnp.linalg.norm(unit, axis=1, keepdims=True)
  n = unit.shape[0]
  cos = (jnp.sum(unit @ unit.T) - n) / (n * n - n)
  return float(rms), float(common), float(cos)


def _experts(mlp, h, topk_ids, topk_weights):
  """The MoE layer's output, expert by expert over its own rows (exact, outside jit)."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  ids = np.asarray(topk_ids)
  out = jnp.zeros(h.shape, jnp.float32)
  w_gate_up, w_down = mlp.w_gate_up[...].astype(h.dtype), mlp.w_down[...].astype(h.dtype)
  ffn = w_down.shape[1]
  for e in np.unique(ids):
    rows, slots = np.nonzero(ids == e)
    gate_up = (h[rows] @ w_gate_up[e]).astype(jnp.float32)
    hidden = (jax.nn.silu(gate_up[:, :ffn]) * gate_up[:, ffn:]).astype(h.dtype)
    y = (hidden @ w_down[e]).astype(jnp.float32)
    out = out.at[rows].add(y * topk_weights[rows, slots][:, None])
  return out.astype(h.dtype)


def layer_statistics(args) -> dict:
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415
  from jax_megamoe.models import Qwen3Moe, get_config  # noqa: PLC0415
  from jax_megamoe.models.qwen3 import rope_cos_sin  # noqa: PLC0415
  from jax_megamoe.router import route  # noqa: PLC0415

  sys.path.insert(0, str(REPO / "examples"))
  import data as data_lib  # noqa: PLC0415
  sys.path.pop(0)

  overrides = dict(num_layers=args.layers, vocab_size=args.vocab, **INITS[args.init])
  if args.moe_ffn:
    overrides["moe_ffn_size"] = args.moe_ffn
  config = get_config(args.config, **overrides)
  dtype = jnp.dtype(args.dtype)
  model = Qwen3Moe(config, rngs=nnx.Rngs(args.seed), dtype=dtype, param_dtype=dtype)
  if args.data == "corpus":
    tokens = data_lib.load_tokens(None, config.vocab_size)
    ids, _ = data_lib.BatchSampler(tokens, args.batch, args.seq, args.seed)(1)
  else:
    ids = np.random.default_rng(args.seed).integers(0, config.vocab_size,
                                                    (args.batch, args.seq))
  cos, sin = rope_cos_sin(jnp.arange(args.seq)[None], config.head_dim, config.rope_theta)
  attention = nnx.jit(lambda layer, x: layer.attn(layer.input_norm(x), cos, sin))
  x = model.embed(jnp.asarray(ids, jnp.int32))
  rms, common, mean_cos = _token_stats(x)
  stats = dict(embedding=dict(rms=rms, common=common, mean_cos=mean_cos), layers=[])
  for layer in model.layers:
    a = attention(layer, x)
    x = x + a
    h = layer.post_attn_norm(x)
    row = dict(zip(("attn_rms", "attn_common"), _token_stats(a)[:2]))
    row["hidden_mean_cos"] = _token_stats(h)[2]
    tokens = h.reshape(-1, config.hidden_size)
    if layer.is_moe:
      logits = tokens.astype(jnp.float32) @ layer.mlp.router[...].astype(jnp.float32)
      weights, topk_ids, aux = route(logits, config.top_k, norm_topk_prob=config.norm_topk_prob)
      row.update(logit_std_over_experts=float(jnp.mean(jnp.std(logits, axis=1))),
                 logit_std_over_tokens=float(jnp.mean(jnp.std(logits, axis=0))),
                 imbalance=float(jnp.max(aux.expert_load)) * config.num_experts)
      y = _experts(layer.mlp, tokens, topk_ids, weights).reshape(x.shape)
    else:
      y = layer.mlp(h)
    row["mlp_rms"] = _token_stats(y)[0]
    x = x + y
    stats["layers"].append(row)
  return dict(config=args.config, num_layers=args.layers, seq=args.seq, batch=args.batch,
              init=args.init, data=args.data, vocab=args.vocab, dtype=args.dtype, **stats)


def main(argv=None) -> dict:
  args = parse_args(argv)
  stats = layer_statistics(args)
  e = stats["embedding"]
  print(f"{args.config} x {args.layers} layers, init {args.init}, {args.data} data, "
        f"{args.batch} x {args.seq} tokens: embedding rms {e['rms']:.3f} (mean cos "
        f"{e['mean_cos']:.2f})")
  print(f"{'layer':>5s} {'attn rms':>9s} {'common':>7s} {'h cos':>6s} {'logit sd/e':>10s} "
        f"{'sd/tok':>7s} {'mlp rms':>8s} {'imbalance':>9s}")
  for i, r in enumerate(stats["layers"]):
    print(f"{i:5d} {r['attn_rms']:9.3f} {r['attn_common']:7.2f} {r['hidden_mean_cos']:6.2f} "
          f"{r.get('logit_std_over_experts', float('nan')):10.2f} "
          f"{r.get('logit_std_over_tokens', float('nan')):7.2f} {r['mlp_rms']:8.3f} "
          f"{r.get('imbalance', float('nan')):9.2f}")
  if args.out:
    pathlib.Path(args.out).write_text(json.dumps(stats, indent=1))
  return stats


if __name__ == "__main__":
  main()

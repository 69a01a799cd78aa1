"""Routing at initialisation (issue 15), at the published router width: Qwen3-30B-A3B's hidden
size, attention and 128 experts top-8 (3 layers, narrow experts to stay fast). With the
defaults (embedding N(0, 1), depth-scaled residual outputs) tokens spread over the experts at
step 0; with every weight at 0.02 (HF's initializer_range throughout) each attention output,
nearly one vector shared by all tokens, swamps the embedding and one expert takes most tokens
-- the bounds below fail on that init, which the second test checks."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jax_megamoe.models import Qwen3Moe, get_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import data as data_lib  # noqa: E402
from train_qwen3_moe import expert_imbalance  # noqa: E402

sys.path.pop(0)

# Qwen3's routing (the published configs' "balance" would even out any init): what the
# initialisation alone gives.
CONFIG = get_config("qwen3-30b-a3b", num_layers=3, vocab_size=4096, moe_ffn_size=16,
                    router_selection_norm="none")
ALL_AT_0_02 = dict(embed_init_std=0.02, depth_scaled_init=False)
BATCH, SEQ = 2, 256
# Imbalance: the largest expert's share over 1/128, worst layer (16 = one expert in every
# token's top 8). Measured: defaults 1.7 (random ids) and 6.1 (corpus); all at 0.02: 10.5, 13.5.
# The corpus bound is high because 29% of its bytes are spaces: routed by token alone, they
# give ~6 whatever the init (examples/README.md, "Routing at initialisation").
RANDOM_BOUND, CORPUS_BOUND = 3.0, 9.0


def _imbalances(config) -> tuple[float, float]:
  """(imbalance on uniform random ids, on the example's default corpus) at initialisation."""
  model = Qwen3Moe(config, rngs=nnx.Rngs(0), dtype=jnp.float32, backend="reference")
  load = nnx.jit(lambda m, ids: m(ids, return_aux=True)[1].expert_load)
  random_ids = jax.random.randint(jax.random.key(0), (BATCH, SEQ), 0, config.vocab_size)
  corpus = data_lib.load_tokens(None, config.vocab_size)
  corpus_ids, _ = data_lib.BatchSampler(corpus, BATCH, SEQ, seed=0)(1)
  return (expert_imbalance(load(model, random_ids)),
          expert_imbalance(load(model, jnp.asarray(corpus_ids))))


def test_default_init_routes_near_balanced():
  on_random, on_corpus = _imbalances(CONFIG)
  assert on_random < RANDOM_BOUND
  assert on_corpus < CORPUS_BOUND


@pytest.mark.slow  # the same model again, only to show that the bounds catch the old init
def test_bounds_fail_on_the_degenerate_init():
  on_random, on_corpus = _imbalances(CONFIG.replace(**ALL_AT_0_02))
  assert on_random > RANDOM_BOUND * 2 and on_corpus > CORPUS_BOUND


def test_init_std_fields():
  config = get_config("qwen3-30b-a3b")
  assert config.embedding_init_std == 1.0
  assert config.output_init_std == pytest.approx(0.02 / (2 * 48) ** 0.5)
  assert config.replace(**ALL_AT_0_02).output_init_std == 0.02
  assert config.replace(tie_word_embeddings=True).embedding_init_std == 0.02  # it is the head
  model = Qwen3Moe(CONFIG, rngs=nnx.Rngs(0), dtype=jnp.float32)
  assert float(jnp.std(model.embed.embedding[...])) == pytest.approx(1.0, rel=0.02)
  out = CONFIG.output_init_std
  assert float(jnp.std(model.layers[0].attn.o_proj.kernel[...])) == pytest.approx(out, rel=0.02)
  assert float(jnp.std(model.layers[0].mlp.w_down[...])) == pytest.approx(out, rel=0.02)
  assert float(jnp.std(model.layers[0].mlp.router[...])) == pytest.approx(0.02, rel=0.02)
  with pytest.raises(ValueError, match="embed_init_std must be a positive number, got 0"):
    CONFIG.replace(embed_init_std=0)


def test_routing_at_init_tool_runs_and_agrees_with_the_model(tmp_path):
  """benchmarks/routing_at_init.py (the per-layer statistics of examples/README.md) at tiny
  sizes: its experts-one-at-a-time forward routes as the model does."""
  sys.path.append(ROOT)
  from benchmarks import routing_at_init  # noqa: PLC0415
  stats = routing_at_init.main(["--config", "tiny", "--layers", "2", "--seq", "64",
                                "--vocab", "320", "--dtype", "float32", "--out",
                                str(tmp_path / "stats.json")])
  assert len(stats["layers"]) == 2 and (tmp_path / "stats.json").exists()
  config = get_config("tiny", num_layers=2)
  model = Qwen3Moe(config, rngs=nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)
  corpus = data_lib.load_tokens(None, config.vocab_size)
  ids, _ = data_lib.BatchSampler(corpus, 1, 64, seed=0)(1)
  load = model(jnp.asarray(ids), return_aux=True)[1].expert_load
  want = [float(jnp.max(row)) * config.num_experts for row in load]
  assert [r["imbalance"] for r in stats["layers"]] == pytest.approx(want, rel=1e-5)

"""The training step's defaults for speed (issue 15): cross-entropy chunking for large
vocabularies, cuDNN flash attention where it runs (else XLA, saying why), and the example's
routing-imbalance figure."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_megamoe.models import get_config
from jax_megamoe.models.attention_impl import resolve_attention
from jax_megamoe.models.losses import auto_ce_chunk

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))
import train_qwen3_moe as example  # noqa: E402

sys.path.pop(0)


def test_auto_ce_chunk_keeps_small_logits_and_chunks_large_vocabularies():
  tiny, big = get_config("tiny"), get_config("qwen3-30b-a3b")
  assert auto_ce_chunk(tiny.vocab_size, 16, 128) == 0  # the README's first command
  # 30B at 4 x 4,096 tokens per GPU: 10 GB of logits; 256 positions take 622 MB.
  chunk = auto_ce_chunk(big.vocab_size, 4, 4096)
  assert chunk == 256 and 4096 % chunk == 0
  assert 4 * big.vocab_size * 4 * chunk <= 1 << 30 < 4 * big.vocab_size * 4 * 2 * chunk
  assert auto_ce_chunk(big.vocab_size, 4, 1000) == 250  # a divisor of the sequence
  assert auto_ce_chunk(big.vocab_size, 4096, 7) == 1  # nothing fits: one position at a time
  with pytest.raises(ValueError, match="seq_len must be a positive int, got 0"):
    auto_ce_chunk(10, 1, 0)


def test_attention_auto_falls_back_with_a_reason_off_gpu():
  cpu = jax.devices("cpu")[0]
  kw = dict(dtype=jnp.bfloat16, num_heads=4, num_kv_heads=2, head_dim=32, device=cpu)
  impl, note = resolve_attention("auto", **kw)
  assert impl == "xla" and note == ("attention auto: xla (cuDNN flash attention needs an "
                                    "NVIDIA GPU; this run is on cpu)")
  assert resolve_attention("xla", **kw) == ("xla", None)
  assert resolve_attention("cudnn", **kw) == ("cudnn", None)  # asked for: not second-guessed
  with pytest.raises(ValueError, match="attention must be one of .* got 'flash'"):
    resolve_attention("flash", **kw)


@pytest.mark.gpu
def test_attention_auto_picks_cudnn_on_a_gpu_and_says_why_not_in_float32():
  gpu = jax.devices("gpu")[0]
  kw = dict(num_heads=32, num_kv_heads=4, head_dim=128, device=gpu)
  assert resolve_attention("auto", dtype=jnp.bfloat16, **kw)[0] == "cudnn"
  impl, note = resolve_attention("auto", dtype=jnp.float32, **kw)
  assert impl == "xla" and "float32" in note


def test_example_resolves_its_defaults_and_says_so():
  args = example.parse_flags(["train", "--config", "qwen3-30b-a3b", "--batch", "8",
                              "--seq-len", "4096"])
  assert (args.attention, args.ce_chunk) == ("auto", None)
  config = get_config("qwen3-30b-a3b")
  mesh = example.make_mesh("data=2,expert=4", config.num_experts)  # 8 virtual devices
  resolved, notes = example.resolve_defaults(args, config, mesh)
  assert resolved.attention == ("cudnn" if jax.devices()[0].platform == "gpu" else "xla")
  # One sequence per device: 4,096 x 151,936 float32 logits = 2.5 GB; 1,024 positions fit.
  assert resolved.ce_chunk == 1024
  assert any(n.startswith("cross-entropy in chunks of 1024 positions") for n in notes)
  assert (args.attention, args.ce_chunk) == ("auto", None)  # the caller's are unchanged
  explicit, notes = example.resolve_defaults(
      example.parse_flags(["train", "--ce-chunk", "0", "--attention", "xla"]), config, mesh)
  assert (explicit.attention, explicit.ce_chunk, notes) == ("xla", 0, [])


def test_expert_imbalance_is_the_worst_layers_top_share_over_the_balanced_one():
  balanced = np.full((2, 8), 1 / 8)
  assert example.expert_imbalance(balanced) == pytest.approx(1.0)
  skewed = balanced.copy()
  skewed[1] = [0.5, 0.5, 0, 0, 0, 0, 0, 0]
  assert example.expert_imbalance(skewed) == pytest.approx(4.0)
  assert example.expert_imbalance(np.zeros((0, 8))) == 1.0

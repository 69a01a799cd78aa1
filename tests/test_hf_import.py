"""Hugging Face import: a tiny random transformers Qwen3MoeForCausalLM, saved with
save_pretrained, gives the same logits in jax_megamoe's Qwen3Moe (CPU, fp32)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jax_megamoe.models import hf_import  # noqa: E402
from jax_megamoe.models.hf_import import load_hf_checkpoint  # noqa: E402

# Small but with every Qwen3-MoE feature that changes the maths: head_dim != hidden / heads,
# GQA, a dense layer among MoE layers, renormalised or raw top-k weights, tied or untied head.
BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
VARIANTS = {
    "dense_layer_untied_norm_topk": dict(mlp_only_layers=[1], norm_topk_prob=True,
                                         tie_word_embeddings=False),
    # Also saved in several shards with an index (model.safetensors.index.json).
    "sparse_step2_tied_raw_topk_sharded": dict(decoder_sparse_step=2, norm_topk_prob=False,
                                               tie_word_embeddings=True,
                                               max_shard_size="20KB"),
}


def _save_random_model(directory, dtype=torch.float32, max_shard_size=None, **overrides):
  config = transformers.Qwen3MoeConfig(**{**BASE, **overrides})
  torch.manual_seed(0)
  model = transformers.Qwen3MoeForCausalLM(config).eval()
  # Weights far from their initial values, so that a norm weight left at one, a transposed
  # matrix or a swapped gate/up would change the logits; routing becomes input dependent.
  with torch.no_grad():
    for name, param in model.named_parameters():
      if name.endswith("norm.weight") or "layernorm" in name:
        param.copy_(1.0 + 0.3 * torch.randn_like(param))
      else:
        param.copy_(0.3 * torch.randn_like(param))
  model = model.to(dtype)
  model.save_pretrained(directory, **({"max_shard_size": max_shard_size} if max_shard_size
                                      else {}))
  return model


def _jax_logits(model, ids):
  return np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(ids)))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers(tmp_path, variant):
  hf_model = _save_random_model(tmp_path, **VARIANTS[variant])
  ids = torch.randint(0, BASE["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
  with torch.no_grad():
    expected = hf_model(ids).logits.numpy()

  if "max_shard_size" in VARIANTS[variant]:
    assert (tmp_path / "model.safetensors.index.json").exists()
  model = load_hf_checkpoint(tmp_path, dtype=jnp.float32)
  got = _jax_logits(model, ids.numpy())

  assert got.shape == expected.shape
  rel_err = np.abs(got - expected).max() / np.abs(expected).max()
  assert rel_err < 1e-4, f"relative error {rel_err:.2e}"


def test_saved_layout_is_one_the_loader_reads(tmp_path):
  """transformers 4.x and 5.x (checked: 5.24.0) write the published per-expert names; the
  loader also reads the fused [E, 2F, H] / [E, H, F] layout."""
  _save_random_model(tmp_path, **VARIANTS["dense_layer_untied_norm_topk"])
  names = hf_import.SafetensorsCheckpoint(tmp_path).names()
  assert ("model.layers.0.mlp.experts.7.gate_proj.weight" in names
          or "model.layers.0.mlp.experts.gate_up_proj" in names), sorted(names)[:20]
  assert "model.layers.0.mlp.gate.weight" in names
  assert "model.layers.1.mlp.gate_proj.weight" in names  # the dense layer


def test_fused_expert_layout_is_read(tmp_path):
  """A checkpoint with fused experts ([E, 2F, H] gate_up, [E, H, F] down) loads to the same
  model as the per-expert one."""
  from safetensors.numpy import save_file

  _save_random_model(tmp_path / "split", **VARIANTS["dense_layer_untied_norm_topk"])
  ckpt = hf_import.SafetensorsCheckpoint(tmp_path / "split")
  tensors, experts = {}, BASE["num_experts"]
  for name in ckpt.names():
    if ".mlp.experts." not in name:
      tensors[name] = np.array(ckpt[name])
  for layer in (0, 2):
    prefix = f"model.layers.{layer}.mlp.experts"
    tensors[f"{prefix}.gate_up_proj"] = np.stack([
        np.concatenate([ckpt[f"{prefix}.{e}.gate_proj.weight"],
                        ckpt[f"{prefix}.{e}.up_proj.weight"]]) for e in range(experts)])
    tensors[f"{prefix}.down_proj"] = np.stack(
        [ckpt[f"{prefix}.{e}.down_proj.weight"] for e in range(experts)])
  (tmp_path / "fused").mkdir()
  save_file(tensors, str(tmp_path / "fused" / "model.safetensors"))
  (tmp_path / "fused" / "config.json").write_text((tmp_path / "split" / "config.json").read_text())

  split = load_hf_checkpoint(tmp_path / "split")
  fused = load_hf_checkpoint(tmp_path / "fused")
  np.testing.assert_array_equal(fused.layers[2].mlp.w_gate_up[...],
                                split.layers[2].mlp.w_gate_up[...])
  np.testing.assert_array_equal(fused.layers[0].mlp.w_down[...], split.layers[0].mlp.w_down[...])


def test_bfloat16_checkpoint_and_layer_cut(tmp_path):
  hf_model = _save_random_model(tmp_path, dtype=torch.bfloat16,
                                **VARIANTS["dense_layer_untied_norm_topk"])
  model = load_hf_checkpoint(tmp_path, dtype=jnp.float32, num_layers=2)
  assert len(model.layers) == 2
  mlp = hf_model.model.layers[0].mlp
  if hasattr(mlp.experts, "gate_up_proj"):  # transformers 5: fused in memory, [E, 2F, H]
    expected = mlp.experts.gate_up_proj.detach().float().numpy()
  else:  # transformers 4: one module per expert
    expected = np.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]).detach().float()
                         .numpy() for e in mlp.experts])
  assert model.layers[0].mlp.w_gate_up[...].dtype == jnp.float32
  np.testing.assert_array_equal(model.layers[0].mlp.w_gate_up[...],
                                expected.transpose(0, 2, 1))


def test_wrong_model_type_is_named(tmp_path):
  _save_random_model(tmp_path, **VARIANTS["dense_layer_untied_norm_topk"])
  config = json.loads((tmp_path / "config.json").read_text())
  config["model_type"] = "llama"
  (tmp_path / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match="model_type must be 'qwen3_moe', got 'llama'"):
    load_hf_checkpoint(tmp_path)


def test_load_onto_a_mesh_with_fsdp(tmp_path):
  """data=2 x expert=4: experts sharded over `expert`, FSDP over `data`, same logits."""
  import jax
  from jax.sharding import AxisType

  _save_random_model(tmp_path, **VARIANTS["dense_layer_untied_norm_topk"])
  mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)
  ids = np.random.default_rng(0).integers(0, BASE["vocab_size"], (8, 6))
  expected = _jax_logits(load_hf_checkpoint(tmp_path), ids)

  model = load_hf_checkpoint(tmp_path, mesh=mesh, fsdp_axis="data")
  spec = tuple(model.layers[0].mlp.w_gate_up[...].sharding.spec)
  assert spec[0] == "expert" and "data" in spec
  np.testing.assert_allclose(_jax_logits(model, ids), expected, rtol=1e-5, atol=1e-5)


def test_shape_mismatch_names_the_parameter(tmp_path):
  _save_random_model(tmp_path, **VARIANTS["dense_layer_untied_norm_topk"])
  config = json.loads((tmp_path / "config.json").read_text())
  config["vocab_size"] = 100  # the checkpoint's embedding has 96 rows
  (tmp_path / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match=r"embed\.embedding has shape \(96, 32\).*\(100, 32\)"):
    load_hf_checkpoint(tmp_path)


def test_legacy_config_spellings_match_transformers(tmp_path):
  """A config.json in transformers 4.x spelling (top-level rope_theta, rope_scaling with the
  old 'type' key, num_experts): transformers and this loader read the same model from it."""
  _save_random_model(tmp_path, **VARIANTS["dense_layer_untied_norm_topk"])
  config = json.loads((tmp_path / "config.json").read_text())
  config.pop("rope_parameters")
  config["num_experts"] = config.pop("num_local_experts", config.get("num_experts"))
  config |= {"rope_theta": 500.0, "rope_scaling": {"type": "default"}}  # 500: not the default
  (tmp_path / "config.json").write_text(json.dumps(config))
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
  assert hf_model.config.rope_parameters["rope_theta"] == 500.0
  ids = torch.randint(0, BASE["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(2))
  with torch.no_grad():
    expected = hf_model(ids).logits.float().numpy()
  got = _jax_logits(load_hf_checkpoint(tmp_path, dtype=jnp.float32), ids.numpy())
  assert np.abs(got - expected).max() / np.abs(expected).max() < 1e-4

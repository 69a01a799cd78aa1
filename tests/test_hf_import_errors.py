"""Hugging Face import never computes another model silently, and a bad checkpoint names the
file, tensor or config field: config.json fields in every spelling transformers accepts, and
damaged safetensors files. Checkpoints are written here by hand (numpy only, no download)."""

import json

import numpy as np
import pytest

from jax_megamoe.models import Qwen3MoeConfig
from jax_megamoe.models.hf_import import SafetensorsCheckpoint, load_hf_checkpoint

V, H, L, HEADS, KV, D, E, K, F = 16, 8, 1, 2, 1, 4, 4, 2, 6
CONFIG = dict(model_type="qwen3_moe", vocab_size=V, hidden_size=H, num_hidden_layers=L,
              num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=D, num_experts=E,
              num_experts_per_tok=K, moe_intermediate_size=F, norm_topk_prob=True,
              rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.int32): "I32"}


def write_safetensors(filename, tensors):
  header, blobs, offset = {}, [], 0
  for name, array in tensors.items():
    data = np.ascontiguousarray(array).tobytes()
    header[name] = dict(dtype=_DTYPES[array.dtype], shape=list(array.shape),
                        data_offsets=[offset, offset + len(data)])
    blobs.append(data)
    offset += len(data)
  raw = json.dumps(header).encode()
  raw += b" " * (-len(raw) % 8)
  with open(filename, "wb") as f:
    f.write(len(raw).to_bytes(8, "little") + raw + b"".join(blobs))


def hf_tensors():
  rng = np.random.default_rng(0)
  w = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  p = "model.layers.0"
  tensors = {"model.embed_tokens.weight": w(V, H), "model.norm.weight": w(H),
             "lm_head.weight": w(V, H), f"{p}.input_layernorm.weight": w(H),
             f"{p}.post_attention_layernorm.weight": w(H),
             f"{p}.self_attn.q_proj.weight": w(HEADS * D, H),
             f"{p}.self_attn.k_proj.weight": w(KV * D, H),
             f"{p}.self_attn.v_proj.weight": w(KV * D, H),
             f"{p}.self_attn.o_proj.weight": w(H, HEADS * D),
             f"{p}.self_attn.q_norm.weight": w(D), f"{p}.self_attn.k_norm.weight": w(D),
             f"{p}.mlp.gate.weight": w(E, H)}
  for e in range(E):
    tensors |= {f"{p}.mlp.experts.{e}.gate_proj.weight": w(F, H),
                f"{p}.mlp.experts.{e}.up_proj.weight": w(F, H),
                f"{p}.mlp.experts.{e}.down_proj.weight": w(H, F)}
  return tensors


def make_checkpoint(directory, config=None, tensors=None):
  directory.mkdir(exist_ok=True)
  (directory / "config.json").write_text(json.dumps(CONFIG if config is None else config))
  write_safetensors(directory / "model.safetensors", hf_tensors() if tensors is None else tensors)
  return directory


def test_the_hand_written_checkpoint_loads(tmp_path):
  model = load_hf_checkpoint(make_checkpoint(tmp_path))
  np.testing.assert_array_equal(model.layers[0].mlp.router[...],
                                hf_tensors()["model.layers.0.mlp.gate.weight"].T)


# --- config.json: settings this model does not compute are refused, naming the field --------

@pytest.mark.parametrize("change,error,match", [
    # The legacy spelling of scaled RoPE (transformers applies it; it used to be ignored here).
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), NotImplementedError,
     r"rope_scaling: rope_type 'linear' \(key 'type'\) is not supported"),
    (dict(rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
     NotImplementedError, r"rope_scaling: rope_type 'yarn'"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), NotImplementedError,
     r"rope_type 'dynamic' \(key 'rope_type'\)"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4}), NotImplementedError,
     r"rope_parameters: rope_type 'llama3'"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default"}}), NotImplementedError,
     "per-layer RoPE is not supported"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4},
          rope_scaling={"type": "default", "rope_theta": 5e5}), ValueError,
     "disagree on rope_theta"),
    (dict(attention_dropout=0.1), NotImplementedError, "attention_dropout=0.1 is not supported"),
    (dict(use_sliding_window=True), NotImplementedError, "use_sliding_window=True"),
    (dict(attention_bias=True), NotImplementedError, "attention_bias=True"),
    (dict(hidden_act="gelu"), NotImplementedError, "hidden_act must be 'silu', got 'gelu'"),
    (dict(quantization_config={"quant_method": "fp8"}), NotImplementedError,
     "quantization_config"),
    (dict(num_local_experts=8), ValueError, "num_experts and num_local_experts disagree"),
    (dict(hidden_size="8"), ValueError, r"hidden_size must be an integer >= 1, got '8'"),
    (dict(num_experts_per_tok=2.0), ValueError, "num_experts_per_tok must be an integer"),
    (dict(norm_topk_prob="yes"), ValueError, "norm_topk_prob must be true or false"),
    (dict(rms_norm_eps=-1e-6), ValueError, "rms_norm_eps must be a positive number"),
    (dict(mlp_only_layers=[0.5]), ValueError, "mlp_only_layers must be a list"),
])
def test_config_fields_that_change_the_maths_are_read_or_refused(tmp_path, change, error,
                                                                 match):
  make_checkpoint(tmp_path, config=CONFIG | change)
  with pytest.raises(error, match=match) as info:
    load_hf_checkpoint(tmp_path)
  assert str(tmp_path / "config.json") in str(info.value)


def test_config_spellings_transformers_accepts():
  base = {k: v for k, v in CONFIG.items() if k not in ("rope_parameters", "num_experts")}
  legacy = Qwen3MoeConfig.from_hf(base | dict(num_local_experts=E, rope_theta=5e5,
                                              rope_scaling={"type": "default"}))
  assert legacy.num_experts == E and legacy.rope_theta == 5e5
  # rope_scaling, when set, is what transformers reads; its own theta wins over the top level.
  assert Qwen3MoeConfig.from_hf(base | dict(num_experts=E, rope_theta=1.0, rope_scaling={
      "rope_type": "default", "rope_theta": 7.0})).rope_theta == 7.0
  assert Qwen3MoeConfig.from_hf(base | dict(num_experts=E)).rope_theta == 10_000.0
  assert Qwen3MoeConfig.from_hf(base | dict(num_experts=E, head_dim=None)).head_dim == H // HEADS
  assert Qwen3MoeConfig.from_hf(base | dict(num_experts=E, hidden_act="swish")).hidden_size == H


@pytest.mark.parametrize("field", ["hidden_size", "vocab_size", "num_key_value_heads",
                                   "moe_intermediate_size", "num_experts"])
def test_config_missing_field_is_named(tmp_path, field):
  make_checkpoint(tmp_path, config={k: v for k, v in CONFIG.items() if k != field})
  with pytest.raises(ValueError, match=f"config.json: config.json lacks the required field "
                                       f"'{field}'"):
    load_hf_checkpoint(tmp_path)


def test_config_that_is_not_json_or_missing_is_named(tmp_path):
  make_checkpoint(tmp_path)
  (tmp_path / "config.json").write_text('{"model_type": "qwen3_moe",')
  with pytest.raises(ValueError, match=r"config.json is not valid JSON \(Expecting"):
    load_hf_checkpoint(tmp_path)
  (tmp_path / "config.json").write_text("[1, 2]")
  with pytest.raises(ValueError, match="config.json must hold a JSON object, got list"):
    load_hf_checkpoint(tmp_path)
  (tmp_path / "config.json").unlink()
  with pytest.raises(FileNotFoundError, match="no config.json in"):
    load_hf_checkpoint(tmp_path)


# --- safetensors files: damage names the file and the tensor ----------------------------------

def _rewrite_header(filename, edit):
  raw = filename.read_bytes()
  n = int.from_bytes(raw[:8], "little")
  header = json.loads(raw[8:8 + n])
  edit(header)
  new = json.dumps(header).encode()
  new += b" " * (-len(new) % 8)
  filename.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n:])


def _set_offsets(name, offsets):
  def edit(header):
    header[name]["data_offsets"] = offsets
  return edit


@pytest.mark.parametrize("damage,match", [
    (lambda f: f.write_bytes(f.read_bytes()[:5]), "not a safetensors file"),
    (lambda f: f.write_bytes(f.read_bytes()[:200]), "not a safetensors file"),
    (lambda f: f.write_bytes((2 ** 62).to_bytes(8, "little") + f.read_bytes()[8:]),
     "not a safetensors file"),
    (lambda f: f.write_bytes(f.read_bytes()[:8] + b"#" + f.read_bytes()[9:]),
     "the safetensors header is not valid JSON"),
    (lambda f: _rewrite_header(f, _set_offsets("model.norm.weight", [0, 4])),
     r"tensor 'model.norm.weight': data_offsets \[0, 4\] span 4 bytes, its dtype F32 and "
     r"shape \[8\] need 32"),
    (lambda f: _rewrite_header(f, _set_offsets("model.norm.weight", [0, 10 ** 9])),
     "data_offsets must be .begin, end. within the file's"),
    (lambda f: _rewrite_header(f, lambda h: h["model.norm.weight"].update(shape=[-8])),
     "shape must be a list of non-negative integers, got .-8."),
    (lambda f: _rewrite_header(f, lambda h: h["model.norm.weight"].update(dtype="F8_E4M3")),
     "unsupported dtype 'F8_E4M3'"),
    (lambda f: _rewrite_header(f, lambda h: h.update(bogus=[1, 2])),
     "tensor 'bogus': header entry must have dtype, shape and data_offsets"),
])
def test_damaged_safetensors_file_is_named(tmp_path, damage, match):
  make_checkpoint(tmp_path)
  damage(tmp_path / "model.safetensors")
  with pytest.raises(ValueError, match=match) as info:
    SafetensorsCheckpoint(tmp_path)
  assert str(tmp_path / "model.safetensors") in str(info.value)


def test_every_expert_shape_is_checked_not_only_expert_0(tmp_path):
  tensors = hf_tensors()
  tensors["model.layers.0.mlp.experts.3.up_proj.weight"] = np.zeros((F - 1, H), np.float32)
  make_checkpoint(tmp_path, tensors=tensors)
  with pytest.raises(ValueError, match=r"experts.3.up_proj.weight \(in .*model.safetensors\) "
                                       r"has shape \(5, 8\), the model .* expects \(6, 8\)"):
    load_hf_checkpoint(tmp_path)


def test_missing_expert_is_named(tmp_path):
  tensors = hf_tensors()
  del tensors["model.layers.0.mlp.experts.2.down_proj.weight"]
  make_checkpoint(tmp_path, tensors=tensors)
  with pytest.raises(KeyError, match="experts.2.down_proj.weight"):
    load_hf_checkpoint(tmp_path)


@pytest.mark.parametrize("name", ["model.layers.0.mlp.gate.weight",
                                  "model.layers.0.mlp.experts.1.gate_proj.weight"])
def test_integer_weights_are_refused_not_cast(tmp_path, name):
  tensors = hf_tensors()
  tensors[name] = tensors[name].astype(np.int32)
  make_checkpoint(tmp_path, tensors=tensors)
  with pytest.raises(ValueError, match="dtype int32.*floating point"):
    load_hf_checkpoint(tmp_path)


def test_bad_index_file_is_named(tmp_path):
  make_checkpoint(tmp_path)
  index = tmp_path / "model.safetensors.index.json"
  index.write_text("{not json")
  with pytest.raises(ValueError, match="model.safetensors.index.json is not valid JSON"):
    SafetensorsCheckpoint(tmp_path)
  index.write_text(json.dumps({"weight_map": {"model.norm.weight": "shard-2.safetensors"}}))
  with pytest.raises(FileNotFoundError, match="lists 'shard-2.safetensors', which is not in"):
    SafetensorsCheckpoint(tmp_path)

"""Hugging Face Qwen3-MoE checkpoints (config.json + *.safetensors) -> Qwen3Moe.

Weight layouts read (HF Linear weights are [out, in]; ours are [in, out]):
  model.embed_tokens.weight [V, H]                     -> embed.embedding [V, H]
  model.layers.N.self_attn.{q,k,v,o}_proj.weight       -> layers[N].attn.*_proj.kernel (.T)
  model.layers.N.self_attn.{q,k}_norm.weight [D]       -> layers[N].attn.{q,k}_norm.scale
  model.layers.N.{input,post_attention}_layernorm      -> layers[N].{input,post_attn}_norm
  model.layers.N.mlp.gate.weight [E, H]                -> layers[N].mlp.router [H, E]
  model.layers.N.mlp.experts.M.{gate,up}_proj.weight [F, H]
                                                       -> layers[N].mlp.w_gate_up[M] [H, 2F]
                                                          (gate = [:, :F], up = [:, F:])
  model.layers.N.mlp.experts.M.down_proj.weight [H, F] -> layers[N].mlp.w_down[M] [F, H]
  model.layers.N.mlp.{gate,up,down}_proj.weight        -> dense layers' DenseMlp (.T)
  model.norm.weight, lm_head.weight [V, H]             -> final_norm.scale, lm_head.kernel (.T)

The per-expert names are those of the published Qwen3 checkpoints, and what transformers 5.x
still writes with save_pretrained (checked with 5.24.0, which fuses the experts in memory only).
The fused layout, model.layers.N.mlp.experts.gate_up_proj [E, 2F, H] (gate rows first) and
.down_proj [E, H, F], is read as well in case a checkpoint was saved that way.

Tensors are memory-mapped and each device reads only its own shard (make_array_from_callback),
so a model larger than host memory loads shard by shard, on one host or several.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_megamoe.models.config import Qwen3MoeConfig
from jax_megamoe.models.qwen3 import Qwen3Moe
from jax_megamoe.models.sharding import param_shardings

_SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}


class SafetensorsCheckpoint:
  """All tensors of a checkpoint directory, memory-mapped: `ckpt[name]` is a read-only numpy
  view (nothing is read from disk until it is sliced or copied)."""

  def __init__(self, path: str | os.PathLike):
    path = os.fspath(path)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
      with open(index) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    else:
      files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
      raise FileNotFoundError(f"no *.safetensors files in checkpoint directory {path!r}")
    self._tensors: dict[str, np.ndarray] = {}
    for name in files:
      self._tensors.update(_map_safetensors_file(os.path.join(path, name)))

  def __contains__(self, name: str) -> bool:
    return name in self._tensors

  def __getitem__(self, name: str) -> np.ndarray:
    if name not in self._tensors:
      raise KeyError(f"tensor {name!r} is not in the checkpoint")
    return self._tensors[name]

  def names(self) -> set[str]:
    return set(self._tensors)


def _map_safetensors_file(filename: str) -> dict[str, np.ndarray]:
  """Header: u64 little-endian length, then JSON {name: {dtype, shape, data_offsets}}."""
  with open(filename, "rb") as f:
    header_len = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(header_len))
  data = np.memmap(filename, dtype=np.uint8, mode="r", offset=8 + header_len)
  tensors = {}
  for name, info in header.items():
    if name == "__metadata__":
      continue
    if info["dtype"] not in _SAFETENSORS_DTYPES:
      raise ValueError(f"{filename}: tensor {name!r} has unsupported dtype {info['dtype']!r}")
    begin, end = info["data_offsets"]
    tensors[name] = data[begin:end].view(_SAFETENSORS_DTYPES[info["dtype"]]).reshape(
        info["shape"])
  return tensors


# A parameter's source: reads the numpy block of our (transposed, stacked) layout at an index.
Reader = Callable[[tuple[slice, ...]], np.ndarray]


def _transposed(ckpt: SafetensorsCheckpoint, name: str) -> Reader:
  return lambda index: ckpt[name].T[index]


def _as_is(ckpt: SafetensorsCheckpoint, name: str) -> Reader:
  return lambda index: ckpt[name][index]


def _experts(ckpt: SafetensorsCheckpoint, prefix: str, which: str, num_experts: int) -> Reader:
  """w_gate_up [E, H, 2F] or w_down [E, F, H] of one MoE layer, reading only the experts that
  `index` selects."""
  fused = f"{prefix}.experts.{which}"
  if fused in ckpt:  # [E, 2F, H] or [E, H, F]
    return lambda index: ckpt[fused].transpose(0, 2, 1)[index]

  def read(index):
    experts = range(num_experts)[index[0]]
    if which == "down_proj":
      blocks = [ckpt[f"{prefix}.experts.{e}.down_proj.weight"].T for e in experts]
    else:
      blocks = [np.concatenate([ckpt[f"{prefix}.experts.{e}.gate_proj.weight"].T,
                                ckpt[f"{prefix}.experts.{e}.up_proj.weight"].T], axis=-1)
                for e in experts]
    return np.stack(blocks)[(slice(None), *index[1:])]
  return read


def _reader(path: tuple, ckpt: SafetensorsCheckpoint, config: Qwen3MoeConfig) -> Reader:
  """The HF source of one of our parameters, by its nnx path."""
  if path == ("embed", "embedding"):
    return _as_is(ckpt, "model.embed_tokens.weight")
  if path == ("final_norm", "scale"):
    return _as_is(ckpt, "model.norm.weight")
  if path == ("lm_head", "kernel"):
    return _transposed(ckpt, "lm_head.weight")
  if path[0] != "layers":
    raise KeyError(f"no Hugging Face source for parameter {'.'.join(map(str, path))}")
  layer, rest = path[1], path[2:]
  prefix = f"model.layers.{layer}"
  norms = {"input_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm"}
  if rest[0] in norms:
    return _as_is(ckpt, f"{prefix}.{norms[rest[0]]}.weight")
  if rest[0] == "attn":
    name = f"{prefix}.self_attn.{rest[1]}.weight"
    return _as_is(ckpt, name) if rest[1] in ("q_norm", "k_norm") else _transposed(ckpt, name)
  if rest == ("mlp", "router"):
    return _transposed(ckpt, f"{prefix}.mlp.gate.weight")
  if rest == ("mlp", "w_gate_up"):
    return _experts(ckpt, f"{prefix}.mlp", "gate_up_proj", config.num_experts)
  if rest == ("mlp", "w_down"):
    return _experts(ckpt, f"{prefix}.mlp", "down_proj", config.num_experts)
  if rest[0] == "mlp":  # dense SwiGLU layer
    return _transposed(ckpt, f"{prefix}.mlp.{rest[1]}.weight")
  raise KeyError(f"no Hugging Face source for parameter {'.'.join(map(str, path))}")


def _check_coverage(ckpt: SafetensorsCheckpoint, config: Qwen3MoeConfig, used: set[str]):
  """Every checkpoint tensor must have been used, except layers cut by a num_layers override
  and a tied head's redundant copy."""
  def expected_unused(name):
    parts = name.split(".")
    if name.startswith("model.layers.") and int(parts[2]) >= config.num_layers:
      return True
    return name == "lm_head.weight" and config.tie_word_embeddings
  unused = sorted(n for n in ckpt.names() - used if not expected_unused(n))
  if unused:
    raise ValueError(f"{len(unused)} checkpoint tensors have no place in Qwen3Moe, e.g. "
                     f"{unused[:5]} (is this a Qwen3-MoE checkpoint?)")


class _RecordingCheckpoint:
  """Wraps a checkpoint and records which tensor names were read."""

  def __init__(self, ckpt: SafetensorsCheckpoint):
    self._ckpt, self.used = ckpt, set()

  def __contains__(self, name):
    return name in self._ckpt

  def __getitem__(self, name):
    self.used.add(name)
    return self._ckpt[name]


def read_hf_config(path: str | os.PathLike) -> Qwen3MoeConfig:
  """Qwen3MoeConfig from a checkpoint directory's config.json."""
  with open(os.path.join(os.fspath(path), "config.json")) as f:
    return Qwen3MoeConfig.from_hf(json.load(f))


def load_hf_checkpoint(path: str | os.PathLike, *, dtype: Any = jnp.float32,
                       param_dtype: Any = jnp.float32, mesh: Mesh | None = None,
                       fsdp_axis: str | None = None, expert_axis: str = "expert",
                       backend: str = "auto", recipe: str | None = None,
                       remat: str = "none", attention: str | None = None,
                       num_layers: int | None = None) -> Qwen3Moe:
  """Builds a Qwen3Moe from a Hugging Face Qwen3-MoE checkpoint directory.

  Args:
    path: directory with config.json and model.safetensors (or shards + index json).
    dtype, param_dtype: compute and storage dtypes of the model (see Qwen3Moe).
    mesh: optional device mesh; parameters are placed as models/sharding.py lays them out
      (experts over `expert_axis`, FSDP over `fsdp_axis` when given). Without a mesh they go
      to the default device.
    backend, recipe, remat, attention: passed to Qwen3Moe.
    num_layers: keep only the first num_layers decoder layers (e.g. for a one-node test).

  Returns:
    Qwen3Moe with the checkpoint's weights (config from config.json).
  """
  config = read_hf_config(path)
  if num_layers is not None:
    if not 1 <= num_layers <= config.num_layers:
      raise ValueError(f"num_layers must be in [1, {config.num_layers}], got {num_layers}")
    config = config.replace(num_layers=num_layers)
  ckpt = _RecordingCheckpoint(SafetensorsCheckpoint(path))

  def build():
    return Qwen3Moe(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype,
                    backend=backend, recipe=recipe, mesh=mesh, expert_axis=expert_axis,
                    remat=remat, attention=attention)

  graphdef, abstract = nnx.split(nnx.eval_shape(build), nnx.Param)
  if mesh is not None:
    shardings = param_shardings(abstract, mesh, fsdp_axis=fsdp_axis)
  else:
    device = NamedSharding(jax.sharding.Mesh(jax.devices()[:1], ("d",)), P())
    shardings = jax.tree.map(lambda v: v.replace(device), abstract,
                             is_leaf=lambda x: isinstance(x, nnx.Variable))

  flat_abstract = dict(nnx.to_flat_state(abstract))
  flat_shardings = dict(nnx.to_flat_state(shardings))
  loaded = []
  for path_, variable in flat_abstract.items():
    value = variable.get_value()
    read = _reader(path_, ckpt, config)
    np_dtype = np.dtype(value.dtype)

    def block(index, read=read, np_dtype=np_dtype):
      return np.asarray(read(index), dtype=np_dtype)

    _check_shape(path_, read, value.shape)
    array = jax.make_array_from_callback(value.shape, flat_shardings[path_].get_value(), block)
    loaded.append((path_, variable.replace(array)))
  _check_coverage(ckpt._ckpt, config, ckpt.used)
  return nnx.merge(graphdef, nnx.from_flat_state(loaded))


def _check_shape(path: tuple, read: Reader, shape: tuple[int, ...]):
  """Compares the checkpoint tensor's shape with ours before any device reads it, so that a
  config/checkpoint mismatch names the parameter instead of failing inside a callback. Whole
  tensors are memory-mapped views (nothing is read); stacked experts are checked on expert 0
  (their count comes from config.json and a missing expert raises a KeyError naming it)."""
  stacked = path[-1] in ("w_gate_up", "w_down")
  index = tuple(slice(0, 1) if stacked and d == 0 else slice(None) for d in range(len(shape)))
  got = read(index).shape
  want = ((1,) + tuple(shape[1:])) if stacked else tuple(shape)
  if tuple(got) != want:
    raise ValueError(f"checkpoint tensor for {'.'.join(map(str, path))} has shape "
                     f"{tuple(got)}, the model (from config.json) expects {want}")

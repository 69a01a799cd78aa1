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
import math
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
_FLOAT_DTYPES = tuple(np.dtype(_SAFETENSORS_DTYPES[k]) for k in ("F64", "F32", "F16", "BF16"))


class SafetensorsCheckpoint:
  """All tensors of a checkpoint directory, memory-mapped: `ckpt[name]` is a read-only numpy
  view (nothing is read from disk until it is sliced or copied)."""

  def __init__(self, path: str | os.PathLike):
    path = os.fspath(path)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
      weight_map = _read_json(index).get("weight_map")
      if not isinstance(weight_map, dict) or not all(
          isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index}: 'weight_map' must map tensor names to file names, got "
                         f"{str(weight_map)[:200]}")
      files = sorted(set(weight_map.values()))
    else:
      files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
      raise FileNotFoundError(f"no *.safetensors files in checkpoint directory {path!r}")
    self._tensors: dict[str, np.ndarray] = {}
    self._files: dict[str, str] = {}  # tensor name -> the file that holds it
    for name in files:
      filename = os.path.join(path, name)
      if not os.path.isfile(filename):
        raise FileNotFoundError(f"{index} lists {name!r}, which is not in {path!r}")
      for tensor, array in _map_safetensors_file(filename).items():
        if tensor in self._tensors:
          raise ValueError(f"tensor {tensor!r} is in both {self._files[tensor]} and {filename}")
        self._tensors[tensor], self._files[tensor] = array, filename

  def __contains__(self, name: str) -> bool:
    return name in self._tensors

  def __getitem__(self, name: str) -> np.ndarray:
    if name not in self._tensors:
      raise KeyError(f"tensor {name!r} is not in the checkpoint")
    return self._tensors[name]

  def file_of(self, name: str) -> str:
    """The safetensors file that holds tensor `name`."""
    return self._files[name]

  def names(self) -> set[str]:
    return set(self._tensors)


def _map_safetensors_file(filename: str) -> dict[str, np.ndarray]:
  """Header: u64 little-endian length, then JSON {name: {dtype, shape, data_offsets}}, then
  the data. Every entry is checked against the file before it is mapped, so that a damaged or
  foreign file names itself and the tensor instead of failing inside numpy."""
  size = os.path.getsize(filename)
  with open(filename, "rb") as f:
    header_len = int.from_bytes(f.read(8), "little")
    if size < 8 or header_len > size - 8:
      raise ValueError(f"{filename}: not a safetensors file (header length {header_len} bytes, "
                       f"file {size} bytes); truncated or another format?")
    try:
      header = json.loads(f.read(header_len))
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
      raise ValueError(f"{filename}: the safetensors header is not valid JSON ({e})") from None
  if not isinstance(header, dict):
    raise ValueError(f"{filename}: the safetensors header must be a JSON object, got "
                     f"{type(header).__name__}")
  data_bytes = size - 8 - header_len
  data = (np.memmap(filename, dtype=np.uint8, mode="r", offset=8 + header_len) if data_bytes
          else np.zeros((0,), np.uint8))
  tensors = {}
  for name, info in header.items():
    if name == "__metadata__":
      continue
    where = f"{filename}: tensor {name!r}"
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
      raise ValueError(f"{where}: header entry must have dtype, shape and data_offsets, got "
                       f"{str(info)[:200]}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype not in _SAFETENSORS_DTYPES:
      raise ValueError(f"{where} has unsupported dtype {dtype!r} (supported: "
                       f"{', '.join(_SAFETENSORS_DTYPES)})")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
      raise ValueError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_count, offsets))
        or not offsets[0] <= offsets[1] <= data_bytes):
      raise ValueError(f"{where}: data_offsets must be [begin, end] within the file's "
                       f"{data_bytes} data bytes, got {offsets!r}")
    np_dtype = np.dtype(_SAFETENSORS_DTYPES[dtype])
    want = math.prod(shape) * np_dtype.itemsize
    if offsets[1] - offsets[0] != want:
      raise ValueError(f"{where}: data_offsets {offsets} span {offsets[1] - offsets[0]} bytes, "
                       f"its dtype {dtype} and shape {shape} need {want}")
    tensors[name] = data[offsets[0]:offsets[1]].view(np_dtype).reshape(shape)
  return tensors


def _is_count(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _read_json(filename: str) -> dict:
  """A JSON object from a file; errors name the file."""
  try:
    with open(filename) as f:
      value = json.load(f)
  except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
    raise ValueError(f"{filename} is not valid JSON ({e})") from None
  if not isinstance(value, dict):
    raise ValueError(f"{filename} must hold a JSON object, got {type(value).__name__}")
  return value


# A parameter's source: reads the numpy block of our (transposed, stacked) layout at an index.
Reader = Callable[[tuple[slice, ...]], np.ndarray]


def _transposed(ckpt: SafetensorsCheckpoint, name: str) -> Reader:
  return lambda index: ckpt[name].T[index]


def _as_is(ckpt: SafetensorsCheckpoint, name: str) -> Reader:
  return lambda index: ckpt[name][index]


def _experts(ckpt: SafetensorsCheckpoint, prefix: str, which: str,
             config: Qwen3MoeConfig) -> Reader:
  """w_gate_up [E, H, 2F] or w_down [E, F, H] of one MoE layer, reading only the experts that
  `index` selects. Every expert's tensors are checked (shape, dtype: header metadata only)
  before anything is read, so that a bad one is named instead of failing in a device read."""
  num_experts, h, f = config.num_experts, config.hidden_size, config.moe_ffn_size
  fused = f"{prefix}.experts.{which}"
  if fused in ckpt:  # [E, 2F, H] or [E, H, F]
    _check_tensor(ckpt, fused, (num_experts, 2 * f, h) if which == "gate_up_proj" else
                  (num_experts, h, f))
    return lambda index: ckpt[fused].transpose(0, 2, 1)[index]
  parts = ("down_proj",) if which == "down_proj" else ("gate_proj", "up_proj")
  for e in range(num_experts):
    for part in parts:
      _check_tensor(ckpt, f"{prefix}.experts.{e}.{part}.weight",
                    (h, f) if part == "down_proj" else (f, h))

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
    return _experts(ckpt, f"{prefix}.mlp", "gate_up_proj", config)
  if rest == ("mlp", "w_down"):
    return _experts(ckpt, f"{prefix}.mlp", "down_proj", config)
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

  def file_of(self, name):
    return self._ckpt.file_of(name)


def read_hf_config(path: str | os.PathLike) -> Qwen3MoeConfig:
  """Qwen3MoeConfig from a checkpoint directory's config.json; errors name the file."""
  filename = os.path.join(os.fspath(path), "config.json")
  if not os.path.isfile(filename):
    raise FileNotFoundError(f"no config.json in {os.fspath(path)!r} (a Hugging Face checkpoint "
                            f"directory holds config.json and *.safetensors)")
  hf = _read_json(filename)
  try:
    return Qwen3MoeConfig.from_hf(hf)
  except (ValueError, NotImplementedError) as e:
    raise type(e)(f"{filename}: {e}") from None


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
  """Compares the checkpoint tensor's shape and dtype with ours before any device reads it, so
  that a config/checkpoint mismatch names the parameter instead of failing inside a callback.
  Whole tensors are memory-mapped views (nothing is read); stacked experts are checked expert
  by expert in _experts, here only expert 0's slice."""
  stacked = path[-1] in ("w_gate_up", "w_down")
  index = tuple(slice(0, 1) if stacked and d == 0 else slice(None) for d in range(len(shape)))
  got = read(index)
  want = ((1,) + tuple(shape[1:])) if stacked else tuple(shape)
  name = ".".join(map(str, path))
  if tuple(got.shape) != want:
    raise ValueError(f"checkpoint tensor for {name} has shape {tuple(got.shape)}, the model "
                     f"(from config.json) expects {want}")
  if got.dtype not in _FLOAT_DTYPES:
    raise ValueError(f"checkpoint tensor for {name} has dtype {got.dtype}: its weights must be "
                     f"floating point, not cast from integers")


def _check_tensor(ckpt, name: str, shape: tuple[int, ...]):
  """One checkpoint tensor as stored (HF layout): present, floating point, of this shape."""
  array = ckpt[name]
  where = f"checkpoint tensor {name} (in {ckpt.file_of(name)})"
  if tuple(array.shape) != shape:
    raise ValueError(f"{where} has shape {tuple(array.shape)}, the model (from config.json) "
                     f"expects {shape}")
  if array.dtype not in _FLOAT_DTYPES:
    raise ValueError(f"{where} has dtype {array.dtype}: its weights must be floating point")

"""Which attention kernel a run uses: "auto" picks cuDNN flash attention where it runs (an
NVIDIA GPU, bf16/fp16 compute, the model's head layout) and XLA's attention elsewhere, saying
why in one line. XLA's attention materialises the [S, S] scores: at Qwen3's 32 heads and 4,096
positions that is 2 GiB per sequence in float32, and it ran out of memory on an H200 where cuDNN
took 0.213 s per step (issue 15)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

ATTENTION_CHOICES = ("auto", "xla", "cudnn")
# Positions of the probe call: enough for cuDNN to pick its flash kernel, small enough to be
# instant.
_PROBE_SEQ = 128


def resolve_attention(requested: str, *, dtype: Any, num_heads: int, num_kv_heads: int,
                      head_dim: int, device: jax.Device | None = None
                      ) -> tuple[str, str | None]:
  """(implementation for Qwen3Moe(attention=...), message or None).

  "xla" and "cudnn" are returned as given (no message). "auto" runs cuDNN flash attention
  once, forward and backward, on `device` (default: the first local device) with the model's
  heads, head_dim and compute dtype: "cudnn" if that works, else "xla" with a one-line
  message saying why (no GPU, a dtype cuDNN lacks, or cuDNN's error).
  """
  if requested not in ATTENTION_CHOICES:
    raise ValueError(f"attention must be one of {ATTENTION_CHOICES}, got {requested!r}")
  if requested != "auto":
    return requested, None
  device = device or jax.local_devices()[0]
  if device.platform != "gpu":
    return "xla", (f"attention auto: xla (cuDNN flash attention needs an NVIDIA GPU; this run "
                   f"is on {device.platform})")
  dtype = jnp.dtype(dtype)
  if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return "xla", (f"attention auto: xla (cuDNN flash attention needs bfloat16 or float16 "
                   f"compute, this run computes in {dtype.name})")
  try:
    _probe_cudnn(dtype, num_heads, num_kv_heads, head_dim, device)
  except Exception as e:  # noqa: BLE001  (any failure means: not here)
    first_line = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    return "xla", f"attention auto: xla (cuDNN flash attention failed here: {first_line})"
  return "cudnn", "attention auto: cudnn (flash attention)"


def _probe_cudnn(dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                 device: jax.Device) -> None:
  def loss(q, k, v):
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    return jnp.sum(out.astype(jnp.float32))

  shape = (1, _PROBE_SEQ)
  q = jax.device_put(jnp.ones((*shape, num_heads, head_dim), dtype), device)
  kv = jax.device_put(jnp.ones((*shape, num_kv_heads, head_dim), dtype), device)
  jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, kv, kv))

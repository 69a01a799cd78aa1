"""The expert MLP on the grouped-GEMM FFI kernels in the inputs' dtype (bf16 on the GPU).

Forward: L1 = x @ W_gate_up per expert (CUTLASS sm90 grouped GEMM, TMA + wgmma, bf16 in, fp32
accumulation), SwiGLU in fp32 (h stored as bf16), L2 = h @ W_down. Backward: dh = dy @ W_down^T,
SwiGLU backward, dx = dgate_up @ W_gate_up^T, and the K-grouped weight gradients
dW_down = h^T dy, dW_gate_up = x^T dgate_up (fp32 accumulation over each expert's rows, stored in
the weights' dtype; an expert with no rows gets a written zero). Group sizes stay on the device.

On a CPU the same targets reach the CPU handlers (plain loops, bf16 or float32, the same
contract), so CI exercises the binding. Which path serves a layer is decided by backends.cuda.

  forward(x_sorted, group_sizes, w_gate_up, w_down) -> (y, gate_up, hidden)
  backward(dy, x_sorted, group_sizes, w_gate_up, w_down, gate_up, hidden)
      -> (dx, dw_gate_up, dw_down)
  grouped_mlp(x_sorted, group_sizes, w_gate_up, w_down) -> y   differentiable (custom_vjp)
  grouped_gemm(a, group_sizes, b, kind=)                        one grouped GEMM
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_megamoe import _ffi, varying

FWD_TARGET = "megamoe_grouped_mlp_fwd"
BWD_TARGET = "megamoe_grouped_mlp_bwd"
GEMM_TARGET = "megamoe_grouped_gemm"
GEMM_KINDS = {"fprop": 0, "dgrad": 1, "wgrad": 2}


def kernel_supports(dtype, hidden: int, ffn: int) -> bool:
  """Whether the CUDA kernels take this layer (else backends.cuda runs the reference MLP)."""
  return dtype == jnp.bfloat16 and hidden % 8 == 0 and ffn % 8 == 0


def _check(x_sorted, group_sizes, w_gate_up, w_down) -> tuple[int, int, int, int]:
  if x_sorted.ndim != 2:
    raise ValueError(f"x_sorted must be [N, H], got shape {x_sorted.shape}")
  n, h = x_sorted.shape
  if group_sizes.ndim != 1 or group_sizes.dtype != jnp.int32:
    raise ValueError(f"group_sizes must be [E] int32, got {group_sizes.dtype}{list(group_sizes.shape)}")
  e = group_sizes.shape[0]
  if w_gate_up.ndim != 3 or w_gate_up.shape[:2] != (e, h) or w_gate_up.shape[2] % 2:
    raise ValueError(f"w_gate_up must be [E={e}, H={h}, 2F], got {w_gate_up.shape}")
  f = w_gate_up.shape[2] // 2
  if w_down.shape != (e, f, h):
    raise ValueError(f"w_down must be [E={e}, F={f}, H={h}], got {w_down.shape}")
  for name, a in (("w_gate_up", w_gate_up), ("w_down", w_down)):
    if a.dtype != x_sorted.dtype:
      raise ValueError(f"{name} has dtype {a.dtype}, x_sorted has {x_sorted.dtype}")
  if x_sorted.dtype not in (jnp.bfloat16, jnp.float32):
    raise ValueError(f"x_sorted must be bfloat16 or float32, got {x_sorted.dtype}")
  return n, h, f, e


def forward(x_sorted, group_sizes, w_gate_up, w_down):
  """The MLP forward on the kernels: (y [N, H], gate_up [N, 2F], hidden [N, F])."""
  n, h, f, e = _check(x_sorted, group_sizes, w_gate_up, w_down)
  dt = x_sorted.dtype
  call = jax.ffi.ffi_call(
      FWD_TARGET,
      (jax.ShapeDtypeStruct((n, h), dt), jax.ShapeDtypeStruct((n, 2 * f), dt),
       jax.ShapeDtypeStruct((n, f), dt),
       jax.ShapeDtypeStruct((_ffi.gemm_scratch_bytes(e),), jnp.uint8)))
  y, gate_up, hidden, _ = call(x_sorted, group_sizes, w_gate_up, w_down)
  like = (x_sorted, group_sizes, w_gate_up, w_down)
  return tuple(varying.match_varying(a, *like) for a in (y, gate_up, hidden))


def backward(dy, x_sorted, group_sizes, w_gate_up, w_down, gate_up, hidden):
  """The MLP backward on the kernels from the forward's residuals: (dx, dw_gate_up, dw_down)."""
  n, h, f, e = _check(x_sorted, group_sizes, w_gate_up, w_down)
  dt = x_sorted.dtype
  call = jax.ffi.ffi_call(
      BWD_TARGET,
      (jax.ShapeDtypeStruct((n, h), dt), jax.ShapeDtypeStruct((e, h, 2 * f), dt),
       jax.ShapeDtypeStruct((e, f, h), dt), jax.ShapeDtypeStruct((n, 2 * f), dt),
       jax.ShapeDtypeStruct((n, f), dt),
       jax.ShapeDtypeStruct((_ffi.gemm_scratch_bytes(e),), jnp.uint8)))
  dx, dw_gate_up, dw_down, _, _, _ = call(dy.astype(dt), x_sorted, group_sizes, w_gate_up,
                                          w_down, gate_up, hidden)
  return (varying.match_varying(dx, x_sorted), varying.match_varying(dw_gate_up, w_gate_up),
          varying.match_varying(dw_down, w_down))


def grouped_mlp(x_sorted, group_sizes, w_gate_up, w_down):
  """The grouped SwiGLU MLP through the FFI handlers, on whatever platform runs it (CUDA: bf16;
  CPU: bf16 or float32). Same contract as reference.grouped_mlp with recipe=None."""
  return _grouped_mlp(*varying.align_varying(x_sorted, group_sizes, w_gate_up, w_down))


@jax.custom_vjp
def _grouped_mlp(x_sorted, group_sizes, w_gate_up, w_down):
  return forward(x_sorted, group_sizes, w_gate_up, w_down)[0]


def _grouped_mlp_fwd(x_sorted, group_sizes, w_gate_up, w_down):
  y, gate_up, hidden = forward(x_sorted, group_sizes, w_gate_up, w_down)
  return y, (x_sorted, group_sizes, w_gate_up, w_down, gate_up, hidden)


def _grouped_mlp_bwd(res, dy):
  x, group_sizes, w_gate_up, w_down, gate_up, hidden = res
  dx, dw_gate_up, dw_down = backward(dy, x, group_sizes, w_gate_up, w_down, gate_up, hidden)
  return dx, None, dw_gate_up, dw_down


_grouped_mlp.defvjp(_grouped_mlp_fwd, _grouped_mlp_bwd)


def grouped_gemm(a: jax.Array, group_sizes: jax.Array, b: jax.Array, *, kind: int | str
                 ) -> jax.Array:
  """One grouped GEMM on the kernels (bf16 in and out, fp32 accumulation):

    fprop (0): a [N, K], b [E, K, P] -> [N, P]   rows of group g times b[g]; padding rows 0
    dgrad (1): a [N, K], b [E, P, K] -> [N, P]   rows of group g times b[g]^T; padding rows 0
    wgrad (2): a [N, M], b [N, P]    -> [E, M, P] a_g^T b_g over group g's rows; empty groups 0
  """
  kind = GEMM_KINDS.get(kind, kind) if isinstance(kind, str) else int(kind)
  if kind not in (0, 1, 2):
    raise ValueError(f"kind must be one of {GEMM_KINDS} or 0/1/2, got {kind!r}")
  e = group_sizes.shape[0]
  if kind == 2:
    out = jax.ShapeDtypeStruct((e, a.shape[1], b.shape[1]), a.dtype)
  else:
    out = jax.ShapeDtypeStruct((a.shape[0], b.shape[2] if kind == 0 else b.shape[1]), a.dtype)
  call = jax.ffi.ffi_call(
      GEMM_TARGET, (out, jax.ShapeDtypeStruct((_ffi.gemm_scratch_bytes(e),), jnp.uint8)))
  return varying.match_varying(call(a, group_sizes, b, kind=np.int64(kind))[0], a, group_sizes,
                               b)

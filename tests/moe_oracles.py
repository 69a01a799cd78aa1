"""Independent oracles for the MoE layer: a float64 NumPy per-token loop and a dense pure-JAX
formulation (every expert on every token), which autodiff differentiates for gradient checks."""

import jax
import jax.numpy as jnp
import numpy as np


def numpy_moe(x, topk_ids, topk_weights, w_gate_up, w_down):
  """float64, one token and one slot at a time; id -1 masks a slot."""
  x, w, wgu, wd = (np.asarray(a, np.float64) for a in (x, topk_weights, w_gate_up, w_down))
  ids = np.asarray(topk_ids)
  ffn = wd.shape[1]
  y = np.zeros_like(x)
  for t in range(x.shape[0]):
    for j in range(ids.shape[1]):
      e = ids[t, j]
      if e < 0:
        continue
      gate_up = x[t] @ wgu[e]
      gate, up = gate_up[:ffn], gate_up[ffn:]
      hidden = gate / (1.0 + np.exp(-gate)) * up
      y[t] += w[t, j] * (hidden @ wd[e])
  return y


def dense_moe(x, topk_ids, topk_weights, w_gate_up, w_down):
  """Every expert on every token in float32 at HIGHEST precision, then the routed mix."""
  ffn = w_down.shape[1]
  num_experts = w_gate_up.shape[0]
  hp = jax.lax.Precision.HIGHEST
  x32 = x.astype(jnp.float32)
  gate_up = jnp.einsum("th,ehf->etf", x32, w_gate_up.astype(jnp.float32), precision=hp)
  hidden = jax.nn.silu(gate_up[..., :ffn]) * gate_up[..., ffn:]
  out = jnp.einsum("etf,efh->eth", hidden, w_down.astype(jnp.float32), precision=hp)
  mix = jnp.sum(jax.nn.one_hot(topk_ids, num_experts) * topk_weights[..., None], axis=1)
  return jnp.einsum("te,eth->th", mix, out, precision=hp)


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def assert_errors_below(errors: dict, tolerance: float):
  """Every relative error finite and below `tolerance`. (`max(errors.values()) < tolerance`
  lets a NaN through unless it comes first: NaN compares false either way.)"""
  bad = {name: e for name, e in errors.items() if not (np.isfinite(e) and e < tolerance)}
  assert not bad, f"errors not below {tolerance}: {bad} (all: {errors})"

"""Eager calls of jax_megamoe.moe under a mesh: compiled once, then served from jit's cache.

Outside jit, moe(..., mesh=m) runs a shard_map eagerly, and JAX compiles that shard_map anew on
every call (8-10 s each on a 2-core CPU, even at 16 tokens). Sending such a call through one
jax.jit of the op, with the mesh and the options static, lets jit's own cache key the compiled
program by mesh, options, shapes, dtypes and shardings: a repeated eager call then costs what a
jitted call does. Inside the jit the op sees tracers, so it does not come back here.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax


def is_eager(*arrays: Any) -> bool:
  """True when none of the arrays is being traced (the call is not inside jit, grad, vmap...)."""
  return not any(isinstance(a, jax.core.Tracer) for a in arrays)


@functools.cache
def _jitted(fn: Callable, static_names: tuple[str, ...]) -> Callable:
  return jax.jit(fn, static_argnames=static_names)


def call(fn: Callable, *arrays: Any, **options: Any) -> Any:
  """fn(*arrays, **options) through one cached jax.jit of fn with every option static (the
  options must be hashable: a Mesh, strings, None)."""
  return _jitted(fn, tuple(sorted(options)))(*arrays, **options)

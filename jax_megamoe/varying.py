"""Varying-axes types inside jax.shard_map: which mesh axes a value varies over, and the cast
that marks it varying over more (custom calls and some collectives return values typed as
invariant, which custom_vjp and shard_map's type check then reject)."""

from __future__ import annotations

from typing import Iterable

import jax


def varying_axes(x) -> frozenset:
  """The mesh axes x varies over inside shard_map (empty outside)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", frozenset()))


def cast_varying(x, axes: Iterable[str]):
  """x typed as varying over `axes` too (a no-op for the axes it already varies over)."""
  missing = tuple(sorted(frozenset(axes) - varying_axes(x)))
  if not missing:
    return x
  if hasattr(jax.lax, "pcast"):
    return jax.lax.pcast(x, missing, to="varying")
  return jax.lax.pvary(x, missing)


def match_varying(value, *like):
  """value typed as varying over every axis any of `like` varies over (ffi_call results carry
  no varying type inside shard_map; custom_vjp and shard_map's type check expect the inputs')."""
  return cast_varying(value, frozenset().union(*(varying_axes(a) for a in like)))

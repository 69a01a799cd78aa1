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


def align_varying(*arrays):
  """Inside shard_map, every operand cast to vary over the union of their varying axes, so a
  custom_vjp sees one type and autodiff of the cast sums an invariant weight's gradient."""
  return tuple(match_varying(a, *arrays) for a in arrays)


def match_varying_each(values, *like):
  """match_varying for each of a tuple (or NamedTuple) of values, e.g. an ffi_call's results."""
  cast = [match_varying(v, *like) for v in values]
  return type(values)(*cast) if hasattr(values, "_fields") else tuple(cast)

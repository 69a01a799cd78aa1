"""Parameter layout for training over a (data, expert) mesh: expert weights sharded over the
expert axis (their own `out_sharding` metadata, set by jax_megamoe.MoE), and every parameter
additionally FSDP-sharded over the data axis along its largest dimension that divides evenly
(XLA all-gathers it where it is used and reduce-scatters its gradient)."""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def _declared_spec(variable: nnx.Variable) -> tuple:
  """The sharding a parameter declares (out_sharding / sharding_names metadata), or none."""
  metadata = variable.get_metadata()
  names = metadata.get("out_sharding", metadata.get("sharding_names"))
  ndim = len(variable.get_value().shape)
  return tuple(names) if names is not None else (None,) * ndim


def fsdp_spec(shape: tuple[int, ...], declared: tuple, mesh: Mesh,
              fsdp_axis: str | None) -> P:
  """`declared` plus `fsdp_axis` on the largest free dimension it divides (none if none does).

  Vectors (norm scales) stay replicated: too small to be worth a collective. Axes of
  `declared` that are not in the mesh are dropped (replicated)."""
  spec = [name if name in mesh.axis_names else None for name in declared]
  size = mesh.shape.get(fsdp_axis, 1) if fsdp_axis else 1
  if size > 1 and len(shape) >= 2 and fsdp_axis not in spec:
    free = [d for d, name in enumerate(spec) if name is None and shape[d] % size == 0]
    if free:
      spec[max(free, key=lambda d: shape[d])] = fsdp_axis
  return P(*spec)


def param_shardings(params: nnx.State, mesh: Mesh, *, fsdp_axis: str | None = "data"
                    ) -> nnx.State:
  """NamedSharding for every parameter of `params` (an nnx.State of Params, concrete or
  abstract), same tree structure."""
  if fsdp_axis is not None and fsdp_axis not in mesh.axis_names:
    raise ValueError(f"fsdp_axis {fsdp_axis!r} is not an axis of the mesh "
                     f"(axes {tuple(mesh.axis_names)})")

  def one(variable):
    shape = tuple(variable.get_value().shape)
    return variable.replace(NamedSharding(
        mesh, fsdp_spec(shape, _declared_spec(variable), mesh, fsdp_axis)))

  return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))

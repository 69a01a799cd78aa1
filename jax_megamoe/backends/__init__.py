"""Backends of jax_megamoe.moe: each computes the whole layer, the same function (DESIGN.md §3).

A backend is a module with
  NAME: str
  unavailable_reason(recipe) -> str | None    why it cannot run here, None when it can
  auto_reason(shape, mesh, expert_axis)       (optional) why "auto" should not pick it for this
                                              layer (shape None: for any layer) although it
                                              can run (None: pick it)
  moe(x, topk_ids, topk_weights, w_gate_up, w_down, *, mesh, expert_axis, recipe, shape,
      weight_blocks=None)
                                              the layer; arguments already validated once by
                                              jax_megamoe.moe (`shape`: validation.LayerShape;
                                              topk_ids int32, topk_weights float32;
                                              weight_blocks: the FP8 weights already quantised,
                                              jax_megamoe.weight_blocks, read instead of
                                              quantising them)
"reference" and "cuda" build their layer from two parts: an expert MLP over rows grouped by
expert (parallel.GroupedMlp) and, under a mesh, an exchange that moves the rows to the experts'
ranks and back (parallel.expert_parallel_moe: XLA collectives; cuda_ep.expert_parallel_moe:
NVLink kernels); without a mesh, backends.local.local_moe. "fused" runs one kernel per
direction and has no separable MLP.

Modules are imported lazily so that a missing or broken native build never breaks "reference".
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

# In "auto" preference order, best first.
_MODULES = {
    "fused": "jax_megamoe.backends.fused",
    "cuda": "jax_megamoe.backends.cuda",
    "reference": "jax_megamoe.backends.reference",
}
NAMES = ("auto", *reversed(_MODULES))  # ("auto", "reference", "cuda", "fused")


class BackendUnavailableError(RuntimeError):
  """The requested backend cannot run here; the message says why."""


@functools.cache
def _load(name: str) -> tuple[ModuleType | None, str | None]:
  try:
    module = importlib.import_module(_MODULES[name])
  except ImportError as e:
    return None, f"backend {name!r} is not part of this build ({e})"
  return module, None


def unavailable_reason(name: str, recipe: str | None = None) -> str | None:
  """Why backend `name` cannot run `recipe` here (None when it can)."""
  module, reason = _load(name)
  return reason if module is None else module.unavailable_reason(recipe)


def resolve(name: str, recipe: str | None = None, *, shape=None, mesh=None,
            expert_axis: str = "expert") -> ModuleType:
  """The backend module for `name` ("auto" picks the best available one for `recipe` and, when
  `shape` (validation.LayerShape) is given, for that layer on `mesh`)."""
  if name not in NAMES:
    raise ValueError(f"backend must be one of {NAMES}, got {name!r}")
  if name == "auto":
    for candidate in _MODULES:
      if unavailable_reason(candidate, recipe) is not None:
        continue
      module = _load(candidate)[0]
      if hasattr(module, "auto_reason"):
        if module.auto_reason(shape, mesh, expert_axis) is not None:
          continue
      return module
    raise AssertionError("the reference backend is always available")
  reason = unavailable_reason(name, recipe)
  if reason is not None:
    raise BackendUnavailableError(f"backend {name!r} is not available: {reason}")
  return _load(name)[0]

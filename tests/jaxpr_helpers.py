"""Walking programs in tests: the sub-jaxprs an equation carries in its params; the
computations of an optimised HLO module that hold a given call."""

import re


def sub_jaxprs(params):
  """The jaxprs among an equation's params (scan, pjit, custom_vjp bodies)."""
  for v in params.values():
    for item in (v if isinstance(v, (list, tuple)) else (v,)):
      if hasattr(item, "jaxpr") and hasattr(item.jaxpr, "eqns"):
        yield item.jaxpr
      elif hasattr(item, "eqns"):
        yield item


def hlo_computations_holding(compiled_text: str, target: str) -> list[str]:
  """The header lines of the computations of an optimised HLO module's text (as_text() of a
  compiled jit) that contain `target` (e.g. a custom call's name)."""
  computations = re.split(r"\n(?=\S.*\{\n)", compiled_text)
  return [c.split("\n", 1)[0] for c in computations if target in c]

"""Walking jaxprs in tests: the sub-jaxprs an equation carries in its params."""


def sub_jaxprs(params):
  """The jaxprs among an equation's params (scan, pjit, custom_vjp bodies)."""
  for v in params.values():
    for item in (v if isinstance(v, (list, tuple)) else (v,)):
      if hasattr(item, "jaxpr") and hasattr(item.jaxpr, "eqns"):
        yield item.jaxpr
      elif hasattr(item, "eqns"):
        yield item

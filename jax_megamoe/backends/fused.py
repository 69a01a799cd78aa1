"""Backend "fused": one overlapping dispatch + grouped GEMM + combine kernel per direction.

Not built yet (see the project's issues); "auto" skips it and asking for it explains why.
"""

NAME = "fused"


def unavailable_reason(recipe: str | None = None) -> str | None:
  del recipe
  return ("the fused single-kernel path is not implemented yet; use backend='cuda' "
          "(separate dispatch | grouped GEMM | combine kernels) or 'reference'")


def moe(x, topk_ids, topk_weights, w_gate_up, w_down, *, mesh, expert_axis, recipe, shape):
  raise NotImplementedError(unavailable_reason(recipe))

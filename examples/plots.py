"""PNG plots of training runs (matplotlib, optional: every function returns False and says so
when it is not installed)."""

from __future__ import annotations

import sys

import numpy as np


def _pyplot():
  try:
    import matplotlib
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib is not installed: skipping plots (pip install matplotlib)",
          file=sys.stderr)
    return None
  return plt


def loss_curve(steps, loss, aux_loss, path: str, title: str = "") -> bool:
  """Cross-entropy (left axis) and load-balancing aux loss (right axis) per step."""
  plt = _pyplot()
  if plt is None:
    return False
  fig, ax = plt.subplots(figsize=(7, 4))
  ax.plot(steps, loss, color="tab:blue", lw=1, label="loss (cross-entropy)")
  ax.set_xlabel("step")
  ax.set_ylabel("cross-entropy (nats/token)", color="tab:blue")
  ax.grid(alpha=0.3)
  ax2 = ax.twinx()
  ax2.plot(steps, aux_loss, color="tab:orange", lw=1, alpha=0.7, label="load-balancing loss")
  ax2.set_ylabel("load-balancing loss (1 = balanced)", color="tab:orange")
  ax.set_title(title or "training loss")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


def expert_load_heatmap(steps, loads: np.ndarray, path: str) -> bool:
  """loads [steps, moe layers, experts] (fractions of routed slots). Left: per layer and expert,
  averaged over the last tenth of the run. Right: every expert over time, averaged over layers.
  Both shown relative to the balanced load 1/E."""
  plt = _pyplot()
  if plt is None:
    return False
  loads = np.asarray(loads)
  num_experts = loads.shape[-1]
  tail = loads[-max(1, len(loads) // 10):].mean(axis=0) * num_experts       # [M, E]
  over_time = loads.mean(axis=1).T * num_experts                              # [E, steps]
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4),
                                 gridspec_kw={"width_ratios": [1, 2]})
  im = ax1.imshow(tail, aspect="auto", cmap="viridis", interpolation="nearest")
  ax1.set_xlabel("expert")
  ax1.set_ylabel("MoE layer")
  ax1.set_yticks(range(tail.shape[0]))
  ax1.set_title("load / balanced load, end of run")
  fig.colorbar(im, ax=ax1)
  im = ax2.imshow(over_time, aspect="auto", cmap="viridis", interpolation="nearest",
                  extent=(steps[0], steps[-1], num_experts - 0.5, -0.5))
  ax2.set_xlabel("step")
  ax2.set_ylabel("expert")
  ax2.set_title("load / balanced load over training (mean over layers)")
  fig.colorbar(im, ax=ax2)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


def compare_curves(runs, path: str, ylabel: str = "loss") -> bool:
  """runs: [(label, steps, values)]. Top: the curves; bottom: each run minus the first."""
  plt = _pyplot()
  if plt is None:
    return False
  fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True,
                                 gridspec_kw={"height_ratios": [2, 1]})
  base_steps, base = np.asarray(runs[0][1]), np.asarray(runs[0][2])
  for label, steps, values in runs:
    ax1.plot(steps, values, lw=1, label=label)
  for label, steps, values in runs[1:]:
    common, i, j = np.intersect1d(base_steps, np.asarray(steps), return_indices=True)
    ax2.plot(common, np.asarray(values)[j] - base[i], lw=1, label=f"{label} - {runs[0][0]}")
  ax1.set_ylabel(ylabel)
  ax1.legend()
  ax1.grid(alpha=0.3)
  ax2.set_xlabel("step")
  ax2.set_ylabel("difference")
  ax2.legend()
  ax2.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True

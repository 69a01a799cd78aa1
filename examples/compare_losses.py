"""Compares the loss curves of training runs (e.g. --backend reference vs cuda, same seed):
plots them in one PNG and prints the largest difference over the steps they share.

  python examples/compare_losses.py runs/reference runs/cuda --out runs/loss_parity.png

Each argument is a run directory (or its losses.json) written by train_qwen3_moe.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plots  # noqa: E402


def load_run(path: str) -> dict:
  filename = os.path.join(path, "losses.json") if os.path.isdir(path) else path
  if not os.path.exists(filename):
    raise FileNotFoundError(f"no losses.json at {filename!r} (is {path!r} a training run?)")
  with open(filename) as f:
    return json.load(f)


def max_difference(a_steps, a_values, b_steps, b_values) -> tuple[float, float, int]:
  """(max |b - a|, max |b - a| / |a|, step of the max) over the shared steps."""
  common, i, j = np.intersect1d(np.asarray(a_steps), np.asarray(b_steps), return_indices=True)
  if not common.size:
    raise ValueError("the runs share no steps")
  a, b = np.asarray(a_values, np.float64)[i], np.asarray(b_values, np.float64)[j]
  diff = np.abs(b - a)
  worst = int(np.argmax(diff))
  return float(diff[worst]), float(np.max(diff / np.abs(a))), int(common[worst])


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("runs", nargs="+", help="run directories or losses.json files (first = base)")
  p.add_argument("--labels", default=None, help="comma-separated labels (default: backend)")
  p.add_argument("--key", default="ce", choices=["ce", "loss", "aux", "z", "grad_norm"],
                 help="curve to compare (ce: cross-entropy, loss: ce + aux terms)")
  p.add_argument("--out", default="loss_comparison.png", help="PNG to write")
  args = p.parse_args(argv)
  if len(args.runs) < 2:
    p.error("give at least two runs")
  runs = [load_run(r) for r in args.runs]
  labels = (args.labels.split(",") if args.labels else
            [f"{r['args']['backend']} ({os.path.basename(os.path.normpath(path))})"
             for r, path in zip(runs, args.runs)])
  if len(labels) != len(runs):
    p.error(f"--labels has {len(labels)} names for {len(runs)} runs")
  base = runs[0]
  result = {}
  for label, run in zip(labels[1:], runs[1:]):
    diff, rel, step = max_difference(base["step"], base[args.key], run["step"], run[args.key])
    result[label] = dict(max_abs_diff=diff, max_rel_diff=rel, at_step=step)
    print(f"{label} vs {labels[0]}: max |diff| of {args.key} = {diff:.3e} (step {step}), "
          f"max relative {rel:.3e}")
  if plots.compare_curves([(label, r["step"], r[args.key]) for label, r in zip(labels, runs)],
                          args.out, ylabel=args.key):
    print(f"wrote {args.out}")
  return result


if __name__ == "__main__":
  main()

"""The per-layer benchmark problem (Prime Intellect's set-up, DESIGN.md §2): shapes, routing,
and the FLOP / traffic / floor arithmetic every implementation is scored with.

Routing is generated once with numpy from a seed, so every implementation (JAX or PyTorch, in
any process) routes exactly the same tokens to exactly the same experts.
"""

from __future__ import annotations

import dataclasses

import numpy as np

SHAPES = {  # name -> (hidden H, expert ffn F)
    "30b": (2048, 768),     # Qwen3-30B-A3B
    "235b": (4096, 1536),   # Qwen3-235B-A22B
    "small": (512, 256),    # numerics checks: kernel-friendly multiples of 128
    "tiny": (64, 32),       # smoke tests
}
NUM_EXPERTS = 128
TOP_K = 8
RECIPES = ("bf16", "fp8")
PASSES = ("fwd", "bwd", "2f1b")
# Device ceilings measured on this workplace's H200 (DESIGN.md §2), TFLOP/s.
CEILING_TFLOPS = {"bf16": 801.0, "fp8": 1446.0}
# Expert FLOPs of a pass, in forwards: backward is 2 forwards, 2F+1B is 4.
PASS_FORWARDS = {"fwd": 1, "bwd": 2, "2f1b": 4}
# Routed-row transfers of a pass, in one-way exchanges (dispatch or combine): the forward sends
# rows out and results back; the backward sends gradients back out and in; 2F+1B does 3 of those.
PASS_EXCHANGES = {"fwd": 2, "bwd": 2, "2f1b": 6}


@dataclasses.dataclass(frozen=True)
class Problem:
  shape: str
  hidden: int
  ffn: int
  tokens_per_gpu: int
  num_gpus: int
  ep: int
  num_experts: int = NUM_EXPERTS
  top_k: int = TOP_K

  @property
  def num_tokens(self) -> int:
    return self.tokens_per_gpu * self.num_gpus

  def expert_flops_per_gpu(self, pass_name: str) -> float:
    """tokens x k x 6 x H x F per forward (gate, up, down GEMMs at 2 FLOPs per MAC)."""
    fwd = self.tokens_per_gpu * self.top_k * 6 * self.hidden * self.ffn
    return float(fwd * PASS_FORWARDS[pass_name])

  def floor_ms(self, pass_name: str, recipe: str) -> float:
    """Compute floor: expert FLOPs at the measured matmul ceiling of the recipe."""
    return self.expert_flops_per_gpu(pass_name) / (CEILING_TFLOPS[recipe] * 1e12) * 1e3


def make_problem(shape: str, tokens_per_gpu: int, num_gpus: int, ep: int,
                 num_experts: int = NUM_EXPERTS, top_k: int = TOP_K) -> Problem:
  hidden, ffn = SHAPES[shape]
  return Problem(shape, hidden, ffn, tokens_per_gpu, num_gpus, ep, num_experts, top_k)


def make_routing(num_tokens: int, num_experts: int, top_k: int, *, seed: int = 0,
                 skew: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
  """(topk_ids [T, k] int32, distinct per token; topk_weights [T, k] float32, rows sum to 1).

  skew = 0: uniform random experts. skew = s > 0: experts drawn without replacement with
  probability proportional to 1 / rank^s (Zipf), rank a fixed random permutation of the experts
  (so the hot experts do not all live on rank 0). Gumbel top-k draws without replacement.
  """
  rng = np.random.default_rng(seed)
  log_p = np.zeros(num_experts)
  if skew > 0:
    ranks = rng.permutation(num_experts) + 1
    log_p = -skew * np.log(ranks)
  ids = np.empty((num_tokens, top_k), np.int32)
  chunk = 8192  # bounded memory for large T
  for start in range(0, num_tokens, chunk):
    n = min(chunk, num_tokens - start)
    keys = log_p[None, :] + rng.gumbel(size=(n, num_experts))
    ids[start:start + n] = np.argpartition(-keys, top_k - 1, axis=1)[:, :top_k]
  logits = rng.normal(size=(num_tokens, top_k)).astype(np.float32)
  weights = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
  return ids, weights.astype(np.float32)


def remote_rows_per_gpu(topk_ids: np.ndarray, problem: Problem) -> float:
  """Mean (token, remote rank) pairs per GPU: the rows a deduplicating dispatch must send, one
  per token per other rank of its EP group that holds at least one of its experts."""
  experts_per_rank = problem.num_experts // problem.ep
  tokens = topk_ids.shape[0]
  own_rank = (np.arange(tokens) // problem.tokens_per_gpu) % problem.ep
  dest = topk_ids // experts_per_rank
  pairs = 0
  for rank in range(problem.ep):
    pairs += int(((dest == rank).any(axis=1) & (own_rank != rank)).sum())
  return pairs / problem.num_gpus


def exchange_bytes_per_gpu(topk_ids: np.ndarray, problem: Problem, pass_name: str,
                           bytes_per_value: int = 2) -> float:
  """The least NVLink traffic one GPU sends in a pass: one H-row of bf16 per (token, remote
  rank) pair per one-way exchange (dispatch or combine). Per-slot exchanges (the baselines)
  move up to k / (distinct ranks) times more; the figure is a common yardstick, not their bytes."""
  if problem.ep == 1:
    return 0.0
  rows = remote_rows_per_gpu(topk_ids, problem)
  return rows * problem.hidden * bytes_per_value * PASS_EXCHANGES[pass_name]

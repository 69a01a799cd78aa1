"""Median wall-clock timing of device-synchronised calls, and failure classification.

Every timed call must return only once the device has finished (JAX: jax.block_until_ready;
PyTorch: torch.cuda.synchronize), so a wall-clock interval is the device time of the call plus
its host dispatch. measure_queued_ms times calls queued back to back instead (one wait per
few calls: the host dispatch hidden where the device is the bottleneck).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import numpy as np


def measure_ms(call: Callable[[], object], *, warmup: int = 2, reps: int = 20,
               cap_s: float = 5.0, min_reps: int = 3) -> dict:
  """Median ms of `call()` after `warmup` calls; stops early after `cap_s` of timing (keeping
  at least min_reps samples). Returns {"ms", "samples", "spread"} (spread: (p90-p10)/median)."""
  for _ in range(warmup):
    call()
  times = []
  start = time.perf_counter()
  for i in range(reps):
    t0 = time.perf_counter()
    call()
    times.append((time.perf_counter() - t0) * 1e3)
    if i + 1 >= min_reps and time.perf_counter() - start > cap_s:
      break
  median = statistics.median(times)
  p10, p90 = np.percentile(times, [10, 90])
  return {"ms": median, "samples": len(times), "spread": float((p90 - p10) / median)}


# Calls queued per sample by measure_queued_ms: enough to hide one call's host round trip behind
# the others, few enough that the outputs they keep alive fit beside the inputs.
QUEUE_DEPTH = 5


def measure_queued_ms(call: Callable[[], object], wait: Callable[[object], object], *,
                      depth: int = QUEUE_DEPTH, samples: int = 5) -> dict:
  """Per-call ms with `depth` calls queued back to back and one wait(outputs) at the end, median
  of `samples` such runs: the host's dispatch of a call overlaps the device work of the ones
  before it, as inside a longer program (measure_ms waits on every call, so each of its samples
  also holds one host round trip). {"queued_ms", "queue_depth"}."""
  wait([call() for _ in range(depth)])  # warm
  per_call = []
  for _ in range(samples):
    t0 = time.perf_counter()
    wait([call() for _ in range(depth)])
    per_call.append((time.perf_counter() - t0) * 1e3 / depth)
  return {"queued_ms": statistics.median(per_call), "queue_depth": depth}


def alone_and_queued_ms(call: Callable[[], object], wait: Callable[[object], object],
                        reps: int) -> tuple[float, float]:
  """(measure_ms of wait(call()) over `reps`, measure_queued_ms of call): a call's median time
  alone and queued, for the small per-call benchmarks (bench_route, bench_embedding_grad)."""
  alone = measure_ms(lambda: wait(call()), reps=reps)["ms"]
  return alone, measure_queued_ms(call, wait)["queued_ms"]


def classify_error(err: BaseException | str) -> tuple[str, str]:
  """(status, short message): status "oom" for out-of-memory, else "failed"."""
  text = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
  text = " ".join(text.split())
  oom_markers = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OutOfMemory")
  status = "oom" if any(m in text for m in oom_markers) else "failed"
  # A traceback's last line names the error: keep the start (what failed) and the end (why).
  return status, text if len(text) <= 600 else f"{text[:250]} ... {text[-350:]}"


class Deadline:
  """The run's time budget: `expired` once `budget_s` seconds have passed since creation."""

  def __init__(self, budget_s: float | None):
    self.end = None if budget_s is None else time.monotonic() + budget_s

  def left(self) -> float:
    return float("inf") if self.end is None else self.end - time.monotonic()

  @property
  def expired(self) -> bool:
    return self.left() <= 0


def start_watchdog(seconds: float, on_timeout: Callable[[], None]):
  """Calls on_timeout() and exits the process (status 3) if still running after `seconds`: a
  hung collective or compile must not lose what was already measured. Returns the timer
  (cancel() it when done)."""
  import os  # noqa: PLC0415
  import threading  # noqa: PLC0415

  def fire():
    try:
      on_timeout()
    finally:
      os._exit(3)

  timer = threading.Timer(seconds, fire)
  timer.daemon = True
  timer.start()
  return timer

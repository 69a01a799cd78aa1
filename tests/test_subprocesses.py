"""tests/subprocesses.run_all, which the multi-process tests run their workers with: every
worker's output comes back (more than a pipe holds, too), a worker that fails gets its blocked
peers killed after a grace period, and a hang raises with each worker's last output; and which
GPU a worker is given."""

import os
import sys
import time

import pytest

from subprocesses import WorkersTimedOut, gpu_worker_env, run_all, visible_gpu

ENV = dict(os.environ, PYTHONUNBUFFERED="1")


def _py(code: str) -> list[str]:
  return [sys.executable, "-c", code]


def test_outputs_larger_than_a_pipe_come_back_from_every_worker():
  # 200 KB each: with the pipes read one after the other, the second worker would block on its
  # full pipe while the first is awaited.
  code = "import sys; sys.stdout.write('{}' * 200_000); print(' done {}')"
  procs, outs = run_all([_py(code.format("a", 0)), _py(code.format("b", 1))], [ENV, ENV],
                        timeout=60)
  assert [p.returncode for p in procs] == [0, 0]
  assert outs[0].count("a") == 200_000 and outs[0].endswith("done 0\n")
  assert outs[1].count("b") == 200_000 and outs[1].endswith("done 1\n")


def test_a_failing_worker_gets_its_blocked_peer_killed_after_the_grace():
  start = time.monotonic()
  procs, outs = run_all([_py("print('waiting', flush=True); import time; time.sleep(120)"),
                         _py("import sys; print('failing'); sys.exit(3)")],
                        [ENV, ENV], timeout=60, peer_grace=1.0)
  assert time.monotonic() - start < 30
  assert procs[1].returncode == 3 and "failing" in outs[1]
  assert procs[0].returncode != 0
  assert outs[0].startswith("waiting")
  assert "[run_all: killed 1 s after process 1 exited with code 3]" in outs[0]


def test_without_grace_a_peer_may_finish_after_a_failure():
  procs, outs = run_all([_py("import time; time.sleep(2); print('late but fine')"),
                         _py("import sys; sys.exit(5)")],
                        [ENV, ENV], timeout=60, peer_grace=None)
  assert [p.returncode for p in procs] == [0, 5]
  assert "late but fine" in outs[0]


def test_a_hang_raises_with_every_workers_output():
  with pytest.raises(WorkersTimedOut) as info:
    run_all([_py("print('stuck in step 7', flush=True); import time; time.sleep(120)"),
             _py("print('finished')")], [ENV, ENV], timeout=2)
  text = str(info.value)
  assert "after 2 s" in text
  assert "process 0 (killed at the time limit)" in text and "stuck in step 7" in text
  assert "process 1 (exit 0)" in text and "finished" in text


def test_workers_get_the_gpus_the_test_sees(monkeypatch):
  """On a slice of a larger host (CUDA_VISIBLE_DEVICES set), worker i gets the slice's i-th GPU,
  not the host's; without it, GPU i."""
  assert visible_gpu(1, {}) == "1"
  assert visible_gpu(1, {"CUDA_VISIBLE_DEVICES": "4, 5"}) == "5"
  assert visible_gpu(0, {"CUDA_VISIBLE_DEVICES": "GPU-8f1e,GPU-77aa"}) == "GPU-8f1e"
  with pytest.raises(ValueError, match="names 1"):
    visible_gpu(1, {"CUDA_VISIBLE_DEVICES": "6,-1,7"})
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
  assert gpu_worker_env()["CUDA_VISIBLE_DEVICES"] == "4,5"

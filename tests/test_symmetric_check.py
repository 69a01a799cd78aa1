"""symmetric.check_all: every workspace the cache made (current and retired) is asked for a
recorded kernel error, so a timeout in a run's last call does not go unreported."""

import pytest

from jax_megamoe import symmetric


class _Workspace:
  def __init__(self, error=None):
    self.error, self.checked = error, False

  def check(self):
    self.checked = True
    if self.error:
      raise RuntimeError(self.error)


def test_check_all_asks_every_workspace(monkeypatch):
  current, retired = _Workspace(), _Workspace()
  monkeypatch.setattr(symmetric, "_cache", {("mesh",): current})
  monkeypatch.setattr(symmetric, "_retired", [retired])
  symmetric.check_all()
  assert current.checked and retired.checked


def test_check_all_raises_a_recorded_timeout(monkeypatch):
  monkeypatch.setattr(symmetric, "_cache", {("mesh",): _Workspace()})
  monkeypatch.setattr(symmetric, "_retired",
                      [_Workspace("EP wait timed out after 20 s: rank 1, stage combine")])
  with pytest.raises(RuntimeError, match="rank 1, stage combine"):
    symmetric.check_all()

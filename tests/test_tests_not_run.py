"""scripts/tests_not_run.py: a pytest run cut off at its limit is reported as not run, never read
as a pass (its log still ends "N passed")."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "tests_not_run.py"

# A test file whose third test interrupts pytest as the device scripts' SIGINT at the limit does.
_TESTS = """
import os, signal
def test_first(): pass
class TestGroup:
  def test_method(self): pass
def test_cut_off(): os.kill(os.getpid(), signal.SIGINT)
def test_never_started(): pass
"""


def _not_run(log, xml):
  return subprocess.run([sys.executable, str(SCRIPT), str(log), str(xml)], capture_output=True,
                        text=True, timeout=60)


def _pytest(tmp_path, *args):
  (tmp_path / "tests").mkdir(exist_ok=True)
  (tmp_path / "tests" / "test_sample.py").write_text(_TESTS)
  log, xml = tmp_path / "run.log", tmp_path / "run.xml"
  run = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider",
                        "-p", "no:xdist", f"--junitxml={xml}", "tests", *args],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
  log.write_text(run.stdout + run.stderr)
  return log, xml


def test_an_interrupted_run_names_the_test_cut_off(tmp_path):
  log, xml = _pytest(tmp_path)
  assert "2 passed" in log.read_text()  # what a tail of the log shows
  out = _not_run(log, xml)
  assert out.returncode == 1, out.stdout + out.stderr
  assert "NOT RUN: 2 of 4 selected tests did not finish" in out.stdout
  assert "(1 started and cut off, 1 never started)" in out.stdout
  assert "cut off: tests/test_sample.py::test_cut_off" in out.stdout
  assert "test_method" not in out.stdout  # a class's test finished: found under its class


def test_a_whole_run_with_deselected_tests_passes(tmp_path):
  log, xml = _pytest(tmp_path, "-k", "not cut_off")
  out = _not_run(log, xml)
  assert out.returncode == 0, out.stdout + out.stderr
  assert out.stdout.strip() == "all 3 selected tests finished"


def test_an_xdist_log(tmp_path):
  """pytest-xdist's verbose log (its form from a device run): a test's id as it starts, then
  "[gwN] [ P%] PASSED id" when it ends."""
  log, xml = tmp_path / "run.log", tmp_path / "run.xml"
  log.write_text("created: 2/2 workers\n2 workers [3 items]\n\n"
                 "tests/test_a.py::test_x[1] \ntests/test_a.py::test_y \n"
                 "[gw0] [ 33%] PASSED tests/test_a.py::test_x[1] \n"
                 "tests/test_a.py::test_x[2] \n"
                 "[gw0] [ 66%] FAILED tests/test_a.py::test_x[2] \n"
                 "!!!!!!!!! KeyboardInterrupt !!!!!!!!!\n=== 1 failed, 1 passed in 9.0s ===\n")
  xml.write_text('<testsuites><testsuite name="pytest">'
                 '<testcase classname="tests.test_a" name="test_x[1]" time="1.0" />'
                 '<testcase classname="tests.test_a" name="test_x[2]" time="1.0">'
                 '<failure message="boom" /></testcase>'
                 '<testcase time="0.000" /></testsuite></testsuites>')
  out = _not_run(log, xml)
  assert out.returncode == 1
  assert out.stdout.startswith("NOT RUN: 1 of 3 selected tests did not finish (1 started and "
                                "cut off, 0 never started)")
  assert out.stdout.splitlines()[1:] == ["  cut off: tests/test_a.py::test_y"]


def test_a_log_without_a_selection_is_not_a_pass(tmp_path):
  log, xml = tmp_path / "run.log", tmp_path / "run.xml"
  log.write_text("ImportError while loading conftest\n")
  xml.write_text('<testsuites><testsuite name="pytest" /></testsuites>')
  out = _not_run(log, xml)
  assert out.returncode == 1
  assert out.stdout.startswith("NOT RUN: unknown;")

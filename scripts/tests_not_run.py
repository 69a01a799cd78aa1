"""Which selected tests of a pytest run did not finish: the ones a time limit cut off.

A run stopped at its limit (SIGINT) still writes its JUnit XML and ends with "N passed", so
a tail of its log reads like a full pass. This compares the count pytest selected (from its
verbose log, with or without xdist) against the tests the JUnit XML holds, and names the tests
that started and did not finish.

  python3 scripts/tests_not_run.py LOG JUNIT_XML

Prints one line when every selected test finished; otherwise "NOT RUN: ..." and the names, and
exits 1.
"""
import re
import sys
import xml.etree.ElementTree as ET

_XDIST_ITEMS = re.compile(r"^\d+ workers \[(\d+) items?\]", re.M)
# "collected 6 items / 1 deselected / 5 selected", after "collecting ... " on a terminal.
_COLLECTED = re.compile(r"\bcollected (\d+) items?(?: / (\d+) deselected)?(?: / (\d+) selected)?")
# A verbose line naming a test: with xdist "tests/a.py::t[x] " as it starts and
# "[gw1] [ 50%] PASSED tests/a.py::t[x]" when it ends; without, "tests/a.py::t[x] PASSED [ 50%]".
_NODE_ID = re.compile(r"(?:^|\s)((?:[\w.-]+/)*[\w.-]+\.py::\S+)")


def selected_count(log):
  """How many tests pytest selected, from its header; None if the log has none."""
  m = _XDIST_ITEMS.search(log)
  if m:
    return int(m.group(1))
  m = _COLLECTED.search(log)
  if not m:
    return None
  collected, deselected, selected = (int(g) if g else None for g in m.groups())
  return selected if selected is not None else collected - (deselected or 0)


def finished_tests(junit_xml):
  """The (classname, name) of every test case the JUnit XML records as finished. A test that an
  interrupt cut off stands there as a bare <testcase time="0.000" />, without a name."""
  root = ET.parse(junit_xml).getroot()
  return {(c.get("classname", ""), c.get("name")) for c in root.iter("testcase")
          if c.get("name")}


def junit_key(node_id):
  """A node id "tests/a.py::Cls::t[x]" as JUnit names it: ("tests.a.Cls", "t[x]")."""
  path, *scopes = node_id.split("::")
  module = path[:-len(".py")].replace("/", ".")
  return ".".join([module, *scopes[:-1]]), scopes[-1]


def main(argv):
  if len(argv) != 3:
    sys.exit(__doc__)
  log = open(argv[1], errors="replace").read()
  finished = finished_tests(argv[2])
  selected = selected_count(log)
  if selected is None:
    print(f"NOT RUN: unknown; {argv[1]} has no 'collected' or 'workers [N items]' line "
          f"(pytest stopped before collecting?); {len(finished)} tests finished")
    return 1
  if len(finished) >= selected:
    print(f"all {selected} selected tests finished")
    return 0
  started = dict.fromkeys(_NODE_ID.findall(log))
  cut = [n for n in started if junit_key(n) not in finished]
  never = selected - len(finished) - len(cut)
  print(f"NOT RUN: {selected - len(finished)} of {selected} selected tests did not finish "
        f"({len(cut)} started and cut off, {max(never, 0)} never started):")
  for name in cut:
    print(f"  cut off: {name}")
  return 1


if __name__ == "__main__":
  sys.exit(main(sys.argv))

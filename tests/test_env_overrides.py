"""The heuristics' one-character environment overrides (ffi/heuristics/env_override.h), compiled
and run on the CPU: each takes its choices, falls back to its default when unset or empty, and
refuses anything else by name (the GPU tests see the same refusals through the handlers, and
each override reach its launch)."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Prints one line per query: the error text, or "ok <value>".
PROGRAM = r"""
#include <cstdio>
#include <cstring>
#include <string>
#include "ffi/heuristics/fused_l2_store.h"
#include "ffi/heuristics/fused_tile_order.h"
#include "ffi/heuristics/moe_dgrad_core.h"
using namespace megamoe::heuristics;
int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const char* what = argv[1];
  bool v = false;
  std::string err = "unknown query";
  if (!std::strcmp(what, "l2")) err = FusedL2RowsByTma(true, &v);
  if (!std::strcmp(what, "l2_ranks")) err = FusedL2RowsByTma(false, &v);
  if (!std::strcmp(what, "l1_30b")) err = FusedL1NMajor(2048, 768, false, &v);
  if (!std::strcmp(what, "l1_235b")) err = FusedL1NMajor(4096, 1536, false, &v);
  if (!std::strcmp(what, "dgrad_30b")) err = UseMoeDgradCore(true, 2048, 768, &v);
  if (!std::strcmp(what, "dgrad_235b")) err = UseMoeDgradCore(true, 4096, 1536, &v);
  if (!std::strcmp(what, "dgrad_unsupported")) err = UseMoeDgradCore(false, 2048, 768, &v);
  if (err.empty()) std::printf("ok %d\n", v ? 1 : 0);
  else std::printf("%s\n", err.c_str());
  return 0;
}
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
  cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
  if cxx is None:
    pytest.skip("no C++ compiler on PATH")
  d = tmp_path_factory.mktemp("env_overrides")
  (d / "probe.cc").write_text(PROGRAM)
  subprocess.run([cxx, "-std=c++17", f"-I{ROOT}", str(d / "probe.cc"), "-o", str(d / "probe")],
                 check=True, capture_output=True)

  def run(what, name=None, value=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGAMOE_")}
    if name is not None:
      env[name] = value
    return subprocess.run([str(d / "probe"), what], env=env, check=True, capture_output=True,
                          text=True).stdout.strip()
  return run


# The defaults are the headers' (30B: H 2048, F 768; 235B: H 4096, F 1536): update with them.
@pytest.mark.parametrize("what, name, default, choices", [
    ("l2", "MEGAMOE_FUSED_L2_TMA", "ok 0", {"0": "ok 0", "1": "ok 1"}),
    ("l2_ranks", "MEGAMOE_FUSED_L2_TMA", "ok 0", {"0": "ok 0", "1": "ok 0"}),  # one rank only
    ("l1_30b", "MEGAMOE_FUSED_L1_ORDER", "ok 0", {"m": "ok 0", "n": "ok 1"}),
    ("l1_235b", "MEGAMOE_FUSED_L1_ORDER", "ok 1", {"m": "ok 0", "n": "ok 1"}),
    ("dgrad_30b", "MEGAMOE_DGRAD_CORE", "ok 1", {"0": "ok 0", "1": "ok 1"}),
    ("dgrad_235b", "MEGAMOE_DGRAD_CORE", "ok 0", {"0": "ok 0", "1": "ok 1"}),
    ("dgrad_unsupported", "MEGAMOE_DGRAD_CORE", "ok 0", {"0": "ok 0", "1": "ok 0"}),
])
def test_override_takes_its_choices_and_refuses_the_rest(probe, what, name, default, choices):
  assert probe(what) == default
  assert probe(what, name, "") == default
  for value, want in choices.items():
    assert probe(what, name, value) == want, (name, value)
  allowed = " or ".join(choices)
  for bad in ("2", "yes", "N", " 1", "1 ", "01"):
    if bad in choices:
      continue
    assert probe(what, name, bad) == f"{name} must be {allowed}, got '{bad}'", (name, bad)

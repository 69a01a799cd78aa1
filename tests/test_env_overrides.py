"""The heuristics' environment overrides (ffi/heuristics/), compiled and run on the CPU: each
takes its choices, falls back to its default when unset or empty, and refuses anything else by
name (the GPU tests see the same refusals through the handlers, and each override reach its
launch). The one-character ones share env_override.h; the GEMM variants are gemm_variants.h's."""

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


# The GEMM variants' probe: each query prints "ok <fprop> <dgrad> <wgrad>" (128 groups) or the
# error text; then FP8's "fp8 ok <variant>" or its error, and the same for its wgrad.
GEMM_PROGRAM = r"""
#include <cstdio>
#include <string>
#include "ffi/heuristics/gemm_variants.h"
using namespace megamoe::heuristics;
using megamoe::grouped::GemmKind;
int main() {
  int v[3] = {0, 0, 0};
  std::string err;
  const GemmKind kinds[3] = {GemmKind::kFprop, GemmKind::kDgrad, GemmKind::kWgrad};
  for (int k = 0; k < 3; ++k) err = Bf16GemmVariant(kinds[k], 128, &v[k]);
  if (err.empty()) std::printf("ok %d %d %d\n", v[0], v[1], v[2]);
  else std::printf("%s\n", err.c_str());
  int f = 0;
  err = Fp8GemmVariant(&f);
  if (err.empty()) std::printf("fp8 ok %d\n", f);
  else std::printf("%s\n", err.c_str());
  err = Fp8WgradVariant(&f);
  if (err.empty()) std::printf("wgrad ok %d\n", f);
  else std::printf("%s\n", err.c_str());
  return 0;
}
"""


def _cuda_include():
  """A directory holding cuda_runtime.h (grouped_gemm.h includes it), or None."""
  nvcc = shutil.which("nvcc")
  candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda",
                str(pathlib.Path(nvcc).resolve().parents[1]) if nvcc else None]
  for c in candidates:
    if c and (pathlib.Path(c) / "include" / "cuda_runtime.h").exists():
      return str(pathlib.Path(c) / "include")
  return None


def _compile(tmp_path_factory, name, source, includes=()):
  cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
  if cxx is None:
    pytest.skip("not run: no C++ compiler on PATH")
  d = tmp_path_factory.mktemp(name)
  (d / "probe.cc").write_text(source)
  flags = [f"-I{ROOT}", *(f"-I{i}" for i in includes)]
  subprocess.run([cxx, "-std=c++17", *flags, str(d / "probe.cc"), "-o", str(d / "probe")],
                 check=True, capture_output=True)

  def run(*argv, overrides=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGAMOE_")}
    env.update(overrides or {})
    return subprocess.run([str(d / "probe"), *argv], env=env, check=True, capture_output=True,
                          text=True).stdout.strip()
  return run


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
  run = _compile(tmp_path_factory, "env_overrides", PROGRAM)
  return lambda what, name=None, value=None: run(
      what, overrides=None if name is None else {name: value})


@pytest.fixture(scope="module")
def gemm_probe(tmp_path_factory):
  cuda = _cuda_include()
  if cuda is None:
    pytest.skip("not run: no CUDA headers (cuda_runtime.h) for ffi/gemm/grouped_gemm.h")
  return _compile(tmp_path_factory, "gemm_variants", GEMM_PROGRAM, [cuda])


# The defaults are the headers' (30B: H 2048, F 768; 235B: H 4096, F 1536): update with them.
@pytest.mark.parametrize("what, name, default, choices", [
    ("l2", "MEGAMOE_FUSED_L2_TMA", "ok 1", {"0": "ok 0", "1": "ok 1"}),
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


BF16 = "MEGAMOE_GROUPED_GEMM_VARIANT"
BF16_ERROR = (f"{BF16} must be one digit below 3 or kind:digit items joined by commas, each of "
              "fprop, dgrad, wgrad at most once, got '{}'")


@pytest.mark.parametrize("value, want", [
    (None, "ok 0 0 2"),  # the defaults at 128 groups (wgrad: ping-pong with many groups)
    ("", "ok 0 0 2"),
    ("1", "ok 1 1 1"),
    ("dgrad:2", "ok 0 2 2"),
    ("wgrad:0,fprop:1", "ok 1 0 0"),
    ("fprop:2,dgrad:1,wgrad:0", "ok 2 1 0"),
])
def test_bf16_gemm_variant_override(gemm_probe, value, want):
  out = gemm_probe(overrides={} if value is None else {BF16: value}).splitlines()
  assert out[0] == want, (value, out)


@pytest.mark.parametrize("value", ["3", "x", "fprop:3", "fprop:1,", "fprop:1,fprop:2",
                                   "fprop=1", "dgrad:1 ", "1,2"])
def test_bf16_gemm_variant_override_refuses_the_rest(gemm_probe, value):
  assert gemm_probe(overrides={BF16: value}).splitlines()[0] == BF16_ERROR.format(value)


@pytest.mark.parametrize("name, line, choices", [
    ("MEGAMOE_FP8_GEMM_VARIANT", 1, "012"), ("MEGAMOE_FP8_WGRAD_VARIANT", 2, "01")])
def test_fp8_gemm_variant_overrides(gemm_probe, name, line, choices):
  prefix = "fp8" if line == 1 else "wgrad"
  assert gemm_probe().splitlines()[line] == f"{prefix} ok 0"
  for c in choices:
    assert gemm_probe(overrides={name: c}).splitlines()[line] == f"{prefix} ok {c}"
  allowed = ", ".join(choices[:-1]) + " or " + choices[-1]
  for bad in ("9", "a", "00", "-1"):
    assert gemm_probe(overrides={name: bad}).splitlines()[line] == (
        f"{name} must be {allowed}, got '{bad}'")

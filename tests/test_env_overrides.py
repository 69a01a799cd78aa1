"""The environment overrides, on the CPU: each takes its choices, falls back to its default when
unset or empty, and refuses anything else by name. The C++ ones (ffi/heuristics/) are compiled
and run here (the GPU tests see the same refusals through the handlers, and each override reach
its launch): the one-character and integer ones share env_override.h, the GEMM variants are
gemm_variants.h's. The Python ones go through jax_megamoe/env_overrides.py."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Prints one line per query: the error text, or "ok <value>".
PROGRAM = r"""
#include <cstdio>
#include <cstring>
#include <string>
#include "ffi/heuristics/fused_copy_head.h"
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
  if (!std::strcmp(what, "copy_head")) {
    int32_t percent = -1;
    err = FusedCopyHeadPercent(&percent);
    if (err.empty()) std::printf("ok %d\n", percent);
    else std::printf("%s\n", err.c_str());
    return 0;
  }
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


# The fused kernels' debug bits (its header includes fused_moe.h, hence the CUDA headers).
DEBUG_PROGRAM = r"""
#include <cstdio>
#include <string>
#include "ffi/heuristics/fused_debug.h"
int main() {
  int bits = -1;
  std::string err = megamoe::heuristics::FusedDebugBits(&bits);
  if (err.empty()) std::printf("ok %d\n", bits);
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


def _compile_with_cuda(tmp_path_factory, name, source, needs):
  """_compile with the CUDA headers on the include path (`needs`: the header that wants them)."""
  cuda = _cuda_include()
  if cuda is None:
    pytest.skip(f"not run: no CUDA headers (cuda_runtime.h) for {needs}")
  return _compile(tmp_path_factory, name, source, [cuda])


@pytest.fixture(scope="module")
def gemm_probe(tmp_path_factory):
  return _compile_with_cuda(tmp_path_factory, "gemm_variants", GEMM_PROGRAM,
                            "ffi/gemm/grouped_gemm.h")


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


@pytest.fixture(scope="module")
def debug_probe(tmp_path_factory):
  return _compile_with_cuda(tmp_path_factory, "fused_debug", DEBUG_PROGRAM,
                            "ffi/impls/fused_moe.h")


# The last two: past a long's range, and ten digits whose value fits in a long (the parser's
# nine-digit cap refuses both before any overflow).
INT_BAD = ("-1", "+5", " 5", "5 ", "0x2", "1.5", "abc", "9" * 25, "0000000007")


def _int_override_cases(run, name, default, hi, what):
  """run(value): the probe's line with `name` set to value (None: unset)."""
  assert run(None) == f"ok {default}"
  assert run("") == f"ok {default}"
  for value in ("0", "7", str(hi)):
    assert run(value) == f"ok {value}", (name, value)
  for bad in (*INT_BAD, str(hi + 1)):
    assert run(bad) == f'{name} must be {what} in [0, {hi}], got "{bad}"', (name, bad)


def test_copy_head_percent_override(probe):
  name = "MEGAMOE_FUSED_COPY_HEAD"
  _int_override_cases(lambda value: probe("copy_head", None if value is None else name, value),
                      name, 12, 100, "an integer percent")


def test_fused_debug_bits_override(debug_probe):
  name = "MEGAMOE_FUSED_DEBUG"
  _int_override_cases(lambda value: debug_probe(overrides=None if value is None else {name: value}),
                      name, 0, 31, "an integer of fused_moe.h's kFusedDebug* bits")


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


# The Python overrides (jax_megamoe/env_overrides.py) and the places that read them.

def test_python_choice_and_switch(monkeypatch):
  from jax_megamoe import env_overrides as eo
  monkeypatch.delenv("MEGAMOE_TEST_X", raising=False)
  assert eo.choice("MEGAMOE_TEST_X", ("0", "1", "auto"), "auto") == "auto"
  assert eo.switch("MEGAMOE_TEST_X", True) is True
  monkeypatch.setenv("MEGAMOE_TEST_X", "")
  assert eo.switch("MEGAMOE_TEST_X", False) is False
  for value, want in (("0", False), ("1", True)):
    monkeypatch.setenv("MEGAMOE_TEST_X", value)
    assert eo.switch("MEGAMOE_TEST_X", not want) is want
  for bad in ("false", "off", "yes", " 1", "1 ", "01", "2"):
    monkeypatch.setenv("MEGAMOE_TEST_X", bad)
    with pytest.raises(ValueError, match=f"^MEGAMOE_TEST_X must be 0 or 1, got '{bad}'$"):
      eo.switch("MEGAMOE_TEST_X", True)
  monkeypatch.setenv("MEGAMOE_TEST_X", "Auto")
  with pytest.raises(ValueError, match="^MEGAMOE_TEST_X must be 0, 1 or auto, got 'Auto'$"):
    eo.choice("MEGAMOE_TEST_X", ("0", "1", "auto"), "auto")


def test_python_positive_int_and_seconds(monkeypatch):
  from jax_megamoe import env_overrides as eo
  monkeypatch.delenv("MEGAMOE_TEST_N", raising=False)
  assert eo.positive_int("MEGAMOE_TEST_N", None) is None
  assert eo.positive_seconds("MEGAMOE_TEST_N", 2.5) == 2.5
  monkeypatch.setenv("MEGAMOE_TEST_N", "64")
  assert eo.positive_int("MEGAMOE_TEST_N", 1) == 64
  assert eo.positive_seconds("MEGAMOE_TEST_N", 1.0) == 64.0
  monkeypatch.setenv("MEGAMOE_TEST_N", "0.25")
  assert eo.positive_seconds("MEGAMOE_TEST_N", 1.0) == 0.25
  for bad in ("0", "-3", "1.5", "0x10", "ten", "٣"):  # the last: a non-ASCII digit
    monkeypatch.setenv("MEGAMOE_TEST_N", bad)
    with pytest.raises(ValueError,
                       match=f"^MEGAMOE_TEST_N must be a positive integer, got '{bad}'$"):
      eo.positive_int("MEGAMOE_TEST_N", 1)
  for bad in ("0", "-1", "nan", "inf", "soon"):
    monkeypatch.setenv("MEGAMOE_TEST_N", bad)
    with pytest.raises(ValueError,
                       match=f"^MEGAMOE_TEST_N must be a positive number of seconds, got '{bad}'$"):
      eo.positive_seconds("MEGAMOE_TEST_N", 1.0)


def test_workspace_send_settings(monkeypatch):
  """Every workspace, real or virtual, takes comm_blocks and timeout_s from symmetric.send_settings:
  the arguments, else the environment, else the defaults; bad ones named before any GPU is
  needed."""
  from jax_megamoe import symmetric, virtual_ranks
  monkeypatch.delenv("MEGAMOE_EP_COMM_BLOCKS", raising=False)
  monkeypatch.delenv("MEGAMOE_EP_TIMEOUT_S", raising=False)
  assert symmetric.send_settings(None, None, "f") == (symmetric.DEFAULT_COMM_BLOCKS,
                                                      symmetric.DEFAULT_TIMEOUT_S)
  assert symmetric.send_settings(np.int64(32), 5, "f") == (32, 5.0)
  monkeypatch.setenv("MEGAMOE_EP_COMM_BLOCKS", "64")
  monkeypatch.setenv("MEGAMOE_EP_TIMEOUT_S", "7.5")
  assert symmetric.send_settings(None, None, "f") == (64, 7.5)
  assert symmetric.send_settings(16, 2.0, "f") == (16, 2.0)
  with pytest.raises(ValueError, match="^f: comm_blocks must be a positive int, got 0$"):
    symmetric.send_settings(0, None, "f")
  with pytest.raises(ValueError, match="^f: timeout_s must be a positive number of seconds"):
    symmetric.send_settings(None, float("inf"), "f")
  monkeypatch.setenv("MEGAMOE_EP_COMM_BLOCKS", "128 blocks")
  with pytest.raises(ValueError, match="MEGAMOE_EP_COMM_BLOCKS must be a positive number of "
                                       "thread blocks, got '128 blocks'"):
    virtual_ranks.create_workspace(2, max_tokens=8, hidden=256, top_k=2)
  cpu_mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:1]), ("expert",))
  with pytest.raises(ValueError, match="MEGAMOE_EP_COMM_BLOCKS must be"):  # before "not GPUs"
    symmetric.create_workspace(cpu_mesh, "expert", max_tokens=8, hidden=256, top_k=2)
  monkeypatch.setenv("MEGAMOE_EP_COMM_BLOCKS", "64")
  monkeypatch.setenv("MEGAMOE_EP_TIMEOUT_S", "0")
  with pytest.raises(ValueError, match="MEGAMOE_EP_TIMEOUT_S must be a positive number of "
                                       "seconds, got '0'"):
    virtual_ranks.create_workspace(2, max_tokens=8, hidden=256, top_k=2)


def test_fused_backend_overrides(monkeypatch):
  from jax_megamoe.backends import fused
  monkeypatch.delenv("MEGAMOE_FUSED_MAX_CTAS", raising=False)
  assert fused.max_ctas(False) == 0 and fused.max_ctas(True) == -fused.SMS_LEFT_FOR_COLLECTIVES
  monkeypatch.setenv("MEGAMOE_FUSED_MAX_CTAS", "100")
  assert fused.max_ctas(True) == 100
  for bad in ("0", "all", "64.0"):
    monkeypatch.setenv("MEGAMOE_FUSED_MAX_CTAS", bad)
    with pytest.raises(ValueError, match=f"MEGAMOE_FUSED_MAX_CTAS must be a positive number of "
                                         f"CTAs, got '{bad}'"):
      fused.max_ctas(False)
  for value, want in ((None, None), ("", None), ("auto", None), ("0", False), ("1", True)):
    if value is None:
      monkeypatch.delenv("MEGAMOE_FUSED_BACKWARD", raising=False)
    else:
      monkeypatch.setenv("MEGAMOE_FUSED_BACKWARD", value)
    assert fused.kernel_backward_requested() is want, value


@pytest.mark.parametrize("module, name, attr", [
    ("jax_megamoe.router", "MEGAMOE_BALANCE_KERNEL", "BALANCE_KERNEL"),
    ("jax_megamoe.models.losses", "MEGAMOE_CE_KERNEL", "CE_KERNEL")])
def test_import_time_switches(module, name, attr):
  """Read when the module is imported (a fresh interpreter each): "0" turns the kernel off, a
  mistyped value stops the import by name (it used to mean on)."""
  def run(value):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGAMOE_")}
    env.update({name: value, "JAX_PLATFORMS": "cpu"})
    return subprocess.run([sys.executable, "-c", f"import {module} as m; print(m.{attr})"],
                          env=env, capture_output=True, text=True, cwd=ROOT)
  assert run("0").stdout.strip() == "False"
  assert run("1").stdout.strip() == "True"
  bad = run("false")
  assert bad.returncode != 0
  assert f"ValueError: {name} must be 0 or 1, got 'false'" in bad.stderr, bad.stderr[-2000:]

"""The Bazel build (BUILD, .bazelrc) compiles exactly the sources, defines and GPU targets that
CMake does, and its files are buildifier-clean.

No Bazel runs here: BUILD is evaluated statically (it is Starlark, which Python's parser reads):
its glob()s are expanded with Bazel's rules (recursive `**`, no crossing into sub-packages) and
select()s resolved for a CUDA and a CPU-only configuration; CMakeLists.txt's file(GLOB...) and
the sources handed to the _megamoe target are expanded likewise. Each side must compile the
other's files, in both configurations, and split the same sources into the same number of
translation units (shards, ffi/common/shards.h). The checker itself is tested on planted files in
a copy.
"""

from __future__ import annotations

import ast
import os
import pathlib
import re
import shutil
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
BAZEL_FILES = ("MODULE.bazel", "BUILD", "bazel/BUILD", "bazel/cuda_shards.bzl",
               "bazel/python_headers.bzl")
CUDA_ENABLED = "@rules_cuda//cuda:is_enabled"
HEADER_SUFFIXES = (".h", ".cuh", ".hpp", ".inc")
EXTENSION_TARGET = "_megamoe"
SHARDS_RULE = "cuda_shards"  # bazel/cuda_shards.bzl: srcs = {source: shards}
SHARDS_VARIABLE = "MEGAMOE_SHARDED_CUDA_SOURCES"  # CMake: "source=shards" entries
SHARDS_HEADER = '#include "ffi/common/shards.h"'


# --- Bazel side -----------------------------------------------------------------------------------

def _glob_regex(pattern: str) -> re.Pattern:
  """Bazel glob pattern -> regex over '/'-separated paths: `*` stays within a directory,
  a `**` segment spans any number of them."""
  segments = pattern.split("/")
  out = ""
  for i, segment in enumerate(segments):
    last = i == len(segments) - 1
    if segment == "**":
      out += "(?:[^/]+/)*" + ("[^/]+" if last else "")
    else:
      out += re.escape(segment).replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
      out += "" if last else "/"
  return re.compile(out + r"\Z")


def package_files(root: pathlib.Path, package: str = "") -> list[str]:
  """Files of a Bazel package, relative to it: sub-packages (dirs with a BUILD file) excluded."""
  base = root / package
  files = []
  for dirpath, dirnames, filenames in os.walk(base):
    here = pathlib.Path(dirpath)
    dirnames[:] = [d for d in dirnames
                   if not any((here / d / b).exists() for b in ("BUILD", "BUILD.bazel"))
                   and d not in (".git", "bazel-out")]
    files += [(here / f).relative_to(base).as_posix() for f in filenames]
  return sorted(files)


def bazel_glob(root: pathlib.Path, include: list[str], exclude: list[str] = ()) -> set[str]:
  files = package_files(root)
  inc = [_glob_regex(p) for p in include]
  exc = [_glob_regex(p) for p in exclude]
  return {f for f in files if any(r.match(f) for r in inc) and not any(r.match(f) for r in exc)}


class BuildFile:
  """The root BUILD file, statically evaluated for one configuration."""

  def __init__(self, root: pathlib.Path, cuda: bool):
    self.root = root
    self.cuda = cuda
    self.all_branches = False  # select() -> every branch (for flag-dependent defines)
    tree = ast.parse((root / "BUILD").read_text(), filename="BUILD")
    self.constants: dict[str, object] = {}
    self.rules: dict[str, tuple[str, dict[str, ast.expr]]] = {}
    for stmt in tree.body:
      if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name):
        self.constants[stmt.targets[0].id] = stmt.value
      elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        call = stmt.value
        if getattr(call.func, "id", "") == "load":  # loaded values stand for themselves
          for arg in call.args[1:]:
            self.constants[arg.value] = ast.Constant(f"<{arg.value}>")
        kwargs = {k.arg: k.value for k in call.keywords}
        if "name" in kwargs and isinstance(call.func, ast.Name):
          self.rules[self.eval(kwargs["name"])] = (call.func.id, kwargs)

  def eval(self, node: ast.expr):
    if isinstance(node, ast.Constant):
      return node.value
    if isinstance(node, ast.List):
      return [self.eval(e) for e in node.elts]
    if isinstance(node, ast.Dict):
      return {self.eval(k): self.eval(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.Name):
      return self.eval(self.constants[node.id])
    if isinstance(node, ast.IfExp):  # loaded facts (e.g. CUTLASS_FOUND) count as true
      if self.all_branches:
        return self.eval(node.body) + self.eval(node.orelse)
      return self.eval(node.body if self.eval(node.test) else node.orelse)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
      return self.eval(node.left) + self.eval(node.right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
      return self.eval(node.left) % self.eval(node.right)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and node.func.attr == "keys" and not node.args):
      return list(self.eval(node.func.value).keys())
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
      args = [self.eval(a) for a in node.args]
      kwargs = {k.arg: self.eval(k.value) for k in node.keywords}
      if node.func.id == "glob":
        return sorted(bazel_glob(self.root, *args, **kwargs))
      if node.func.id == "select":
        return self._select(args[0])
    raise ValueError(f"BUILD:{node.lineno}: cannot evaluate {ast.unparse(node)}")

  def _select(self, branches: dict):
    if self.all_branches:
      return [v for branch in branches.values() for v in branch]
    if self.cuda and CUDA_ENABLED in branches:
      return branches[CUDA_ENABLED]
    return branches["//conditions:default"]

  def attr(self, target: str, name: str, default=()):
    kwargs = self.rules[target][1]
    return self.eval(kwargs[name]) if name in kwargs else list(default)

  def local_deps(self, target: str) -> list[str]:
    """target and every dependency of it defined in this BUILD file, depth first."""
    seen, stack = [], [target]
    while stack:
      name = stack.pop()
      if name in seen or name not in self.rules:
        continue
      seen.append(name)
      stack += [d.removeprefix("//").lstrip(":") for d in self.attr(name, "deps")
                if d.startswith(":") or d.startswith("//:")]
    return seen

  def compiled(self, target: str) -> set[str]:
    """Sources compiled into `target` (its srcs and those of its local deps), headers aside."""
    return {s for t in self.local_deps(target) for s in self.attr(t, "srcs")
            if s.startswith("ffi/") and not s.endswith(HEADER_SUFFIXES)}

  def sharded(self, target: str) -> dict[str, int]:
    """{source: shards} of the cuda_shards rules among `target`'s local deps."""
    return {s: n for t in self.local_deps(target) if self.rules[t][0] == SHARDS_RULE
            for s, n in self.attr(t, "srcs").items()}

  def compiled_whole(self, target: str) -> set[str]:
    """Sources compiled as one translation unit (by a rule other than cuda_shards)."""
    return {s for t in self.local_deps(target) if self.rules[t][0] != SHARDS_RULE
            for s in self.attr(t, "srcs") if s.startswith("ffi/")}

  def headers(self, target: str) -> set[str]:
    return {h for t in self.local_deps(target)
            for h in [*self.attr(t, "hdrs"), *self.attr(t, "srcs")] if h.endswith(HEADER_SUFFIXES)}

  def defines(self, target: str) -> set[str]:
    """Macro names the extension's sources may get (local_defines, defines; any flag)."""
    names = set()
    self.all_branches = True
    try:
      for t in self.local_deps(target):
        for d in self.attr(t, "local_defines") + self.attr(t, "defines"):
          names.add(d.split("=")[0])
    finally:
      self.all_branches = False
    return names


# --- CMake side -----------------------------------------------------------------------------------

_COMMAND = re.compile(r"(\w+)\s*\(((?:[^()]|\([^()]*\))*)\)", re.S)


def _cmake_commands(text: str):
  """(name, args) of each command, with the if() conditions around it."""
  # Hide parentheses and '#' inside quoted arguments (e.g. Python one-liners), drop comments.
  hide = str.maketrans({"(": "\x01", ")": "\x02", "#": "\x03"})
  text = re.sub(r'"(?:[^"\\]|\\.)*"', lambda m: m.group(0).translate(hide), text)
  text = re.sub(r"#[^\n]*", "", text)
  show = str.maketrans({"\x01": "(", "\x02": ")", "\x03": "#"})
  conditions = []
  for match in _COMMAND.finditer(text):
    name, args = match.group(1).lower(), re.findall(r'"[^"]*"|\S+', match.group(2))
    args = [a.strip('"').translate(show) for a in args]
    if name == "if":
      conditions.append(" ".join(args))
    elif name == "endif":
      conditions.pop()
    elif name not in ("else", "elseif"):
      yield name, args, tuple(conditions)


def _cmake_glob(root: pathlib.Path, pattern: str, recurse: bool) -> list[str]:
  pattern = pattern.replace("${CMAKE_SOURCE_DIR}/", "").replace("${CMAKE_CURRENT_SOURCE_DIR}/", "")
  directory, _, name_pattern = pattern.rpartition("/")
  base = root / directory
  found = base.rglob(name_pattern) if recurse else base.glob(name_pattern)
  return sorted(p.relative_to(root).as_posix() for p in found if p.is_file())


class CMakeLists:
  """The _megamoe target of CMakeLists.txt: its sources per configuration, defines, archs."""

  def __init__(self, root: pathlib.Path):
    self.variables: dict[str, list[str]] = {}
    self.sources: list[tuple[str, tuple[str, ...]]] = []  # (file, if-conditions)
    self.defines: set[str] = set()
    self.archs: list[str] = []
    self.sharded: dict[str, int] = {}
    keywords = {"PRIVATE", "PUBLIC", "INTERFACE", "NB_STATIC", "NB_SHARED", "STABLE_ABI"}
    for name, args, conditions in _cmake_commands((root / "CMakeLists.txt").read_text()):
      if name == "file" and args[0] in ("GLOB", "GLOB_RECURSE"):
        patterns = [a for a in args[2:] if a != "CONFIGURE_DEPENDS"]
        self.variables[args[1]] = [f for p in patterns
                                   for f in _cmake_glob(root, p, args[0] == "GLOB_RECURSE")]
      elif name == "set" and args[0] == SHARDS_VARIABLE:
        self.sharded = {s: int(n) for s, n in (a.split("=") for a in args[1:])}
      elif name == "set" and args[0] == "MEGAMOE_CUDA_ARCHS" and len(args) > 1:
        self.archs = args[1:]
      elif name == "list" and args[:2] == ["APPEND", "MEGAMOE_CUDA_ARCHS"]:
        self.archs += args[2:]
      elif name in ("nanobind_add_module", "target_sources") and args[0] == EXTENSION_TARGET:
        for arg in args[1:]:
          if arg in keywords:
            continue
          var = re.fullmatch(r"\$\{(\w+)\}", arg)
          files = self.variables.get(var.group(1), []) if var else [arg]
          self.sources += [(f, conditions) for f in files]
      elif name == "target_compile_definitions" and args[0] == EXTENSION_TARGET:
        self.defines |= {a.split("=")[0] for a in args[1:] if a not in keywords}

  def compiled(self, cuda: bool) -> set[str]:
    return {f for f, conditions in self.sources
            if cuda or not any("MEGAMOE_WITH_CUDA" in c for c in conditions)}


def bazelrc_archs(root: pathlib.Path) -> list[str]:
  """The sm_XX targets of .bazelrc's default `build --@rules_cuda//cuda:archs=...`."""
  text = (root / ".bazelrc").read_text()
  match = re.search(r"^build --@rules_cuda//cuda:archs=(\S+)", text, re.M)
  assert match, ".bazelrc sets no default --@rules_cuda//cuda:archs"
  return re.findall(r"\bsm_(\w+)", match.group(1))


# --- the check ------------------------------------------------------------------------------------

def inconsistencies(root: pathlib.Path) -> list[str]:
  """Every way the Bazel build differs from CMake's; empty when they agree."""
  problems = []
  cmake = CMakeLists(root)
  for cuda in (True, False):
    config = "CUDA" if cuda else "CPU-only"
    build = BuildFile(root, cuda)
    bazel_src, cmake_src = build.compiled(EXTENSION_TARGET), cmake.compiled(cuda)
    for f in sorted(cmake_src - bazel_src):
      problems.append(f"{config}: CMake compiles {f}, Bazel //:{EXTENSION_TARGET} does not")
    for f in sorted(bazel_src - cmake_src):
      problems.append(f"{config}: Bazel //:{EXTENSION_TARGET} compiles {f}, CMake does not")
  build = BuildFile(root, cuda=True)
  bazel_shards = build.sharded(EXTENSION_TARGET)
  for f in sorted(set(cmake.sharded) | set(bazel_shards)):
    if cmake.sharded.get(f) != bazel_shards.get(f):
      problems.append(f"shards of {f}: CMake {cmake.sharded.get(f)}, Bazel {bazel_shards.get(f)}")
    if f in build.compiled_whole(EXTENSION_TARGET):
      problems.append(f"Bazel compiles {f} whole besides its shards")
    if (root / f).exists() and SHARDS_HEADER not in (root / f).read_text():
      problems.append(f"{f} is compiled as shards but does not include ffi/common/shards.h")
  headers = {f"ffi/{f}" for f in package_files(root / "ffi") if f.endswith(HEADER_SUFFIXES)}
  for h in sorted(headers - build.headers(EXTENSION_TARGET)):
    problems.append(f"header {h} is not in any Bazel hdrs (sandboxed compiles cannot see it)")
  if (root / "ffi" / "BUILD").exists() or (root / "ffi" / "BUILD.bazel").exists():
    problems.append("ffi/BUILD makes ffi/ a package: the root BUILD's globs no longer see it")
  for name in sorted(cmake.defines - build.defines(EXTENSION_TARGET) - {"MEGAMOE_CUDA_VERSION"}):
    problems.append(f"CMake defines {name} for {EXTENSION_TARGET}, Bazel does not")
  if sorted(cmake.archs) != sorted(bazelrc_archs(root)):
    problems.append(f"GPU targets differ: CMake {cmake.archs}, .bazelrc {bazelrc_archs(root)}")
  return problems


def test_bazel_compiles_what_cmake_compiles():
  assert inconsistencies(REPO) == []


def test_bazel_sees_the_real_sources():
  """Guard against a vacuous pass: both sides find module.cc, and the sets are not empty."""
  assert "ffi/module.cc" in BuildFile(REPO, cuda=False).compiled(EXTENSION_TARGET)
  assert "ffi/module.cc" in CMakeLists(REPO).compiled(cuda=False)
  assert CMakeLists(REPO).archs == ["90a", "100a"]


# --- the checker, tested on planted files in a copy of the build files ----------------------------

@pytest.fixture
def tree(tmp_path):
  for name in ("CMakeLists.txt", "BUILD", ".bazelrc"):
    shutil.copy(REPO / name, tmp_path / name)
  shutil.copytree(REPO / "ffi", tmp_path / "ffi",
                  ignore=shutil.ignore_patterns("__pycache__"))
  assert inconsistencies(tmp_path) == []
  return tmp_path


def _plant(path: pathlib.Path, text: str = "// planted by the test\n"):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(text)


def test_planted_sources_are_seen_by_both_globs(tree):
  _plant(tree / "ffi/impls/planted_kernel.cu")
  _plant(tree / "ffi/planted_host.cc")
  _plant(tree / "ffi/common/planted.cuh")
  assert inconsistencies(tree) == []
  assert "ffi/impls/planted_kernel.cu" in BuildFile(tree, cuda=True).compiled(EXTENSION_TARGET)
  assert "ffi/impls/planted_kernel.cu" not in BuildFile(tree, cuda=False).compiled(
      EXTENSION_TARGET)
  assert "ffi/planted_host.cc" in CMakeLists(tree).compiled(cuda=False)


def test_a_sub_package_hides_files_from_bazel(tree):
  _plant(tree / "ffi/impls/BUILD.bazel", "")
  _plant(tree / "ffi/impls/hidden.cu")
  problems = inconsistencies(tree)
  assert any("CMake compiles ffi/impls/hidden.cu" in p for p in problems), problems


def test_a_non_recursive_bazel_glob_misses_nested_files(tree):
  build = tree / "BUILD"
  build.write_text(build.read_text().replace('"ffi/**/*.cu"', '"ffi/*.cu"'))
  _plant(tree / "ffi/impls/nested.cu")
  problems = inconsistencies(tree)
  assert "CUDA: CMake compiles ffi/impls/nested.cu, Bazel //:_megamoe does not" in problems
  assert all(p.startswith("CUDA: CMake compiles ffi/") for p in problems), problems


def test_a_file_only_bazel_compiles_is_reported(tree):
  cmake = tree / "CMakeLists.txt"
  cmake.write_text(cmake.read_text().replace('GLOB_RECURSE MEGAMOE_HOST_SOURCES',
                                             'GLOB MEGAMOE_HOST_SOURCES'))
  _plant(tree / "ffi/sub/extra.cc")
  problems = inconsistencies(tree)
  assert "CPU-only: Bazel //:_megamoe compiles ffi/sub/extra.cc, CMake does not" in problems


def test_explicit_source_lists_are_compared_too(tree):
  build = tree / "BUILD"
  listed = sorted(CMakeLists(tree).compiled(cuda=False))
  build.write_text(build.read_text().replace('glob(["ffi/**/*.cc"])', repr(listed)))
  assert inconsistencies(tree) == []
  _plant(tree / "ffi/new_handler.cc")
  assert "CPU-only: CMake compiles ffi/new_handler.cc, Bazel //:_megamoe does not" in (
      inconsistencies(tree))


def test_unlisted_headers_defines_and_archs_are_reported(tree):
  build = tree / "BUILD"
  build.write_text(build.read_text().replace('"ffi/**/*.cuh",', "").replace(
      '"MEGAMOE_WITH_CUDA=1"', '"MEGAMOE_SOMETHING_ELSE=1"'))
  _plant(tree / "ffi/common/barrier.cuh")
  rc = tree / ".bazelrc"
  rc.write_text(rc.read_text().replace(";compute_100a:compute_100a,sm_100a", "", 1))
  problems = "\n".join(inconsistencies(tree))
  assert "header ffi/common/barrier.cuh is not in any Bazel hdrs" in problems
  assert "CMake defines MEGAMOE_WITH_CUDA for _megamoe, Bazel does not" in problems
  assert "GPU targets differ" in problems


def test_shard_tables_are_compared(tree):
  build = tree / "BUILD"
  build.write_text(build.read_text().replace('"ffi/impls/sm90_grouped_gemm_bf16.cu": 9',
                                             '"ffi/impls/sm90_grouped_gemm_bf16.cu": 3'))
  assert inconsistencies(tree) == [
      "shards of ffi/impls/sm90_grouped_gemm_bf16.cu: CMake 9, Bazel 3"]


def test_a_sharded_source_compiled_whole_is_reported(tree):
  build = tree / "BUILD"
  build.write_text(build.read_text().replace("exclude = SHARDED_CUDA_SRCS.keys()", "exclude = []"))
  assert "Bazel compiles ffi/impls/sm90_grouped_gemm_fp8.cu whole besides its shards" in (
      inconsistencies(tree))


def test_a_sharded_source_must_use_the_shard_header(tree):
  source = tree / "ffi/impls/sm90_grouped_gemm_fp8.cu"
  source.write_text(source.read_text().replace(SHARDS_HEADER, ""))
  assert inconsistencies(tree) == [
      "ffi/impls/sm90_grouped_gemm_fp8.cu is compiled as shards but does not include "
      "ffi/common/shards.h"]


def test_the_shard_tables_are_not_empty():
  assert CMakeLists(REPO).sharded, "no sharded sources found in CMakeLists.txt"
  assert BuildFile(REPO, cuda=True).sharded(EXTENSION_TARGET)


def test_cmake_reader_survives_quoted_parentheses(tree):
  cmake = tree / "CMakeLists.txt"
  cmake.write_text('execute_process(COMMAND python -c "print((1), \'#\')")  # (unbalanced\n'
                   + cmake.read_text())
  assert inconsistencies(tree) == []


def test_glob_regex_follows_bazel_rules():
  assert _glob_regex("ffi/**/*.cu").match("ffi/a.cu")
  assert _glob_regex("ffi/**/*.cu").match("ffi/x/y/a.cu")
  assert not _glob_regex("ffi/*.cu").match("ffi/x/a.cu")
  assert not _glob_regex("ffi/**/*.cu").match("ffi/a.cuh")
  assert _glob_regex("jax_megamoe/**/*.py").match("jax_megamoe/backends/cuda.py")


# --- formatting -----------------------------------------------------------------------------------

def test_bazel_files_are_buildifier_clean():
  """buildifier --mode=check --lint=warn; skipped (reported as not run) without buildifier.

  Install: npm install -g @bazel/buildifier@8.2.1 (the package ships the binary).
  """
  buildifier = shutil.which("buildifier")
  if buildifier is None:
    pytest.skip("not run: buildifier is not installed (npm install -g @bazel/buildifier)")
  result = subprocess.run([buildifier, "--mode=check", "--lint=warn", *BAZEL_FILES], cwd=REPO,
                          capture_output=True, text=True, check=False)
  assert result.returncode == 0, result.stdout + result.stderr

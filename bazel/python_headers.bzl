"""Header-only dependencies found in the Python environment, exactly as CMake finds them.

@jaxlib_headers   the XLA FFI headers of the installed jaxlib (jax.ffi.include_dir()), and
                  version.bzl with JAXLIB_VERSION.
@cutlass_headers  CUTLASS/CuTe from the nvidia-cutlass package (cutlass_library/source/include),
                  and found.bzl with CUTLASS_FOUND; an empty library when it is not installed.

Set PYTHON_BIN_PATH to choose the interpreter (default: python3 on PATH).
"""

_JAXLIB_QUERY = "import jax, jaxlib; print(jax.ffi.include_dir()); print(jaxlib.__version__)"

# Located without importing cutlass_library, as CMakeLists.txt does.
_CUTLASS_QUERY = (
    "import importlib.util, os; s = importlib.util.find_spec('cutlass_library'); " +
    "print(os.path.join(os.path.dirname(s.origin), 'source', 'include') if s else '')"
)

_JAXLIB_BUILD = """\
load("@rules_cc//cc:defs.bzl", "cc_library")

cc_library(
    name = "xla_ffi",
    hdrs = glob(["include/xla/ffi/api/*.h"]),
    includes = ["include"],
    visibility = ["//visibility:public"],
)
"""

_CUTLASS_BUILD = """\
load("@rules_cc//cc:defs.bzl", "cc_library")

cc_library(
    name = "cutlass",
    hdrs = glob(["include/**"], allow_empty = True),
    includes = ["include"],
    visibility = ["//visibility:public"],
)
"""

def _python(rctx):
    python = rctx.os.environ.get("PYTHON_BIN_PATH") or rctx.which("python3")
    if not python:
        fail("no python3 on PATH; set PYTHON_BIN_PATH to a Python with jax installed")
    return python

def _query(rctx, code):
    python = _python(rctx)
    result = rctx.execute([python, "-c", code])
    if result.return_code != 0:
        fail("`{} -c \"{}\"` failed:\n{}".format(python, code, result.stderr))
    return result.stdout.strip().splitlines()

def _jaxlib_headers_impl(rctx):
    include_dir, version = _query(rctx, _JAXLIB_QUERY)
    rctx.symlink(include_dir, "include")
    rctx.file("BUILD.bazel", _JAXLIB_BUILD)
    rctx.file("version.bzl", 'JAXLIB_VERSION = "{}"\n'.format(version))

def _cutlass_headers_impl(rctx):
    lines = _query(rctx, _CUTLASS_QUERY)
    include_dir = lines[0] if lines else ""
    found = include_dir != "" and rctx.path(include_dir + "/cutlass/cutlass.h").exists
    if found:
        rctx.symlink(include_dir, "include")
    rctx.file("BUILD.bazel", _CUTLASS_BUILD)
    rctx.file("found.bzl", "CUTLASS_FOUND = {}\n".format(found))

_ENVIRON = ["PYTHON_BIN_PATH", "PATH"]

jaxlib_headers = repository_rule(
    implementation = _jaxlib_headers_impl,
    environ = _ENVIRON,
    local = True,
)

cutlass_headers = repository_rule(
    implementation = _cutlass_headers_impl,
    environ = _ENVIRON,
    local = True,
)

def _python_headers_impl(_mctx):
    jaxlib_headers(name = "jaxlib_headers")
    cutlass_headers(name = "cutlass_headers")

python_headers = module_extension(implementation = _python_headers_impl)

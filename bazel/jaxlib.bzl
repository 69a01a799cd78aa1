"""Repository @jaxlib_headers: the XLA FFI headers shipped inside the installed jaxlib.

CMake asks Python for jax.ffi.include_dir(); this does the same, so both builds compile against
the headers of the jaxlib that will load the extension. Set PYTHON_BIN_PATH to choose the
interpreter (default: python3 on PATH).
"""

_QUERY = "import jax, jaxlib; print(jax.ffi.include_dir()); print(jaxlib.__version__)"

_BUILD = """\
load("@rules_cc//cc:defs.bzl", "cc_library")

cc_library(
    name = "xla_ffi",
    hdrs = glob(["include/xla/ffi/api/*.h"]),
    includes = ["include"],
    visibility = ["//visibility:public"],
)
"""

def _jaxlib_headers_impl(rctx):
    python = rctx.os.environ.get("PYTHON_BIN_PATH") or rctx.which("python3")
    if not python:
        fail("@jaxlib_headers: no python3 on PATH; set PYTHON_BIN_PATH to a Python with jax")
    result = rctx.execute([python, "-c", _QUERY])
    if result.return_code != 0:
        fail("@jaxlib_headers: `{} -c '{}'` failed:\n{}".format(python, _QUERY, result.stderr))
    include_dir, version = result.stdout.strip().splitlines()
    rctx.symlink(include_dir, "include")
    rctx.file("BUILD.bazel", _BUILD)
    rctx.file("version.bzl", 'JAXLIB_VERSION = "{}"\n'.format(version))

jaxlib_headers = repository_rule(
    implementation = _jaxlib_headers_impl,
    environ = ["PYTHON_BIN_PATH", "PATH"],
    local = True,
)

def _jaxlib_impl(_mctx):
    jaxlib_headers(name = "jaxlib_headers")

jaxlib = module_extension(implementation = _jaxlib_impl)

"""Repository rule exposing the XLA FFI headers shipped in the installed jaxlib.

The Python interpreter is taken from the environment variable PYTHON_BIN_PATH
(default `python3`); it must be able to import jax (or at least jaxlib). The
headers directory it reports, `jax.ffi.include_dir()`, is symlinked into the
external repository as `include/`, and exposed as

    @<name>//:ffi_headers   (cc_library; `#include "xla/ffi/api/ffi.h"`)

Changing PYTHON_BIN_PATH re-runs the rule.
"""

_FIND_INCLUDE_DIR = """
import os
try:
    import jax.ffi
    print(jax.ffi.include_dir())
except Exception:
    # Older jax, or jaxlib installed without jax: same directory.
    import jaxlib
    print(os.path.join(os.path.dirname(jaxlib.__file__), "include"))
"""

_BUILD = """\
package(default_visibility = ["//visibility:public"])

# Header-only: the FFI API is a C ABI plus C++ templates; nothing to link.
cc_library(
    name = "ffi_headers",
    hdrs = glob(["include/xla/ffi/api/*.h"]),
    includes = ["include"],
)
"""

def _xla_ffi_headers_impl(rctx):
    python = rctx.os.environ.get("PYTHON_BIN_PATH", "python3") or "python3"
    if "/" in python:
        python_path = rctx.path(python)
        if not python_path.exists:
            fail("PYTHON_BIN_PATH=%s does not exist" % python)
    else:
        python_path = rctx.which(python)
        if python_path == None:
            fail("'%s' not found on PATH; set PYTHON_BIN_PATH to a python with jax installed" % python)

    result = rctx.execute([python_path, "-c", _FIND_INCLUDE_DIR], quiet = True)
    if result.return_code != 0:
        fail(("%s could not locate the jaxlib FFI headers (is jax installed? " +
              "Set PYTHON_BIN_PATH to a python that has it):\n%s") %
             (python_path, result.stderr))
    include_dir = result.stdout.strip().splitlines()[-1].strip()
    if not rctx.path(include_dir + "/xla/ffi/api/ffi.h").exists:
        fail("%s/xla/ffi/api/ffi.h not found (jaxlib too old?)" % include_dir)

    rctx.symlink(include_dir, "include")
    rctx.file("WORKSPACE", "workspace(name = \"%s\")\n" % rctx.name)
    rctx.file("BUILD", _BUILD)

xla_ffi_headers = repository_rule(
    implementation = _xla_ffi_headers_impl,
    environ = ["PYTHON_BIN_PATH"],
    local = True,
)

"""The repository rule that brings what the build takes from Python: the
Python headers, nanobind's sources and headers, the XLA FFI headers that jaxlib
ships, the extension's file suffix, and the interpreter itself (to run
csrc/embed_sources.py).

It asks the Python in the environment variable PYTHON_BIN_PATH, else python3 on
PATH, so the extension is built for, and with the packages of, the Python that
imports it; nothing is downloaded.
"""

_QUERY = """
import os, sys, sysconfig
import jax.ffi, nanobind
for value in (sys.executable, sysconfig.get_paths()["include"],
              os.path.dirname(nanobind.include_dir()), jax.ffi.include_dir(),
              sysconfig.get_config_var("EXT_SUFFIX")):
  print(value)
"""

def _python_configure_impl(ctx):
    python = ctx.os.environ.get("PYTHON_BIN_PATH") or ctx.which("python3")
    if not python:
        fail("no Python: set PYTHON_BIN_PATH to the python that has jax and nanobind")
    result = ctx.execute([python, "-c", _QUERY])
    if result.return_code != 0:
        fail("%s cannot report its headers (it needs jax and nanobind):\n%s" %
             (python, result.stderr))
    executable, include, nanobind, ffi_include, suffix = result.stdout.strip().split("\n")
    ctx.symlink(include, "python/include")
    ctx.symlink(nanobind, "nanobind")
    ctx.symlink(ffi_include, "xla_ffi/include")
    ctx.file("python3", "#!/bin/sh\nexec '%s' \"$@\"\n" % executable, executable = True)
    ctx.file("defs.bzl", "EXTENSION_SUFFIX = %r\n" % suffix)
    ctx.template("BUILD.bazel", ctx.attr._build_file)

python_configure = repository_rule(
    implementation = _python_configure_impl,
    environ = ["PYTHON_BIN_PATH", "PATH"],
    attrs = {"_build_file": attr.label(default = "//:python.BUILD")},
    local = True,
)

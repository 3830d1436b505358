"""Build hook for the compiled UCX binding; all metadata lives in pyproject.toml.

``cffi_modules`` makes setuptools compile ``ray_velo.ucx._ucx_binding`` from the builder in
``ray_velo/ucx/_build.py``, against the headers of the ``libucx-cu12`` build requirement.

A build from source needs a C compiler; the wheel from ``.ci/wheel`` does not (abi3,
manylinux). Without a working compiler the build stops before cffi tries, with one line
that says so (rather than a compiler's error inside pip's "Failed building wheel").
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from typing import Any

from setuptools import setup  # type: ignore[import-untyped]
from setuptools.command.build import build  # type: ignore[import-untyped]
from setuptools.command.build_ext import build_ext  # type: ignore[import-untyped]

NO_COMPILER = (
    "ray-velo: building the UCX binding from source needs a C compiler, and {why}: install "
    "one (e.g. `apt-get install gcc`) or install the prebuilt abi3 manylinux wheel instead "
    "(`pip install --only-binary ray-velo ray-velo`, or a wheel made by .ci/wheel), which "
    "needs none"
)


def _compiler_problem() -> str | None:
    """Why the compiler setuptools would use cannot build a shared object, or None when it
    can: a two-line C file compiled and linked as the extension will be (``CC``/``LDSHARED``
    and Python's own settings), quietly, in a scratch directory."""
    from distutils.ccompiler import new_compiler  # setuptools' own copy (imported above)
    from distutils.sysconfig import customize_compiler

    compiler: Any = new_compiler()
    customize_compiler(compiler)
    compile_cmd = list(compiler.compiler_so)
    link_cmd = list(compiler.linker_so)
    with tempfile.TemporaryDirectory(prefix="ray_velo_cc_probe_") as tmp:
        source = os.path.join(tmp, "probe.c")
        with open(source, "w") as out:
            out.write("int ray_velo_probe(void);\nint ray_velo_probe(void) { return 0; }\n")
        steps = (
            (compile_cmd, [*compile_cmd, "-c", source, "-o", os.path.join(tmp, "probe.o")]),
            (link_cmd, [*link_cmd, os.path.join(tmp, "probe.o"), "-o", source[:-2] + ".so"]),
        )
        for tool, argv in steps:
            try:
                done = subprocess.run(argv, capture_output=True, check=False, timeout=120)
            except FileNotFoundError:
                return f"`{tool[0]}` is not installed (not found on PATH)"
            except (OSError, subprocess.TimeoutExpired) as exc:
                return f"`{tool[0]}` cannot be run ({exc})"
            if done.returncode != 0:
                return f"`{tool[0]}` fails on a two-line C file (exit status {done.returncode})"
    return None


_compiler_works = False  # one probe per build: `build` runs `build_ext` after it


def _require_compiler(command: Any) -> None:
    """Stop the build, with one line, when it would compile and no compiler works."""
    global _compiler_works
    if _compiler_works or not command.distribution.has_ext_modules():
        return
    why = _compiler_problem()
    if why is not None:
        raise SystemExit(NO_COMPILER.format(why=why))
    _compiler_works = True


class CheckedBuild(build):  # type: ignore[misc]
    """``build`` (what ``bdist_wheel`` runs) checks for a compiler before its sub-commands."""

    def run(self) -> None:
        _require_compiler(self)
        super().run()


class CheckedBuildExt(build_ext):  # type: ignore[misc]
    """``build_ext`` alone (editable installs run it without ``build``) checks as well;
    cffi wraps this class, so the check runs before cffi's compile."""

    def run(self) -> None:
        _require_compiler(self)
        super().run()


setup(
    cffi_modules=["ray_velo/ucx/_build.py:ffibuilder"],
    cmdclass={"build": CheckedBuild, "build_ext": CheckedBuildExt},
)

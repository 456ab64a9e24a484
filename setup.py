"""Builds the optional compiled hot path (``schemas/_hotpath.pyx``, the codecs; ``stream_apps/residency/_record.pyx``,
the residency entry as a compiled record) and the fleet index's block table (``stream_apps/index/_table.pyx``);
everything else is in pyproject.toml. ``schemas/_avro.pxd`` holds the Avro primitives the first two share.

The extension is compiled with Cython (a build requirement, fetched by pip) and the machine's C compiler.
Without a compiler, or when its build fails, the package installs without it and runs the pure-Python
versions of the same functions (docs/architecture.md, "The compiled hot path"); so does an install with
``KVSTREAM_PURE_PYTHON=1`` set.
"""

import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """``build_ext`` that warns instead of failing: the compiled module is a speed-up, never a requirement."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - no compiler at all (CCompilerError, PlatformError, ...)
            self._skipped(exc)

    def build_extension(self, ext) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001 - a compiler that fails on this module: same fallback
            self._skipped(exc)

    def _skipped(self, exc: Exception) -> None:
        self.warn(f"kvstream: the compiled hot path was not built ({exc}); the pure-Python one will run")


def extensions() -> list:
    if os.environ.get("KVSTREAM_PURE_PYTHON") == "1":
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:  # an install without build isolation and without Cython
        return []
    return cythonize([Extension("schemas._hotpath", ["schemas/_hotpath.pyx"]),
                      Extension("stream_apps.residency._record", ["stream_apps/residency/_record.pyx"]),
                      Extension("stream_apps.index._table", ["stream_apps/index/_table.pyx"])], quiet=True)


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})

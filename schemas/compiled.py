"""Which implementation of the hot path's codecs runs: the compiled one (``schemas/_hotpath.pyx``) or Python's.

:data:`HOTPATH` is the compiled module, or None when it was not built (no C compiler at install time) or
when ``KVSTREAM_PURE_PYTHON=1`` is set. Its users (:class:`schemas.ownership_batch.OwnershipBatchReader`,
:class:`schemas.avro_writers.ResidencyWriter`, :func:`schemas.fast_reader.compile_reader`) take a
``compiled`` argument so the tests run both.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

#: Set to 1 to run the pure-Python codecs even where the compiled module is built.
PURE_PYTHON_VARIABLE = "KVSTREAM_PURE_PYTHON"


def load_compiled(name: str) -> ModuleType | None:
    """The compiled module ``name`` (e.g. ``schemas._hotpath``), or None when it was not built or
    ``KVSTREAM_PURE_PYTHON=1`` is set: what every optional compiled module of the hot path is loaded with."""
    if os.environ.get(PURE_PYTHON_VARIABLE) == "1":
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


#: The compiled module, or None.
HOTPATH = load_compiled("schemas._hotpath")


def choose_compiled(compiled: bool | None, name: str, loaded: ModuleType | None) -> ModuleType | None:
    """The compiled module ``name`` to use: ``compiled`` None picks ``loaded`` (what :func:`load_compiled` gave
    at import); False none; True the module itself.

    Raises:
        ImportError: ``compiled`` is True and the module is not built (``pip install -e .`` with a C compiler).
    """
    if compiled is None:
        return loaded
    if not compiled:
        return None
    return importlib.import_module(name)


def choose(compiled: bool | None) -> ModuleType | None:
    """The module a codec uses (:func:`choose_compiled` of ``schemas._hotpath``, :data:`HOTPATH` by default).

    Raises:
        ImportError: ``compiled`` is True and the module is not built.
    """
    return choose_compiled(compiled, "schemas._hotpath", HOTPATH)

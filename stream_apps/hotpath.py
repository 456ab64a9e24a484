"""Which implementation of the hot path this process runs: the compiled modules or their pure-Python twins.

Three modules are compiled by setup.py where a C compiler is there: ``schemas._hotpath`` (the codecs,
:mod:`schemas.compiled`), ``stream_apps.residency._record`` (the residency entry as a compiled record, with its
rules; :mod:`stream_apps.residency.records`) and ``stream_apps.index._table`` (the fleet index's block table,
:mod:`stream_apps.index.table`). Each falls back to Python silently, when they were not built or when
``KVSTREAM_PURE_PYTHON=1`` is set, so a worker says at start which ones it runs (:func:`log_hotpath`), and
``/metrics`` has ``kvstream_hotpath_info{implementation=...}`` (:mod:`stream_apps.metrics`).

A module of its own, importing only those choices: ``kvstream index`` logs the same line without loading
Faust, which the worker's metrics module imports.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from schemas.compiled import HOTPATH, PURE_PYTHON_VARIABLE
from stream_apps.index.table import CompiledBlockTable
from stream_apps.residency.records import RECORD_MODULE

#: The compiled modules, in the order the log line names them.
COMPILED_MODULES = ("schemas._hotpath", "stream_apps.residency._record", "stream_apps.index._table")
#: The ``implementation`` label values: every module compiled, none, or only some of them.
COMPILED, PYTHON, PARTIAL = "compiled", "python", "partial"


@dataclass(frozen=True)
class Hotpath:
    """The hot path's implementation in this process.

    Attributes:
        compiled: the modules of :data:`COMPILED_MODULES` that are compiled and in use.
        pure_python_forced: ``KVSTREAM_PURE_PYTHON=1`` was set.
    """

    compiled: tuple[str, ...]
    pure_python_forced: bool = False

    @property
    def implementation(self) -> str:
        """:data:`COMPILED`, :data:`PYTHON` or :data:`PARTIAL`: the metric's label value."""
        if len(self.compiled) == len(COMPILED_MODULES):
            return COMPILED
        return PARTIAL if self.compiled else PYTHON

    def describe(self) -> str:
        """The log line, e.g. ``hot path: compiled (schemas._hotpath, stream_apps.residency._record,
        stream_apps.index._table)``."""
        missing = [name for name in COMPILED_MODULES if name not in self.compiled]
        if self.implementation == COMPILED:
            return f"hot path: compiled ({', '.join(self.compiled)})"
        if self.pure_python_forced:
            return f"hot path: pure Python ({PURE_PYTHON_VARIABLE}=1)"
        if self.implementation == PYTHON:
            return f"hot path: pure Python (not built: {', '.join(missing)})"
        return f"hot path: partly compiled ({', '.join(self.compiled)}; not built: {', '.join(missing)})"


def hotpath(codecs: object | None = HOTPATH, table: type | None = CompiledBlockTable,
            environ: Mapping[str, str] = os.environ, records: object | None = RECORD_MODULE) -> Hotpath:
    """The implementation in use: by default this process's, as :mod:`schemas.compiled`,
    :mod:`stream_apps.residency.records` and :mod:`stream_apps.index.table` chose it at import.

    Args:
        codecs: the compiled codec module, or None (:data:`schemas.compiled.HOTPATH`).
        table: the compiled block table class, or None (:data:`stream_apps.index.table.CompiledBlockTable`).
        environ: where ``KVSTREAM_PURE_PYTHON`` is read.
        records: the compiled residency record module, or None
            (:data:`stream_apps.residency.records.RECORD_MODULE`).
    """
    chosen = (codecs is not None, records is not None, table is not None)
    return Hotpath(tuple(name for name, used in zip(COMPILED_MODULES, chosen) if used),
                   pure_python_forced=environ.get(PURE_PYTHON_VARIABLE) == "1")


def log_hotpath(logger: logging.Logger) -> Hotpath:
    """Log this process's :func:`hotpath` at INFO on ``logger``, and return it."""
    current = hotpath()
    logger.info("%s", current.describe())
    return current

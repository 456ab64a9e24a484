"""Shared fixtures: the session's Kafka broker (tests/broker_fixture.py), schema registry
(tests/registry_fixture.py), and `hotpath`, which runs a test with each implementation of the hot path
(schemas/compiled.py, stream_apps/residency/records.py)."""

import importlib
import os

import pytest

# Sources' leases (stream_apps/index/liveness.py) run on the workers' clock: a source not heard of for 30 s is left
# out of every answer. Most tests publish their events once and ask about them for minutes after, so their workers
# get a lease of a day; the liveness tests give theirs a short one explicitly.
os.environ.setdefault("KVSTREAM_SOURCE_LEASE_S", "86400")

pytest_plugins = ["tests.broker_fixture", "tests.registry_fixture"]

#: The two implementations of the hot path's codecs (schemas/compiled.py); tests of those codecs run with each.
HOTPATHS = ("python", "compiled")


def compiled_module(name: str, source: str):
    """The compiled module ``name`` (built from ``source``, a .pyx). One that was not built fails the test (a silent
    fallback would leave it untested), unless ``KVSTREAM_PURE_PYTHON=1`` says to test the pure-Python path only."""
    try:
        return importlib.import_module(name)
    except ImportError:
        if os.environ.get("KVSTREAM_PURE_PYTHON") == "1":
            pytest.skip(f"KVSTREAM_PURE_PYTHON=1 and {source} not built: the pure-Python path only")
        pytest.fail(f"{source} is not built (`pip install -e .` builds it with the C compiler); "
                    "set KVSTREAM_PURE_PYTHON=1 to test the pure-Python path only")


def hotpath_module(name: str):
    """The codec module ``name`` stands for: None for ``python``, schemas._hotpath for ``compiled``
    (:func:`compiled_module`)."""
    return None if name == "python" else compiled_module("schemas._hotpath", "schemas/_hotpath.pyx")


def record_module(name: str):
    """The residency record module ``name`` stands for (stream_apps/residency/records.py): None for ``python`` (the
    dicts), stream_apps.residency._record for ``compiled`` (:func:`compiled_module`)."""
    if name == "python":
        return None
    return compiled_module("stream_apps.residency._record", "stream_apps/residency/_record.pyx")


@pytest.fixture(params=HOTPATHS)
def hotpath(request, monkeypatch):
    """Runs a test once per implementation of the hot path: sets ``schemas.compiled.HOTPATH`` (the codecs) and
    ``stream_apps.residency.records.RECORD_MODULE`` (the residency entry: compiled record or dicts), which are
    picked when not told otherwise. Gives the codec module (None for pure Python)."""
    module = hotpath_module(request.param)
    monkeypatch.setattr("schemas.compiled.HOTPATH", module)
    monkeypatch.setattr("stream_apps.residency.records.RECORD_MODULE", record_module(request.param))
    return module


@pytest.fixture(scope="session", autouse=True)
def _no_gc_pause_warnings_after_the_session():
    """Tests that build a worker's app install its long-GC warning (stream_apps.checkpoint.warn_on_long_gc_pauses)
    in this process; pytest's last full collection, after the log handlers are closed, then made it print a
    logging error at the end of every run. The callback goes when the session ends."""
    import gc

    yield
    gc.callbacks[:] = [callback for callback in gc.callbacks if not getattr(callback, "_kvstream_gc_pauses", False)]

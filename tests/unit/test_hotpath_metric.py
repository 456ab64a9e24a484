"""Which hot path runs, said by the worker: the log line and ``kvstream_hotpath_info`` on ``/metrics``
(stream_apps/hotpath.py, stream_apps/metrics.py)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from schemas.compiled import HOTPATH
from stream_apps.hotpath import COMPILED_MODULES, hotpath, log_hotpath
from stream_apps.index.table import CompiledBlockTable
from stream_apps.metrics import WorkerMetrics
from stream_apps.residency import ApplyStats
from stream_apps.residency.records import RECORD_MODULE
from stream_apps.settings import WorkerSettings

BOTH = {"codecs": object(), "records": object(), "table": type("Table", (), {})}
NONE = {"codecs": None, "records": None, "table": None}


def worker_metrics(tmp_path, **settings) -> WorkerMetrics:
    """A WorkerMetrics over idle stand-ins of the agent, the checkpoint and the repartition process (``settings``:
    WorkerSettings fields besides the data directory)."""
    tables = SimpleNamespace(residency_store=object(), tier_occupancy={}, all=list)
    materializer = SimpleNamespace(stats=ApplyStats(), materialized=0, outputs=SimpleNamespace(dead_lettered=0),
                                   tables=tables)
    return WorkerMetrics(WorkerSettings(data_dir=tmp_path, **settings), materializer,
                         SimpleNamespace(commits=0, total_seconds=0.0), SimpleNamespace(counters=dict),
                         SimpleNamespace(reasons=list), lambda: False)


@pytest.mark.parametrize(("kwargs", "implementation", "line"), [
    (BOTH, "compiled",
     "hot path: compiled (schemas._hotpath, stream_apps.residency._record, stream_apps.index._table)"),
    (NONE, "python",
     "hot path: pure Python (not built: schemas._hotpath, stream_apps.residency._record, stream_apps.index._table)"),
    ({**NONE, "environ": {"KVSTREAM_PURE_PYTHON": "1"}}, "python", "hot path: pure Python (KVSTREAM_PURE_PYTHON=1)"),
    ({**NONE, "codecs": object()}, "partial", "hot path: partly compiled (schemas._hotpath; not built: "
     "stream_apps.residency._record, stream_apps.index._table)"),
])
def test_the_implementation_and_its_log_line(kwargs, implementation, line):
    current = hotpath(**{"environ": {}, **kwargs})
    assert current.implementation == implementation
    assert current.describe() == line


def test_by_default_it_is_the_choice_the_codecs_the_records_and_the_index_made():
    current = hotpath()
    chosen = (HOTPATH, RECORD_MODULE, CompiledBlockTable)
    assert current.compiled == tuple(name for name, module in zip(COMPILED_MODULES, chosen) if module is not None)


def test_the_worker_logs_it_at_info(caplog):
    logger = logging.getLogger("kvstream.test_hotpath")
    with caplog.at_level(logging.INFO, logger=logger.name):
        current = log_hotpath(logger)
    assert [r.getMessage() for r in caplog.records if r.name == logger.name] == [current.describe()]


@pytest.mark.parametrize(("kwargs", "implementation"),
                         [(BOTH, "compiled"), (NONE, "python")])
def test_metrics_report_the_implementation(tmp_path, kwargs, implementation):
    metrics = worker_metrics(tmp_path)
    metrics.hotpath = hotpath(environ={}, **kwargs)
    text = metrics.render().decode()
    samples = [line for line in text.splitlines() if line.startswith("kvstream_hotpath_info")]
    assert samples == [f'kvstream_hotpath_info{{implementation="{implementation}"}} 1.0']
    assert "# TYPE kvstream_hotpath_info gauge" in text


def test_metrics_report_this_process_by_default(tmp_path):
    text = worker_metrics(tmp_path).render().decode()
    assert f'kvstream_hotpath_info{{implementation="{hotpath().implementation}"}} 1.0' in text

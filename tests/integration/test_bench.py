"""Smoke test of ``make bench``: the harness runs and writes results.json with every figure's key.

Only the steps without stream-app workers run here (each worker start costs tens of seconds on the
development machine); the worker steps are exercised by ``make bench BENCH_ARGS=--quick``. No figure is
compared with its target: timings belong to the benchmark, never to the tests.
"""

from __future__ import annotations

import json

import pytest

from bench.__main__ import main
from bench.run import FIGURES

pytestmark = pytest.mark.integration


def test_bench_writes_every_key_with_unit_target_and_definition(tmp_path):
    code = main(["--quick", "--requests", "150", "--memory-rows", "2000",
                 "--only", "baselines,memory,producer,plain-consumer,bridge,tail",
                 "--output-dir", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work")])
    assert code == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert set(FIGURES) <= set(results["figures"])
    for key in FIGURES:
        figure = results["figures"][key]
        assert {"value", "unit", "target", "baseline", "definition"} <= set(figure)
    for key in ("producer_events_per_s", "bridge_events_per_s", "plain_consumer_events_per_s",
                "fastavro_decode_per_s", "bytes_per_row_memory", "bytes_per_row_rocksdb", "tail_messages_per_s"):
        assert results["figures"][key]["value"] > 0, key
    assert results["machine"]["cores"] >= 1 and results["date"]
    assert not results["errors"]
    assert (tmp_path / "out" / "results.png").stat().st_size > 0

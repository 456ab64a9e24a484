"""Which consumer reads the re-keyed topic, and how often the worker's own reader restarted, on ``/metrics``
(stream_apps/metrics.py; the restarts' meaning is stream_apps/rekeyed_reader.py's). A real worker's figures are
checked in tests/integration/test_operations.py."""

from __future__ import annotations

from stream_apps.rekeyed_reader import RekeyedReader
from tests.unit.test_hotpath_metric import worker_metrics


def _samples(metrics) -> dict[str, float]:
    text = metrics.render().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("kvstream_rekeyed_reader")}


def test_the_librdkafka_reader_counts_a_restart_per_generation(tmp_path):
    metrics = worker_metrics(tmp_path)
    reader = RekeyedReader(None, "127.0.0.1:9", "app-kv-events-by-ownership", None, [-1] * 8)
    metrics.rekeyed_reader = reader
    assert _samples(metrics) == {'kvstream_rekeyed_reader_info{reader="librdkafka"}': 1.0,
                                 "kvstream_rekeyed_reader_restarts_total": 0.0}
    reader.restart({0: 12, 3: None})
    reader.close()
    reader.restart({0: 40})
    assert _samples(metrics)["kvstream_rekeyed_reader_restarts_total"] == 2.0


def test_faust_s_consumer_has_no_restarts_to_count(tmp_path):
    assert _samples(worker_metrics(tmp_path, rekeyed_reader="faust")) == {
        'kvstream_rekeyed_reader_info{reader="faust"}': 1.0}

"""A worker as an operator runs it: probes, Prometheus metrics, JSON logs, and a clean stop on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request

import pytest
from confluent_kafka.admin import AdminClient

from kafka_io.admin import ensure_topics
from kafka_io.config import client_config
from kvstream.broker import free_port
from kvstream.worker import spawn_worker, stop_worker, wait_until_consumed
from producers.kafka_sink import KvEventProducer
from producers.split import Publisher
from stream_apps.settings import WorkerSettings

pytestmark = pytest.mark.integration

PARTITIONS = 2
#: The longest a worker may take to stop after SIGTERM (docs/operations.md, "Stopping").
STOP_LIMIT_S = 30.0


def _status(url: str) -> tuple[int, dict | str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            body = response.read().decode()
            return response.status, json.loads(body) if "json" in response.headers["Content-Type"] else body
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_probes_metrics_json_logs_and_a_clean_stop(kafka_bootstrap, tmp_path):
    prefix = f"ops-{int(time.time() * 1000)}."
    settings = WorkerSettings(bootstrap_servers=kafka_bootstrap, app_id="kvstream-ops", topic_prefix=prefix,
                              partitions=PARTITIONS, web_port=free_port(), data_dir=tmp_path / "data",
                              log_format="json")
    topics = settings.topics
    ensure_topics(kafka_bootstrap, {topics.kv_events: PARTITIONS, topics.dead_letter: 1})
    producer = KvEventProducer(kafka_bootstrap, topics.kv_events, dead_letter_topic=topics.dead_letter)
    for seq in range(20):
        producer.send_event(Publisher("ops-engine", 0, publisher_epoch=1), seq, 1767225600.0 + seq, 0,
                            {"type": "BlockStored", "block_hashes": [1000 + seq], "parent_block_hash": None,
                             "token_ids": [1, 2, 3, 4], "block_size": 4, "lora_id": None, "medium": "GPU",
                             "lora_name": None})
    producer.flush()
    url = f"http://127.0.0.1:{settings.web_port}"
    process = spawn_worker(settings, tmp_path / "worker.log")
    try:
        # not ready (503 with reasons) until it holds its partitions and has recovered its tables
        seen = set()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                code, body = _status(f"{url}/ready")
            except OSError:  # not listening yet
                time.sleep(0.2)
                continue
            seen.add(code)
            if code == 503:
                assert body["reasons"] and not body["ready"]
            if code == 200:
                break
            time.sleep(0.2)
        assert code == 200 and body == {"ready": True, "reasons": []}
        assert _status(f"{url}/health") == (200, {"status": "alive"})
        wait_until_consumed(kafka_bootstrap, topics, process, timeout_s=120)
        code, text = _status(f"{url}/metrics")
        assert code == 200
        samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                   for line in text.splitlines() if line and not line.startswith("#")}
        assert samples['kvstream_events_total{outcome="applied"}'] == 20
        assert samples["kvstream_events_repartitioned_total"] == 20
        assert samples['kvstream_resident_blocks{instance="ops-engine",ownership="primary",tier="GPU"}'] == 20
        assert samples["kvstream_ready"] == 1 and samples["kvstream_rebalances_total"] >= 1
        # the re-keyed topic's own reader (the default) applied the 20 events, so it started at least once
        assert samples['kvstream_rekeyed_reader_info{reader="librdkafka"}'] == 1
        assert samples["kvstream_rekeyed_reader_restarts_total"] >= 1
        # committed, so produced: one residency record per block (each key written once)
        assert samples['kvstream_changelog_records_total{table="residency"}'] == 20
        assert samples['kvstream_http_requests_total{status="200",view="ready"}'] >= 1
        # the collector's pauses, served for every generation. Whether this small worker has collected yet depends
        # on timing (each checkpoint's gc.freeze resets the young generation's count), so only the samples and
        # their agreement are checked here; tests/unit/test_checkpoint.py counts explicit collections. No bound
        # on how long a pause takes.
        for generation in "012":
            count = samples[f'kvstream_gc_pause_seconds_count{{generation="{generation}"}}']
            pauses = samples[f'kvstream_gc_pause_seconds_sum{{generation="{generation}"}}']
            assert count >= 0 and pauses >= 0 and (count == 0) == (pauses == 0), (generation, count, pauses)
        assert any(name.startswith("kvstream_consumer_lag_messages{") and f'topic="{topics.kv_events}"' in name
                   for name in samples)
        # the repartition process runs below the worker's priority (--repartition-nice, default 10), and says so
        child = next(json.loads(line)["process"] for line in (tmp_path / "worker.log").read_text().splitlines()
                     if line.startswith("{") and "repartition process at niceness" in line)
        assert child != process.pid and settings.repartition_nice == 10
        worker_nice = os.getpriority(os.PRIO_PROCESS, process.pid)
        assert os.getpriority(os.PRIO_PROCESS, child) == min(19, worker_nice + 10)  # the kernel's ceiling is 19
        # SIGTERM: the worker leaves its group and exits 0 (wait raises if it is still running at the limit)
        process.send_signal(signal.SIGTERM)
        assert process.wait(STOP_LIMIT_S) == 0
        admin = AdminClient(client_config(kafka_bootstrap))
        group = admin.describe_consumer_groups([topics.scoped_app_id])[topics.scoped_app_id].result()
        assert not group.members
    finally:
        stop_worker(process)
    lines = [line for line in (tmp_path / "worker.log").read_text().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines if line.startswith("{")]
    assert records and {"time", "level", "logger", "process", "message"} <= set(records[0])
    assert any("repartition" in r["logger"] for r in records)  # the child process logs JSON too

"""Full report mode on the real broker: an engine started with vLLM's ``kv_cache_report_mode="full"`` (PR #45261)
re-announces reused blocks with a BlockStored and no BlockRemoved follows; ``kvstream bridge --report-mode full``
marks its stores, and the worker counts a repeated one as an announcement (docs/residency.md, "Full report
mode"). The same events from an engine in the default mode are real duplicates and stay counted."""

from __future__ import annotations

import time

import pytest

from harness.vllm_publisher import BlockRemoved, BlockStored, FakeVllmPublisher
from kafka_io.admin import ensure_topics
from kvstream.broker import free_port, free_ports
from kvstream.worker import spawn_worker, stop_worker, wait_until_consumed
from producers.bridge import Bridge, BridgeMetrics, KafkaBatchSink, PublisherEndpoint
from producers.kafka_sink import KvEventProducer
from schemas.topics import KV_EVENTS, TopicNames
from stream_apps.settings import WorkerSettings
from stream_apps.snapshot import read_table, resident_rows

pytestmark = pytest.mark.integration

PARTITIONS = 2
PREFIX = "report-mode-test."
APP_ID = "kvstream-report-mode-test"
H1, H2 = 0x51, 0x52


def _events(publisher: FakeVllmPublisher) -> None:
    """Issue 26's example: seq 0 stores [h1, h2], seq 1 the same event again, seq 2 removes both."""
    stored = BlockStored([H1, H2], None, list(range(8)), 4, None, "GPU", None, group_idx=0)
    publisher.publish([stored])
    publisher.publish([stored])
    publisher.publish([BlockRemoved([H1, H2], "GPU", group_idx=0)])


def test_a_full_mode_engines_reuse_report_leaves_no_row_and_a_default_engines_duplicate_stays(kafka_bootstrap,
                                                                                              tmp_path):
    ensure_topics(kafka_bootstrap, {PREFIX + KV_EVENTS: PARTITIONS})
    producer = KvEventProducer(kafka_bootstrap, PREFIX + KV_EVENTS)
    ports = free_ports(4)
    engines = {"full-engine": "full", "default-engine": None}
    publishers, endpoints = [], []
    for i, (instance, mode) in enumerate(engines.items()):
        publishers.append(FakeVllmPublisher(ports[2 * i], ports[2 * i + 1]))
        endpoints.append(PublisherEndpoint(f"tcp://127.0.0.1:{ports[2 * i]}", f"tcp://127.0.0.1:{ports[2 * i + 1]}",
                                           instance, report_mode=mode))
    bridge = Bridge(endpoints, KafkaBatchSink(producer, BridgeMetrics()), replay_timeout_s=2,
                    state_file=tmp_path / "bridge-state.json")
    settings = WorkerSettings(bootstrap_servers=kafka_bootstrap, web_port=free_port(), data_dir=tmp_path / "w",
                              partitions=PARTITIONS, app_id=APP_ID, topic_prefix=PREFIX, store="memory://")
    worker = None
    try:
        time.sleep(0.3)  # ZMQ slow joiner: let the SUB connections settle before publishing
        for publisher in publishers:
            _events(publisher)
        deadline = time.monotonic() + 20
        while not all(e in bridge.state and bridge.state[e].last_seq == 2 for e in endpoints):
            assert time.monotonic() < deadline, "the bridge did not receive the three batches of each engine"
            bridge.poll(50)
        producer.flush(30)
        worker = spawn_worker(settings, tmp_path / "worker.log")
        topics = TopicNames(APP_ID, PREFIX)
        wait_until_consumed(kafka_bootstrap, topics, worker, timeout_s=180)
        rows = resident_rows(read_table(kafka_bootstrap, topics.changelog("residency"), "residency"))
        held = {(identity[0], identity[6]): copies for identity, copies in rows.items()}
        # the full-mode engine holds neither block; the default one holds one of its two real copies of each
        assert held == {("default-engine", H1.to_bytes(8, "big")): 1, ("default-engine", H2.to_bytes(8, "big")): 1}
    except Exception:
        if (tmp_path / "worker.log").exists():
            print((tmp_path / "worker.log").read_text()[-3000:])
        raise
    finally:
        if worker is not None:
            stop_worker(worker)
        bridge.close()
        for publisher in publishers:
            publisher.close()

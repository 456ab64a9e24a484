"""The index's fresh layer on the real broker: kv-events applied by an index as they arrive, before any worker's
changelog, and then checked by it (stream_apps/index/events_feed.py, stream_apps/index/fresh.py)."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import Producer

from kafka_io.admin import ensure_topics
from kafka_io.config import producer_config
from kvstream.broker import free_port
from kvstream.worker import spawn_worker, stop_worker, wait_until_consumed
from producers.kafka_sink import KvEventProducer
from producers.split import Publisher, split_event
from schemas import SOURCE_DISCONNECTED, AvroCodec
from schemas.topics import KV_EVENTS, TopicNames
from stream_apps.index.server import EmbeddedIndex
from stream_apps.settings import WorkerSettings

pytestmark = pytest.mark.integration

PARTITIONS = 4
PREFIX = "fresh-test."
APP_ID = "kvstream-fresh-test"
HASHES = [(7 << 32) + i for i in range(1, 5)]
CHAIN = [h.to_bytes(8, "big") for h in HASHES]


def _stored(hashes, medium="GPU"):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
            "token_ids": list(range(len(hashes) * 4)), "block_size": 4, "lora_id": None, "medium": medium,
            "lora_name": None, "group_idx": 0}


def _removed(hashes, medium="GPU"):
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, "group_idx": 0}


def _matched(index: EmbeddedIndex, instance: str = "fresh-e1") -> int:
    answer = index.query_hashes(CHAIN)["instances"].get(instance)
    return answer["longest_matched"] // 16 if answer else 0  # the default block size: 16 tokens


def _until(read, expected, timeout_s: float):
    """``read()`` polled until it gives ``expected``; returns (value, seconds it took)."""
    started = time.monotonic()
    while True:
        value = read()
        if value == expected or time.monotonic() - started > timeout_s:
            return value, time.monotonic() - started
        time.sleep(0.005)


def test_an_index_answers_from_kv_events_before_any_changelog_and_the_changelog_then_agrees(kafka_bootstrap,
                                                                                             tmp_path):
    topics = TopicNames(APP_ID, PREFIX)
    ensure_topics(kafka_bootstrap, {topics.kv_events: PARTITIONS, topics.changelog("residency"): PARTITIONS})
    producer = KvEventProducer(kafka_bootstrap, PREFIX + KV_EVENTS)
    engine = Publisher("fresh-e1")
    seq = iter(range(1000))

    def send(*events) -> None:
        s = next(seq)
        for i, event in enumerate(events):
            for record in split_event(engine, s, time.time(), i, event):
                producer.send(record)
        producer.flush(30)

    index = EmbeddedIndex(kafka_bootstrap, app_id=APP_ID, topic_prefix=PREFIX, source_lease_s=3600).start(wait_s=60)
    worker = None
    try:
        _until(lambda: index.events.reading, True, 30)
        time.sleep(1.0)  # the feed's assignment at the end offsets reaches the broker
        # no worker runs: only the fresh path can bring these, and with no changelog record to confirm them they
        # lapse after the window (the changelog is the authority)
        send(_stored(HASHES))
        assert _until(lambda: _matched(index), 4, 10)[0] == 4, index.index.fresh.counters
        assert index.index.stats()["entries_applied"] == 0  # nothing came through the changelog
        assert _until(lambda: _matched(index), 0, 30)[0] == 0
        assert index.index.fresh.counters.expired >= 4

        # a worker applies the same events from kv-events: its changelog brings them back, for good
        settings = WorkerSettings(bootstrap_servers=kafka_bootstrap, web_port=free_port(), data_dir=tmp_path / "w",
                                  partitions=PARTITIONS, app_id=APP_ID, topic_prefix=PREFIX, store="memory://",
                                  source_lease_s=3600)
        worker = spawn_worker(settings, tmp_path / "worker.log")
        wait_until_consumed(kafka_bootstrap, topics, worker, timeout_s=300)
        assert _until(lambda: _matched(index), 4, 30)[0] == 4

        # while the worker runs: a removal answers at once, then the changelog's record confirms the override
        send(_removed(HASHES[2:]))
        assert _until(lambda: _matched(index), 2, 10)[0] == 2
        assert _until(lambda: index.index.fresh.counters.confirmed >= 2 and not len(index.index.fresh), True, 30)[0], \
            vars(index.index.fresh.counters)

        # the bridge says the engine is gone: out of every answer at once, and back with its next event
        codec = AvroCodec("kv_event")
        down = {**split_event(engine, next(seq), time.time(), 0, _stored(HASHES[:1]))[0], "block_hash": None,
                "tier": None, "event": (SOURCE_DISCONNECTED, {"reason": "disconnected"})}
        raw = Producer(producer_config(kafka_bootstrap))  # as the bridge writes it: one copy per partition
        for partition in range(PARTITIONS):
            raw.produce(topics.kv_events, value=codec.encode(down), partition=partition)
        assert raw.flush(30) == 0
        assert _until(lambda: _matched(index), 0, 10)[0] == 0
        assert not index.index.workers()[0]["live"]
        send(_stored(HASHES[:1], medium="CPU"))
        assert _until(lambda: _matched(index), 2, 10)[0] == 2
        assert _until(lambda: not len(index.index.fresh), True, 30)[0]
        holders = sorted(tuple(sorted(h["tier"] for h in item["holders"])) for item in index.index.dump())
        assert holders == [("CPU", "GPU"), ("GPU",)]
    except Exception:
        if worker is not None and (tmp_path / "worker.log").exists():
            print((tmp_path / "worker.log").read_text()[-3000:])
        raise
    finally:
        index.close()
        if worker is not None:
            stop_worker(worker)

"""The Kafka Streams peer of ``make bench`` (bench/kafka_streams) computes the right rows on a tiny input.

Correctness only, on a few hand-made events through the real producer: reference counts, a removal never
stored, a clear that removes its source's GPU rows and nothing else, ownership in the key. Needs Java 17 and
Maven (the peer is built with ``mvn -q package`` on first use); skipped without them.
"""

from __future__ import annotations

import shutil
import time
import uuid

import pytest

from kafka_io.admin import ensure_topics, group_progress
from kvstream.broker import free_port
from producers.kafka_sink import KvEventProducer
from producers.split import Publisher

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("java") is None or shutil.which("mvn") is None,
                       reason="the Kafka Streams peer needs java (17+) and mvn to build and run"),
]


def _stored(h: int, medium: str = "GPU", ownership: str | None = None) -> dict:
    event = {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": None, "token_ids": [],
             "block_size": 16, "lora_id": None, "medium": medium, "lora_name": None, "group_idx": 0}
    if ownership is not None:
        event["ownership"] = ownership
    return event


def _removed(h: int, medium: str = "GPU") -> dict:
    return {"type": "BlockRemoved", "block_hashes": [h], "medium": medium, "group_idx": 0}


def test_peer_counts_rows_and_applies_clears(kafka_bootstrap, tmp_path):
    from bench.peers import KafkaStreamsPeer, build_kafka_streams

    classpath = build_kafka_streams(lambda _text: None)
    topic = f"peer-input-{uuid.uuid4().hex[:8]}"
    ensure_topics(kafka_bootstrap, {topic: 2})
    producer = KvEventProducer(kafka_bootstrap, topic)
    a, b = Publisher("engine-a"), Publisher("engine-b")
    batches = [
        (a, [_stored(0x11), _stored(0x11), _stored(0x12), _removed(0x12), _removed(0x13)]),  # 0x11 twice; 0x13 never
        (a, [_stored(0x21, "CPU")]),
        (b, [_stored(0x31), _stored(0x51)]),
        (a, [_stored(0x51, "CPU", ownership="kvcr")]),
        (a, [{"type": "AllBlocksCleared"}]),  # engine-a's GPU rows go (0x11); its CPU and kvcr rows stay
        (a, [_stored(0x41)]),
    ]
    seqs: dict = {}
    for publisher, events in batches:
        seq = seqs[publisher] = seqs.get(publisher, -1) + 1
        for index, event in enumerate(events):
            producer.send_event(publisher, seq, 1767231000.0 + seq, index, event)
    producer.flush(30)

    app_id = f"peer-test-{uuid.uuid4().hex[:8]}"
    peer = KafkaStreamsPeer(classpath, kafka_bootstrap, app_id, tmp_path / "state", free_port(),
                            tmp_path / "peer.log", topic)
    try:
        deadline = time.monotonic() + 120
        while True:
            peer.check_alive()
            try:
                progress = group_progress(kafka_bootstrap, app_id, [topic])[topic]
                if progress.end and progress.lag == 0:
                    break
            except RuntimeError:
                pass
            assert time.monotonic() < deadline, "the peer did not commit its input within 120 s"
            time.sleep(0.25)
        rows = peer.rows()
        stats = peer.stats()
    finally:
        peer.stop()
    # resident: engine-a 0x21 CPU, 0x41 GPU, kvcr/0x51; engine-b 0x31 GPU, primary/0x51 GPU
    assert rows == {"keys": 5, "resident_rows": 5, "copies": 5}
    assert stats["undecodable"] == 0
    assert stats["clears"] == 2  # one copy per partition
    assert stats["unknown_removals"] == 1

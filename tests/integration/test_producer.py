"""The producer's delivery accounting: reports come only for failures, and a failure still fails flush."""

from __future__ import annotations

import uuid

import pytest

from kafka_io.admin import ensure_topics
from producers.kafka_sink import KvEventProducer, ProduceError
from producers.split import Publisher

pytestmark = pytest.mark.integration

PUBLISHER = Publisher("engine-0", 0, publisher_epoch=1767225600000)
STORED = {"type": "BlockStored", "block_hashes": [1, 2, 3], "parent_block_hash": None, "token_ids": [],
          "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None}


def test_acknowledged_messages_are_counted_at_flush(kafka_bootstrap):
    topic = f"producer-{uuid.uuid4().hex[:8]}"
    ensure_topics(kafka_bootstrap, {topic: 4})
    producer = KvEventProducer(kafka_bootstrap, topic)
    assert producer.send_event(PUBLISHER, 0, 1.0, 0, STORED) == 3
    assert producer.send_event(PUBLISHER, 0, 1.0, 1, {"type": "AllBlocksCleared"}) == 1
    stats = producer.flush()
    assert (stats.sent, stats.acked, stats.failed) == (7, 7, 0)  # the clear went to all 4 partitions


def test_undelivered_messages_fail_flush_with_the_first_error(kafka_bootstrap):
    topic = f"producer-{uuid.uuid4().hex[:8]}"
    ensure_topics(kafka_bootstrap, {topic: 2})
    # the partition count comes from the real broker; the messages go to a port where nothing listens
    producer = KvEventProducer(kafka_bootstrap, topic, config_overrides={
        "bootstrap.servers": "127.0.0.1:1", "message.timeout.ms": 1000})
    producer.send_event(PUBLISHER, 0, 1.0, 0, STORED)
    with pytest.raises(ProduceError, match="3 messages failed") as raised:
        producer.flush(timeout_s=30)
    assert "first error" in str(raised.value) and producer.stats.first_error

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


def _produce(kafka_bootstrap, tmp_path, capsys, *events) -> tuple[int, str, str, str]:
    """``kvstream produce`` of one capture line holding ``events``, to topics of their own; (exit code, stdout,
    stderr, prefix)."""
    import json

    from kvstream.cli import main

    prefix = f"produce-{uuid.uuid4().hex[:8]}."
    capture = tmp_path / "capture.jsonl"
    capture.write_text(json.dumps({"instance_id": "engine-0", "seq": 0, "ts": 1.0, "events": list(events)}) + "\n")
    code = main(["produce", f"--jsonl={capture}", f"--bootstrap-servers={kafka_bootstrap}", f"--topic-prefix={prefix}",
                 "--partitions=2"])
    out, err = capsys.readouterr()
    return code, out, err, prefix


def test_produce_counts_dead_letters_apart_and_fails_when_nothing_was_accepted(kafka_bootstrap, tmp_path, capsys):
    """Issue 28: every event dead-lettered used to exit 0 with "produced 2 messages"."""
    from kafka_io.reader import messages_to_end

    code, out, err, prefix = _produce(kafka_bootstrap, tmp_path, capsys, {"type": "NoSuchEvent"},
                                      {"type": "BlockStored"})  # the second lacks its block hashes
    assert code == 1
    assert f"produced 0 messages to {prefix}kv-events" in out and f"2 inputs to the dead-letter topic {prefix}kv-" \
        "events-dead-letter" in out
    assert "nothing was accepted: every input went to the dead-letter topic" in err and "Traceback" not in err
    assert len(list(messages_to_end(kafka_bootstrap, f"{prefix}kv-events-dead-letter"))) == 2
    assert list(messages_to_end(kafka_bootstrap, f"{prefix}kv-events")) == []


def test_produce_with_some_events_accepted_exits_0_and_counts_each_kind(kafka_bootstrap, tmp_path, capsys):
    code, out, err, prefix = _produce(kafka_bootstrap, tmp_path, capsys, {"type": "NoSuchEvent"}, STORED)
    assert code == 0, err
    assert f"produced 3 messages to {prefix}kv-events" in out and "1 inputs to the dead-letter topic" in out

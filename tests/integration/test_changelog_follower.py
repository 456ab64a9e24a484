"""The follower of the small tables' changelogs (stream_apps/fleet.py) on the session's broker."""

from __future__ import annotations

import time
import uuid

import pytest
from confluent_kafka import Producer

from kafka_io.admin import ensure_topics
from kafka_io.config import client_config
from schemas import AvroCodec
from stream_apps.fleet import ChangelogFollower

pytestmark = pytest.mark.integration

CODEC = AvroCodec("tier_occupancy")


def _row(instance: str, blocks: int) -> dict:
    return {"ownership": None, "tier": "GPU", "instance_id": instance, "resident_blocks": blocks}


def _produce(bootstrap: str, topic: str, records: list[tuple[int, bytes, bytes | None]]) -> None:
    producer = Producer(client_config(bootstrap))
    for partition, key, value in records:
        producer.produce(topic, key=key, value=value, partition=partition)
    assert producer.flush(30) == 0


def _wait(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f} s: {what}")
        time.sleep(0.05)


@pytest.fixture
def topic(kafka_bootstrap):
    name = f"follower-{uuid.uuid4().hex[:8]}-changelog"
    ensure_topics(kafka_bootstrap, {name: 3}, configs={name: {"cleanup.policy": "compact"}})
    return name


def test_it_reads_every_partition_to_the_end_then_follows_new_records(kafka_bootstrap, topic):
    _produce(kafka_bootstrap, topic, [
        (0, b"0/primary/GPU/a", CODEC.encode(_row("a", 1))),
        (0, b"0/primary/GPU/a", CODEC.encode(_row("a", 5))),   # the later value wins
        (1, b"1/primary/GPU/b", CODEC.encode(_row("b", 2))),
        (1, b"1/primary/GPU/c", CODEC.encode(_row("c", 3))),
        (1, b"1/primary/GPU/c", None),                         # a tombstone deletes
        (2, b"2/primary/GPU/d", b"not avro"),                  # refused by the codec: logged and skipped
    ])
    follower = ChangelogFollower(kafka_bootstrap, {topic: CODEC}, group_id=f"{topic}-test")
    follower.start()
    try:
        _wait(lambda: follower.caught_up, "caught up")
        assert follower.error is None
        assert sorted(follower.partition_rows(topic)) == [("0/primary/GPU/a", _row("a", 5)),
                                                         ("1/primary/GPU/b", _row("b", 2))]
        assert follower.partition_rows(topic, skip={0}) == [("1/primary/GPU/b", _row("b", 2))]

        _produce(kafka_bootstrap, topic, [(2, b"2/primary/GPU/e", CODEC.encode(_row("e", 7))),
                                          (1, b"1/primary/GPU/b", None)])
        _wait(lambda: len(follower.partition_rows(topic)) == 2 and
              dict(follower.partition_rows(topic)).get("2/primary/GPU/e") == _row("e", 7), "the new records")
        assert dict(follower.partition_rows(topic)) == {"0/primary/GPU/a": _row("a", 5),
                                                        "2/primary/GPU/e": _row("e", 7)}
    finally:
        follower.stop()


def test_it_is_caught_up_at_once_on_empty_topics_and_names_a_missing_one(kafka_bootstrap, topic):
    follower = ChangelogFollower(kafka_bootstrap, {topic: CODEC}, group_id=f"{topic}-test")
    follower.start()
    try:
        _wait(lambda: follower.caught_up, "caught up on an empty topic")
        assert follower.partition_rows(topic) == []
    finally:
        follower.stop()

    missing = f"{topic}-missing"
    follower = ChangelogFollower(kafka_bootstrap, {missing: CODEC}, group_id=f"{topic}-test")
    follower.start()
    try:
        _wait(lambda: follower.error is not None, "an error for a missing topic", timeout_s=60)
        assert missing in follower.error and not follower.caught_up
        ensure_topics(kafka_bootstrap, {missing: 1})  # a later try finds it
        _wait(lambda: follower.caught_up, "caught up once the topic exists", timeout_s=60)
        assert follower.error is None
    finally:
        follower.stop()

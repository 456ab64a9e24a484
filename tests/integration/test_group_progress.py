"""kafka_io.admin.GroupProgressReader against the real broker: one reader, many readings, each exact."""

from __future__ import annotations

import time
import uuid

from confluent_kafka import Consumer, Producer, TopicPartition

from kafka_io.admin import GroupProgress, GroupProgressReader, ensure_topics, group_progress, partition_progress
from kafka_io.config import client_config


def _produce(bootstrap: str, topic: str, counts: dict[int, int]) -> None:
    producer = Producer(client_config(bootstrap))
    for partition, count in counts.items():
        for i in range(count):
            producer.produce(topic, value=b"%d" % i, partition=partition)
    assert producer.flush(30) == 0


def _commit(bootstrap: str, group: str, topic: str, offsets: dict[int, int]) -> None:
    consumer = Consumer(client_config(bootstrap, **{"group.id": group, "enable.auto.commit": False}))
    try:
        consumer.commit(offsets=[TopicPartition(topic, p, o) for p, o in offsets.items()], asynchronous=False)
    finally:
        consumer.close()


def _read(reading, *args):
    """``reading(*args)`` once it answers. A reading may fail for a moment (the group coordinator still loading on a
    fresh broker, a new client's first requests on a loaded machine): a RuntimeError that says why, which the
    reader's callers retry, as these tests do."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return reading(*args)
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_one_reader_follows_a_group_through_its_commits(kafka_bootstrap):
    topic, group = f"progress-{uuid.uuid4().hex[:8]}", f"progress-group-{uuid.uuid4().hex[:8]}"
    ensure_topics(kafka_bootstrap, {topic: 2})
    _produce(kafka_bootstrap, topic, {0: 5, 1: 3})
    with GroupProgressReader(kafka_bootstrap) as reader:
        assert _read(reader.group_progress, group, [topic]) == {topic: GroupProgress(0, 8)}  # nothing committed yet
        _commit(kafka_bootstrap, group, topic, {0: 5, 1: 1})
        assert _read(reader.partition_progress, group, [topic]) == {(topic, 0): GroupProgress(5, 5),
                                                                   (topic, 1): GroupProgress(1, 3)}
        assert _read(reader.group_progress, group, [topic])[topic].lag == 2
        _produce(kafka_bootstrap, topic, {1: 4})  # the end moves too
        _commit(kafka_bootstrap, group, topic, {1: 7})
        assert _read(reader.group_progress, group, [topic]) == {topic: GroupProgress(12, 12)}
    # the one-off functions read the same, each with clients of its own
    assert _read(group_progress, kafka_bootstrap, group, [topic]) == {topic: GroupProgress(12, 12)}
    assert _read(partition_progress, kafka_bootstrap, group, [topic])[(topic, 1)] == GroupProgress(7, 7)


def test_a_topic_created_while_a_reader_waits_for_it_is_read_once_it_exists(kafka_bootstrap):
    """The reader keeps a topic list's partitions only once all of them exist: a wait that starts before the
    stream app created its topics still sees them."""
    present, later = f"progress-{uuid.uuid4().hex[:8]}", f"progress-later-{uuid.uuid4().hex[:8]}"
    group = f"progress-group-{uuid.uuid4().hex[:8]}"
    ensure_topics(kafka_bootstrap, {present: 1})
    _produce(kafka_bootstrap, present, {0: 2})
    with GroupProgressReader(kafka_bootstrap) as reader:
        assert _read(reader.group_progress, group, [present, later]) == {present: GroupProgress(0, 2),
                                                                   later: GroupProgress(0, 0)}
        ensure_topics(kafka_bootstrap, {later: 3})
        _produce(kafka_bootstrap, later, {0: 1, 2: 2})
        _commit(kafka_bootstrap, group, later, {2: 2})
        assert _read(reader.group_progress, group, [present, later]) == {present: GroupProgress(0, 2),
                                                                        later: GroupProgress(2, 3)}
        reader.close()
        reader.close()  # a second close is harmless


def test_a_reader_dropped_without_close_leaves_no_asyncio_errors(kafka_bootstrap, caplog):
    """The fleet views keep a reader for the worker's life and never close it: collected, it closes itself rather
    than leave aiokafka's connection tasks to be destroyed pending (an asyncio error per connection)."""
    import gc
    import logging

    topic, group = f"progress-{uuid.uuid4().hex[:8]}", f"progress-group-{uuid.uuid4().hex[:8]}"
    ensure_topics(kafka_bootstrap, {topic: 1})
    reader = GroupProgressReader(kafka_bootstrap)
    assert _read(reader.group_progress, group, [topic]) == {topic: GroupProgress(0, 0)}
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        del reader
        gc.collect()
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []


def test_a_reader_closed_inside_a_running_event_loop_closes_cleanly(kafka_bootstrap, caplog):
    """The garbage collector may finalize a reader on a thread that runs an event loop (a worker's): its own loop
    cannot run there, so it closes from a thread of its own, leaving no pending task behind."""
    import asyncio
    import logging

    topic, group = f"progress-{uuid.uuid4().hex[:8]}", f"progress-group-{uuid.uuid4().hex[:8]}"
    ensure_topics(kafka_bootstrap, {topic: 1})
    reader = GroupProgressReader(kafka_bootstrap)
    assert _read(reader.group_progress, group, [topic]) == {topic: GroupProgress(0, 0)}

    async def close_here() -> None:
        reader.close()

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(close_here())
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []


def test_a_reader_makes_its_offsets_client_anew_after_disuse(kafka_bootstrap, monkeypatch):
    """Its loop runs only during readings, so a client left idle past the broker's idle timeout would write on a
    closed socket: past CLIENT_IDLE_S (here 0) the next reading makes a new one, and still reads right."""
    import kafka_io.admin

    topic, group = f"progress-{uuid.uuid4().hex[:8]}", f"progress-group-{uuid.uuid4().hex[:8]}"
    ensure_topics(kafka_bootstrap, {topic: 1})
    _produce(kafka_bootstrap, topic, {0: 3})
    with GroupProgressReader(kafka_bootstrap) as reader:
        assert _read(reader.group_progress, group, [topic]) == {topic: GroupProgress(0, 3)}
        monkeypatch.setattr(kafka_io.admin, "CLIENT_IDLE_S", 0.0)
        _commit(kafka_bootstrap, group, topic, {0: 2})
        assert _read(reader.group_progress, group, [topic]) == {topic: GroupProgress(2, 3)}
        assert _read(reader.group_progress, group, [topic]) == {topic: GroupProgress(2, 3)}


def test_a_topic_made_again_with_fewer_partitions_is_read_once_it_is_there(kafka_bootstrap):
    """A failed reading forgets the partitions it used: a topic deleted and made again with fewer partitions is
    read right as soon as the broker has it, not after PARTITIONS_REFRESH_S of errors."""
    from confluent_kafka.admin import AdminClient

    from kafka_io.config import client_config

    topic, group = f"progress-{uuid.uuid4().hex[:8]}", f"progress-group-{uuid.uuid4().hex[:8]}"
    ensure_topics(kafka_bootstrap, {topic: 3})
    with GroupProgressReader(kafka_bootstrap) as reader:
        assert _read(reader.group_progress, group, [topic]) == {topic: GroupProgress(0, 0)}
        admin = AdminClient(client_config(kafka_bootstrap))
        admin.delete_topics([topic], operation_timeout=30)[topic].result()
        deadline = time.monotonic() + 60
        # the deletion reaches the broker's metadata in its own time; a create before that is refused as existing
        while topic in admin.list_topics(timeout=10).topics:
            assert time.monotonic() < deadline, "the topic was not deleted"
            time.sleep(0.2)
        while True:
            ensure_topics(kafka_bootstrap, {topic: 1})
            made = admin.list_topics(topic, timeout=10).topics.get(topic)
            if made is not None and not made.error and len(made.partitions) == 1:
                break
            assert time.monotonic() < deadline, "the topic was not made again"
            time.sleep(0.2)
        _produce(kafka_bootstrap, topic, {0: 2})
        deadline = time.monotonic() + 20  # well under PARTITIONS_REFRESH_S (30 s)
        while True:
            try:
                progress = reader.partition_progress(group, [topic])
                if progress == {(topic, 0): GroupProgress(0, 2)}:
                    break
            except RuntimeError as exc:
                progress = exc
            assert time.monotonic() < deadline, f"the reader kept the deleted topic's partitions: {progress}"
            time.sleep(0.5)

"""Read a topic to its end, or to given offsets or a time, without a consumer group: the changelog reader of
every tool and of table recovery."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from kafka_io.config import CONNECT_TIMEOUT_S, client_config


@dataclass(frozen=True)
class ReadRange:
    """The offsets a read covers, per partition: from ``starts[p]`` up to ``ends[p]``, exclusive."""

    topic: str
    #: partition -> first offset read.
    starts: dict[int, int]
    #: partition -> the offset the read stops before (the high watermark at the start, or a stop offset or time).
    ends: dict[int, int]

    @property
    def messages(self) -> int:
        """Offsets covered in all (an upper bound on messages: a compacted topic has gaps)."""
        return sum(self.ends[p] - self.starts[p] for p in self.ends)


def messages_to_end(bootstrap_servers: str, topic: str, timeout_s: float = 60.0,
                    start_offsets: Mapping[int, int] | None = None, *,
                    stop_offsets: Mapping[int, int] | int | None = None, stop_time_ms: int | None = None,
                    missing_ok: bool = True, on_range: Callable[[ReadRange], None] | None = None) -> Iterator[Message]:
    """Every message of ``topic`` from its start (or the given offsets) to its end as of the call (or to the given
    stop offsets or time), in offset order per partition (partitions interleaved).

    One consumer reads every partition at once (assigned, not subscribed: no consumer group is joined and
    nothing is committed). The end of each partition is its high watermark when the call starts; what is
    written later is not read. Yields nothing if the topic does not exist (unless ``missing_ok`` is false).

    Args:
        timeout_s: longest time for the whole read, in seconds.
        start_offsets: partition -> first offset to read. Only these partitions are read; an offset below
            the partition's start (compacted or deleted) reads from its start, one at or past its end reads
            nothing. None: every partition, from its start.
        stop_offsets: partition -> offset to stop before (exclusive), a partition not in it read to its end; or
            one offset for every partition.
        stop_time_ms: stop each partition before its first message whose Kafka timestamp (milliseconds since
            the Unix epoch) is at or after this time (the broker's time index, ``offsets_for_times``).
        missing_ok: False: a topic that does not exist raises RuntimeError instead of yielding nothing.
        on_range: called once with the :class:`ReadRange` before the first message (e.g. to size a progress
            bar); not called when the topic does not exist.

    Raises:
        TimeoutError: the end offsets were not reached within ``timeout_s``.
        RuntimeError: the topic does not exist and ``missing_ok`` is false.
        confluent_kafka.KafkaException: the broker did not answer the metadata or watermark requests.
    """
    consumer = Consumer(client_config(bootstrap_servers, **{
        "group.id": f"kvstream-snapshot-{uuid.uuid4()}", "enable.auto.commit": False,
        "auto.offset.reset": "earliest", "enable.partition.eof": False,
        # fetches larger than librdkafka's defaults (1 MiB per partition, 50 MiB in all): a large changelog
        # is read in fewer round trips
        "max.partition.fetch.bytes": 8 << 20, "fetch.max.bytes": 64 << 20}))
    try:
        metadata = consumer.list_topics(topic, timeout=CONNECT_TIMEOUT_S)
        if topic not in metadata.topics or metadata.topics[topic].error:
            if missing_ok:
                return
            raise RuntimeError(f"topic {topic} does not exist on {bootstrap_servers}")
        partitions = metadata.topics[topic].partitions if start_offsets is None else start_offsets
        stop_at_time = {}
        if stop_time_ms is not None:
            found = consumer.offsets_for_times([TopicPartition(topic, p, stop_time_ms) for p in partitions],
                                               timeout=10)
            stop_at_time = {tp.partition: tp.offset for tp in found if tp.offset >= 0}  # -1: none that late
        starts, ends = {}, {}
        for p in partitions:
            low, high = _watermarks(consumer, TopicPartition(topic, p))
            start = low if start_offsets is None else max(low, start_offsets[p])
            stop = stop_offsets if isinstance(stop_offsets, int) else (stop_offsets or {}).get(p, high)
            end = min(high, stop_at_time.get(p, high), stop)
            if end > start:
                starts[p], ends[p] = start, end
        if on_range is not None:
            on_range(ReadRange(topic, dict(starts), dict(ends)))
        consumer.assign([TopicPartition(topic, p, starts[p]) for p in ends])
        deadline = time.monotonic() + timeout_s
        while ends:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {topic}: partitions {sorted(ends)} not read to their end "
                                   f"within {timeout_s:.0f}s")
            for message in consumer.consume(10000, timeout=0.1):
                if message.error():
                    continue
                p = message.partition()
                end = ends.get(p)
                if end is None or message.offset() >= end:  # past a stop offset (or a compacted gap before it)
                    ends.pop(p, None)
                    continue
                yield message
                if message.offset() + 1 >= end:
                    del ends[p]
    finally:
        consumer.close()


#: Errors a partition answers with while its leader is being elected (just after the topic was created).
_LEADER_MOVING = frozenset({KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
                            KafkaError.UNKNOWN_TOPIC_OR_PART})


def _watermarks(consumer: Consumer, partition: TopicPartition, retry_s: float = 15.0) -> tuple[int, int]:
    """A partition's (low, high) offsets, asked again while the broker answers with a retriable error.

    Just after a topic is created its partitions' leaders are still being elected, and the broker answers
    NOT_LEADER_FOR_PARTITION for a moment; a worker starting then crashed on it once.
    """
    deadline = time.monotonic() + retry_s
    while True:
        try:
            return consumer.get_watermark_offsets(partition, timeout=10)
        except KafkaException as exc:
            error = exc.args[0] if exc.args else None
            code = error.code() if hasattr(error, "code") else None
            if (code not in _LEADER_MOVING and not (hasattr(error, "retriable") and error.retriable())
                    or time.monotonic() > deadline):
                raise
            time.sleep(0.2)


def take_available(consumer: Consumer, most: int, timeout_s: float) -> list:
    """Up to ``most`` messages, waiting at most ``timeout_s`` for the first one only. ``consume(most, timeout)``
    returns when it has ``most`` messages or the timeout ran out, so at a few hundred messages a second it holds
    every message for most of the timeout; a wait for the first, then what is already there, holds none."""
    if timeout_s <= 0:
        return consumer.consume(most, 0)
    first = consumer.poll(timeout_s)
    if first is None:
        return []
    return [first, *consumer.consume(most - 1, 0)]

"""Read a topic to its end, without a consumer group: the changelog reader of every tool and of table recovery."""

from __future__ import annotations

import time
import uuid
from typing import Iterator, Mapping

from confluent_kafka import Consumer, Message, TopicPartition

from kafka_io.config import client_config


def messages_to_end(bootstrap_servers: str, topic: str, timeout_s: float = 60.0,
                    start_offsets: Mapping[int, int] | None = None) -> Iterator[Message]:
    """Every message of ``topic`` from its start (or the given offsets) to its end as of the call, in offset
    order per partition (partitions interleaved).

    One consumer reads every partition at once (assigned, not subscribed: no consumer group is joined and
    nothing is committed). The end of each partition is its high watermark when the call starts; what is
    written later is not read. Yields nothing if the topic does not exist.

    Args:
        timeout_s: longest time for the whole read, in seconds.
        start_offsets: partition -> first offset to read. Only these partitions are read; an offset below
            the partition's start (compacted or deleted) reads from its start, one at or past its end reads
            nothing. None: every partition, from its start.

    Raises:
        TimeoutError: the end offsets were not reached within ``timeout_s``.
        confluent_kafka.KafkaException: the broker did not answer the metadata or watermark requests.
    """
    consumer = Consumer(client_config(bootstrap_servers, **{
        "group.id": f"kvstream-snapshot-{uuid.uuid4()}", "enable.auto.commit": False,
        "auto.offset.reset": "earliest", "enable.partition.eof": False,
        # fetches larger than librdkafka's defaults (1 MiB per partition, 50 MiB in all): a large changelog
        # is read in fewer round trips
        "max.partition.fetch.bytes": 8 << 20, "fetch.max.bytes": 64 << 20}))
    try:
        metadata = consumer.list_topics(topic, timeout=10)
        if topic not in metadata.topics or metadata.topics[topic].error:
            return
        partitions = metadata.topics[topic].partitions if start_offsets is None else start_offsets
        starts, ends = {}, {}
        for p in partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            start = low if start_offsets is None else max(low, start_offsets[p])
            if high > start:
                starts[p], ends[p] = start, high
        consumer.assign([TopicPartition(topic, p, starts[p]) for p in ends])
        deadline = time.monotonic() + timeout_s
        while ends:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {topic}: partitions {sorted(ends)} not read to their end "
                                   f"within {timeout_s:.0f}s")
            for message in consumer.consume(10000, timeout=0.1):
                if message.error():
                    continue
                yield message
                p = message.partition()
                if p in ends and message.offset() + 1 >= ends[p]:
                    del ends[p]
    finally:
        consumer.close()

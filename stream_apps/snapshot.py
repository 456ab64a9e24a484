"""Read the stream app's tables back from their changelog topics, without Faust.

Kafka is the system of record: the residency table can be rebuilt by anyone
from ``<app id>-residency-changelog`` (last value per key wins, an empty value
deletes). The demo and the tests use this to compare the materialized residency
with the simulator's ground truth, row for row.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Iterator, Mapping

from confluent_kafka import Consumer, Message, TopicPartition

from kvstream.kafka_config import client_config
from schemas import AvroCodec

#: One residency row's identity: (instance, dp rank, tier, ownership, locality, group, block hash bytes).
RowIdentity = tuple


def changelog_topic(app_id: str, table: str) -> str:
    """Faust's changelog topic name of a table: ``<app id>-<table>-changelog``."""
    return f"{app_id}-{table}-changelog"


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
        # fetches larger than librdkafka's defaults (1 MiB per partition, 50 MiB in all): a 1.09M-record
        # residency changelog on 8 partitions was read in 3.5 s instead of 8 s
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


def read_table(bootstrap_servers: str, topic: str, family: str, timeout_s: float = 60.0) -> dict[str, dict]:
    """Read a changelog topic from the beginning to its current end and return the table it describes.

    Args:
        topic: the changelog topic.
        family: schema family of the values (e.g. ``residency``).

    Returns:
        key (str) -> decoded value, tombstones applied.

    Raises:
        TimeoutError: the end offsets were not reached within ``timeout_s``.
        schemas.DecodeError: a value is not a record of ``family``.
    """
    codec = AvroCodec(family)
    table: dict[str, dict] = {}
    for message in messages_to_end(bootstrap_servers, topic, timeout_s):
        key = message.key().decode()
        value = message.value()
        if value:
            table[key] = codec.decode(value)
        else:
            table.pop(key, None)
    return table


def resident_rows(table: dict[str, dict]) -> dict[RowIdentity, int]:
    """Flatten a residency table into ``{row identity: copies}`` for rows with copies > 0."""
    rows = {}
    for entry in table.values():
        for row in entry["rows"]:
            if row["copies"] > 0:
                identity = (row["instance_id"], row["data_parallel_rank"], row["tier"], entry["ownership"],
                            row["locality"], row["group_idx"], entry["block_hash"])
                rows[identity] = row["copies"]
    return rows


@dataclass
class Comparison:
    """Result of :func:`compare_rows`."""

    #: Rows equal on both sides (identity and copies).
    matching: int
    #: Up to ``limit`` differences: (identity, expected copies or None, actual copies or None).
    differences: list[tuple]
    #: Total number of differing rows.
    differing: int

    @property
    def ok(self) -> bool:
        """True when every row matches."""
        return self.differing == 0


def compare_rows(expected: dict[RowIdentity, int], actual: dict[RowIdentity, int], limit: int = 10) -> Comparison:
    """Compare two ``{row identity: copies}`` maps row for row."""
    differences = []
    differing = 0
    for identity in expected.keys() | actual.keys():
        want, got = expected.get(identity), actual.get(identity)
        if want != got:
            differing += 1
            if len(differences) < limit:
                differences.append((identity, want, got))
    matching = sum(1 for identity, copies in expected.items() if actual.get(identity) == copies)
    return Comparison(matching, differences, differing)

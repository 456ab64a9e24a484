"""Produce block-level ``kv_event`` records to Kafka (confluent-kafka).

Every producer of the project (cluster simulator, engine bridge, capture
replay) ends here, so the contract is applied once: key = canonical block hash,
murmur2 partitioner, idempotent, ``acks=all``, compressed; an
``AllBlocksCleared`` record (no key) goes to every partition, so each partition
sees it in order with that source's other events (docs/contract.md, "One Kafka
message per block-level event").
"""

from __future__ import annotations

from dataclasses import dataclass

from confluent_kafka import KafkaError, Producer

from kafka_io.admin import ensure_topics, topic_partitions
from kafka_io.config import DEFAULT_BOOTSTRAP_SERVERS, producer_config
from kafka_io.produce import produce_waiting
from kafka_io.schema_registry import writer_codec
from producers.split import BlockEncoder, ParentTracker, Publisher
from schemas import AvroCodec
from schemas.avro_writers import KvEventWriter
from schemas.topics import (
    DEAD_LETTER_TOPIC_CONFIG,
    ERROR_HEADER,
    KV_EVENTS,
    KV_EVENTS_DEAD_LETTER,
    OWNERSHIP_HEADER,
    SOURCE_HEADER,
)


class ProduceError(RuntimeError):
    """Kafka did not acknowledge some records; the message gives how many and the first error."""


@dataclass
class ProduceStats:
    """Counters of one :class:`KvEventProducer`, in Kafka messages."""

    #: Messages handed to the client (a clear counts once per partition).
    sent: int = 0
    #: Messages the broker acknowledged, as of the last :meth:`KvEventProducer.flush` (librdkafka reports
    #: only failures, see ``delivery.report.only.error``; the rest are counted when flush finds none left).
    acked: int = 0
    #: Messages that failed for good.
    failed: int = 0
    #: Messages sent to the dead-letter topic.
    dead_lettered: int = 0
    #: First delivery error seen, for the error message.
    first_error: str | None = None


class KvEventProducer:
    """Publish ``kv_event`` records to a topic.

    Args:
        bootstrap_servers: Kafka bootstrap servers.
        topic: target topic; it must exist (its partition count is read once,
            to broadcast clears).
        config_overrides: librdkafka settings layered over
            :func:`kafka_io.config.producer_config`.
        codec: the Avro codec (default: newest ``kv_event`` schema, single-object framing).
        dead_letter_topic: where :meth:`dead_letter` sends (``kv-events-dead-letter``, with the topic prefix).

    Use :meth:`send_event` per engine event (the fast path: split and encoded in one step, see
    :class:`producers.split.BlockEncoder`) or :meth:`send` per record, then :meth:`flush`, which raises
    :class:`ProduceError` if any message was not acknowledged. Not thread-safe.
    """

    @classmethod
    def from_settings(cls, settings, **config_overrides) -> KvEventProducer:
        """The producer a command's settings describe (``producers.settings``: ``bootstrap_servers``,
        ``events_topic``, ``dead_letter_topic``, ``schemas_topic``, ``partitions``, ``schema_registry_url``).

        Creates the events topic (``partitions``) and the dead-letter topic if absent. With a schema registry,
        the records carry the Confluent wire format and the schema is registered under ``<topic>-value``;
        without one, the schema is published to the schemas topic (kafka_io.schema_registry).

        Raises:
            schemas.codec.RegistryRefused: the registry refused the schema, with its reason.
            RuntimeError: a topic could not be created or the broker did not answer.
        """
        ensure_topics(settings.bootstrap_servers, {settings.events_topic: settings.partitions,
                                                   settings.dead_letter_topic: 1},
                      configs={settings.dead_letter_topic: DEAD_LETTER_TOPIC_CONFIG})
        codec = writer_codec("kv_event", settings.bootstrap_servers, settings.events_topic,
                             settings.schema_registry_url, settings.schemas_topic)
        return cls(settings.bootstrap_servers, settings.events_topic, codec=codec,
                   dead_letter_topic=settings.dead_letter_topic, config_overrides=config_overrides or None)

    def __init__(self, bootstrap_servers: str = DEFAULT_BOOTSTRAP_SERVERS, topic: str = KV_EVENTS, *,
                 config_overrides: dict | None = None, codec: AvroCodec | None = None,
                 dead_letter_topic: str = KV_EVENTS_DEAD_LETTER) -> None:
        self.topic = topic
        self.dead_letter_topic = dead_letter_topic
        self.codec = codec or AvroCodec("kv_event")
        self.partitions = topic_partitions(bootstrap_servers, topic)
        self.stats = ProduceStats()
        self.parents = ParentTracker()
        self._polled_at = 0
        #: ownership -> the kvstream-ownership header list of its block records
        self._headers: dict[str | None, list[tuple[str, bytes]]] = {}
        try:
            self._writer = KvEventWriter(self.codec)
        except ValueError:  # another schema version: fastavro's generic writer
            self._writer = None
        self._blocks = BlockEncoder(self._writer, self.parents) if self._writer else None
        # Delivery reports of failures only: a report per acknowledged message would cost a Python call
        # (and a copy of its key and value) per message.
        self._producer = Producer(producer_config(bootstrap_servers, **{
            "delivery.report.only.error": True, "on_delivery": self._on_delivery, **(config_overrides or {})}))

    def _on_delivery(self, err: KafkaError | None, _msg) -> None:
        if err is None:  # only with delivery.report.only.error overridden to False
            return
        self.stats.failed += 1
        if self.stats.first_error is None:
            self.stats.first_error = str(err)

    def _ownership_header(self, ownership: str | None) -> list[tuple[str, bytes]]:
        """The ``kvstream-ownership`` header of a block record (:data:`schemas.topics.OWNERSHIP_HEADER`), for
        consumers that route records without decoding them."""
        headers = self._headers.get(ownership)
        if headers is None:
            headers = self._headers[ownership] = [(OWNERSHIP_HEADER, (ownership or "").encode())]
        return headers

    def _produce(self, value: bytes, key: bytes | None, partition: int | None, headers=None) -> None:
        if partition is None:
            produce_waiting(self._producer, self.topic, value, key, headers=headers)
        else:
            produce_waiting(self._producer, self.topic, value, key, partition=partition)
        self.stats.sent += 1

    def send(self, record: dict) -> None:
        """Encode and enqueue one record: keyed by its block hash, or to every partition when it has none.

        BlockStored records get ``parent_known`` (see :class:`producers.split.ParentTracker`).
        """
        self.parents.note(record)
        value = self._writer.encode(record) if self._writer else self.codec.encode(record)
        key = record["block_hash"]
        if key is None:
            for partition in range(self.partitions):
                self._produce(value, None, partition)
        else:
            self._produce(value, key, None, self._ownership_header(record["event"][1].get("ownership")))
        if self.stats.sent - self._polled_at > 4096:
            self._polled_at = self.stats.sent
            self._producer.poll(0)

    def send_event(self, publisher: Publisher, seq: int, ts: float, batch_index: int, event: dict) -> int:
        """Split one engine event per block, encode and enqueue its records; returns the number of records.

        Produces exactly what ``for r in split_event(...): send(r)`` produces (arguments as
        :func:`producers.split.split_event`), with fewer Python calls.

        Raises:
            producers.split.InvalidEvent: the event cannot become block records (nothing was sent).
        """
        if self._blocks is None:
            from producers.split import split_event

            records = split_event(publisher, seq, ts, batch_index, event)
            for record in records:
                self.send(record)
            return len(records)
        pairs = self._blocks.encode_event(publisher, seq, ts, batch_index, event)
        produce, topic = self._producer.produce, self.topic
        headers = self._ownership_header(event.get("ownership"))  # a dict: encode_event checked the event
        for key, value in pairs:
            if key is None:
                for partition in range(self.partitions):
                    self._produce(value, None, partition)
                continue
            try:
                produce(topic, value, key, headers=headers)
            except BufferError:  # local queue full: wait for room (the common case above costs no extra call)
                self._produce(value, key, None, headers)
                continue
            self.stats.sent += 1
        if self.stats.sent - self._polled_at > 4096:
            self._polled_at = self.stats.sent
            self._producer.poll(0)
        return len(pairs)

    def dead_letter(self, value: bytes, reason: str, source: str, key: bytes | None = None) -> None:
        """Send bytes that could not become records to the dead-letter topic, with the reason in a header.

        Args:
            value: the original bytes (a whole payload, or one event's msgpack).
            reason: why (header ``kvstream-error``).
            source: where they came from, e.g. ``tcp://host:5557 seq 42 event 3`` (header ``kvstream-source``).
        """
        self.stats.dead_lettered += 1
        produce_waiting(self._producer, self.dead_letter_topic, value, key,
                        headers={ERROR_HEADER: reason[:1000].encode(), SOURCE_HEADER: source[:500].encode()})
        self.stats.sent += 1

    def poll(self, timeout_s: float = 0.0) -> None:
        """Let librdkafka serve delivery reports (failures) and queue space; waits up to ``timeout_s``."""
        self._producer.poll(timeout_s)

    def flush(self, timeout_s: float = 120.0) -> ProduceStats:
        """Wait until every message is acknowledged.

        Raises:
            ProduceError: messages failed, or were still unacknowledged after ``timeout_s``.
        """
        remaining = self._producer.flush(timeout_s)
        self._producer.poll(0)  # serve the last failure reports
        self.stats.acked = self.stats.sent - self.stats.failed - remaining
        if remaining or self.stats.failed:
            raise ProduceError(
                f"{self.stats.failed} messages failed and {remaining} were unacknowledged after {timeout_s}s "
                f"(first error: {self.stats.first_error})")
        return self.stats

"""The worker's output producer: every record the materializing agent writes, through one confluent-kafka
producer.

What goes through it: the tables' changelog records (:mod:`stream_apps.store`), the analytics topics
``kv-residency-changes`` and ``kv-tier-occupancy``, and dead letters. A Faust send costs more than applying
several events; librdkafka's produce only enqueues. Nothing here waits for the broker: the agent's
checkpoint (:class:`stream_apps.checkpoint.Checkpoint`, whose docstring has the order) waits for the
acknowledgements (:meth:`OutputTopics.acknowledge`) before any offset is committed: at least once.
"""

from __future__ import annotations

import logging

from confluent_kafka import Producer

from kafka_io.config import producer_config
from kafka_io.produce import produce_waiting
from kafka_io.schema_registry import publish_schema, writer_codec
from schemas.avro_writers import ResidencyChangeWriter
from schemas.topics import ERROR_HEADER, SOURCE_HEADER, TopicNames
from stream_apps.checkpoint import FLUSH_TIMEOUT_S, check_acknowledged
from stream_apps.delivery_reports import refused

log = logging.getLogger(__name__)

#: The arguments of :meth:`OutputTopics.change`: residency_change v1's fields, in order.
CHANGE_FIELDS = ("block_hash", "ownership", "instance_id", "data_parallel_rank", "tier", "medium", "locality",
                 "group_idx", "resident", "copies", "ts", "cause")


class OutputTopics:
    """The output producer of one worker.

    Args:
        bootstrap_servers: Kafka bootstrap servers (security from :mod:`kafka_io.config`).
        topics: the app's topic names (its own output topics, the shared dead-letter topic).
        schema_registry_url: with a registry, the output topics carry the Confluent wire format, their schemas
            registered under ``<topic>-value``; empty: single-object framing, the schemas published to the
            schemas topic.
        residency_changes: whether :meth:`change` publishes anything (``kvstream worker --residency-changes``);
            a caller on the hot path may check :attr:`residency_changes` to spare the call.
        report_successes: whether librdkafka's delivery report of every record reaches Python (a
            ``confluent_kafka.Message`` each, key and value copied), or only of the refused ones
            (``delivery.report.only.error``). Only a store that persists its changelog's offsets needs the
            successes (:attr:`stream_apps.store.RocksDBTableStore.needs_acknowledged_offsets`); the checkpoint's
            flush counts what is unacknowledged either way.

    Raises:
        schemas.codec.RegistryRefused: the registry refused an output schema (e.g. not BACKWARD compatible).
    """

    def __init__(self, bootstrap_servers: str, topics: TopicNames, schema_registry_url: str = "",
                 residency_changes: bool = True, report_successes: bool = True) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.topics = topics
        #: Whether residency transitions are published (the callers skip :meth:`change` when not).
        self.residency_changes = residency_changes
        #: Whether every record's delivery report reaches its callback (True) or only a refusal's (False).
        self.report_successes = report_successes
        self._producer: Producer | None = None
        #: Delivery reports of the outputs produced without a callback of their own (residency changes,
        #: occupancy, dead letters): error or None -> the last message reported with it, filled by the dict's
        #: own ``__setitem__`` as librdkafka's callback, so a report costs no Python call
        #: (:mod:`stream_apps.delivery_reports`).
        self._reports: dict = {}
        # registered now (an incompatible schema stops the worker at start); published to the schemas topic
        # with the first record (the constructor needs no broker)
        self._change_codec = writer_codec("residency_change", bootstrap_servers, topics.residency_changes,
                                          schema_registry_url, topics.schemas, publish=False)
        self._occupancy_codec = writer_codec("tier_occupancy", bootstrap_servers, topics.tier_occupancy,
                                             schema_registry_url, topics.schemas, publish=False)
        self._registry = bool(schema_registry_url)
        try:
            self._encode_change = ResidencyChangeWriter(self._change_codec).change
        except ValueError as exc:  # a schema version the writer does not know: correct, only slower
            log.warning("%s; writing residency_change records with fastavro (slower)", exc)
            self._encode_change = lambda *fields: self._change_codec.encode(dict(zip(CHANGE_FIELDS, fields)))
        #: Records sent to the dead-letter topic by this worker.
        self.dead_lettered = 0

    @property
    def producer(self) -> Producer:
        """The confluent-kafka producer, created on first use (after Faust has forked nothing more)."""
        if self._producer is None:
            if not self._registry:
                publish_schema(self.bootstrap_servers, self.topics.schemas, self._change_codec.schema,
                               self._occupancy_codec.schema)
            self._producer = Producer(producer_config(self.bootstrap_servers, on_delivery=self._reports.__setitem__,
                                                      **{"delivery.report.only.error": not self.report_successes}))
        return self._producer

    def change(self, block_hash: bytes, ownership: str | None, instance_id: str, data_parallel_rank: int,
               tier: str, medium: str | None, locality: str | None, group_idx: int | None, resident: bool,
               copies: int, ts: float, cause: str) -> None:
        """One ``<app id>-kv-residency-changes`` record (schemas/residency_change_v1.avsc), keyed by block hash;
        nothing unless :attr:`residency_changes` is on."""
        if not self.residency_changes:
            return
        self.produce(self.topics.residency_changes, block_hash, self._encode_change(
            block_hash, ownership, instance_id, data_parallel_rank, tier, medium, locality, group_idx, resident,
            copies, ts, cause))

    def occupancy(self, key: str, value: dict | None) -> None:
        """One ``<app id>-kv-tier-occupancy`` record (compacted; key ``<partition>/<ownership>/<tier>/<instance>``;
        None: a tombstone).

        The ``tier-occupancy`` table's store calls this for each of its changelog records (its ``mirror``,
        :class:`stream_apps.store.MemoryTableStore`): each changed row's latest value once per
        ``--global-changelog-interval-s`` and checkpoint, not once per batch message, which at low rates was hundreds
        of records a second for a compacted topic that keeps only the last (bench/HISTORY.md, "2026-12-05")."""
        self.produce(self.topics.tier_occupancy, key.encode(),
                     None if value is None else self._occupancy_codec.encode(value))

    def dead_letter(self, key: bytes | None, value: bytes | None, reason: str, source: str) -> None:
        """Send a record's original bytes to ``kv-events-dead-letter`` with the reason and where it came from
        (``topic/partition/offset``) in the headers."""
        self.dead_lettered += 1
        log.warning("dead-lettering %s: %s", source, reason)
        self.produce(self.topics.dead_letter, key, value,
                     headers=[(ERROR_HEADER, reason.encode()[:1000]), (SOURCE_HEADER, source.encode())])

    def produce(self, topic: str, key: bytes | None, value: bytes | None, partition: int | None = None,
                on_delivery=None, headers=None) -> None:
        """Enqueue one record; waits only while librdkafka's queue is full.

        Args:
            topic: the topic.
            key, value: the record's bytes (None: no key; a tombstone).
            partition: the partition; None: the key's murmur2 partition (the producer's partitioner).
            on_delivery: ``(error, message)`` callback of this record's delivery report instead of the output
                producer's, whose refusals the checkpoint raises (:meth:`take_delivery_errors`); a caller that
                gives one must make its refusals fail the checkpoint itself (the stores do, in ``persist``).
            headers: the record's headers, ``[(name, bytes)]``.
        """
        producer = self._producer or self.producer
        # Positional arguments straight to librdkafka: the stores call this once per changelog record, and
        # building keyword arguments per record costs about as much as the enqueue. -1 is librdkafka's
        # "unassigned" partition: the partitioner picks it.
        try:
            if headers is None:
                producer.produce(topic, value, key, -1 if partition is None else partition, on_delivery)
            else:
                producer.produce(topic, value, key, -1 if partition is None else partition, on_delivery,
                                 headers=headers)
        except BufferError:
            produce_waiting(producer, topic, value, key, partition=-1 if partition is None else partition,
                            on_delivery=on_delivery, headers=headers)

    def serve_delivery_reports(self) -> None:
        """Run the delivery callbacks of the outputs acknowledged so far, without waiting.

        Called often between messages, so that a checkpoint's flush finds few reports left to serve: each is a
        Python call, and a whole commit interval's of them stopped the agent at every checkpoint.
        """
        if self._producer is not None:
            self._producer.poll(0)

    def acknowledge(self, timeout_s: float) -> int:
        """Send what is queued at once and serve delivery reports until every output produced so far is
        acknowledged or refused, for at most ``timeout_s`` (0: the reports already in); returns how many are
        still unacknowledged (the checkpoint's step 2, :class:`stream_apps.checkpoint.Acknowledging`)."""
        return 0 if self._producer is None else self._producer.flush(timeout_s)

    def take_delivery_errors(self) -> list[str]:
        """The outputs the broker refused since the last call (one per partition and error code of those without
        a callback of their own), forgotten here."""
        errors = refused(self._reports)
        self._reports.clear()
        return errors

    def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
        """Wait until every output is acknowledged, outside a checkpoint (tests, tools): the checkpoint's step 2
        alone, nothing persisted or committed.

        Raises:
            RuntimeError: outputs still unacknowledged after ``timeout_s``, or refused by the broker.
        """
        check_acknowledged(self, self.acknowledge(timeout_s), timeout_s)

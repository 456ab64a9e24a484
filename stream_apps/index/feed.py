"""Feeding a :class:`~stream_apps.index.fleet_index.FleetIndex` from the residency changelog.

``<app id>-residency-changelog`` is compacted: read from its start it is the residency table (last value per key,
an empty value deletes), and read on it is every change, as the workers buffer and write them (every
``--changelog-interval-s``). The feed reads every partition with one consumer that joins no group and commits
nothing (a new replica always starts from the compacted state), so any number of index replicas read it without
loading the workers: reads scale by adding replicas, as Kafka Streams users scale reads with global tables.

Readiness: the feed takes the end offsets of every partition when it starts, and reports itself caught up once
it has read to them. Until then :meth:`ChangelogFeed.not_ready` gives the reasons, and the views answer 503 with
them rather than an answer that would be missing blocks.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Callable

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from kafka_io.config import client_config
from kafka_io.reader import take_available
from schemas import AvroCodec, DecodeError
from stream_apps.index.compacted_feed import TopicLook, close_reader
from stream_apps.index.entry_reader import IndexEntryReader
from stream_apps.index.fleet_index import FleetIndex

log = logging.getLogger(__name__)

#: Records taken from the consumer per call: enough to amortize the call, few enough that a query waiting for
#: the index's lock waits a millisecond or two at most.
POLL_BATCH = 500
#: Seconds between looks for a changelog topic that does not exist yet.
TOPIC_RETRY_S = 1.0


class ChangelogFeed:
    """Reads ``topic`` (a residency changelog) into ``index``, from its start, and keeps reading.

    Args:
        index: the index fed.
        bootstrap_servers: Kafka bootstrap servers.
        topic: ``<app id>-residency-changelog``.
        codec: reads the changelog's values (``kafka_io.schema_registry.reader_codec("residency", ...)``, so
            that either framing and every residency version is read).
        consumer_factory: builds the feed's consumer from its librdkafka settings (a dict); confluent-kafka's
            ``Consumer`` unless told otherwise. What it returns is used as that ``Consumer`` is: ``list_topics``,
            ``get_watermark_offsets``, ``assign``, ``consume`` and ``close`` (tests give one that serves a fixed
            list of messages, without a broker).

    Values are read with an :class:`~stream_apps.index.entry_reader.IndexEntryReader` over ``codec`` (only the
    rows' holders and the entry's parent and content hash, what :meth:`FleetIndex.apply_rows` takes) and applied
    a batch at a time with ``index.apply_messages``; an index without that method (a wrapper offering only
    ``apply_entry``) is given the codec's decoded entries.
    """

    def __init__(self, index: FleetIndex, bootstrap_servers: str, topic: str, codec: AvroCodec, *,
                 consumer_factory: Callable[[dict], Consumer] = Consumer) -> None:
        self.index = index
        self.topic = topic
        self._codec = codec
        self._read_entry = IndexEntryReader(codec).read_index_entry
        self._consumer: Consumer | None = None
        #: partition -> the offset to read up to before the index counts as caught up (end offsets at start).
        self._targets: dict[int, int] = {}
        #: partition -> next offset to read.
        self._positions: dict[int, int] = {}
        self._caught_up_at: float | None = None
        self._started = time.monotonic()
        self._look = TopicLook(topic, lambda: consumer_factory(client_config(bootstrap_servers, **{
            "group.id": f"kvstream-index-{uuid.uuid4().hex}", "enable.auto.commit": False,
            "enable.auto.offset.store": False, "auto.offset.reset": "earliest",
            "fetch.wait.max.ms": 20, "queued.max.messages.kbytes": 65536})), TOPIC_RETRY_S)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: Records read, and values that could not be decoded (logged with their key and reason, then skipped).
        self.records = 0
        self.undecodable = 0
        #: Seconds from the feed's start until it was caught up; None until then.
        self.catch_up_s: float | None = None

    # -- state -----------------------------------------------------------------------------------------------

    @property
    def caught_up(self) -> bool:
        """True once every partition was read to its end offset as of the feed's start."""
        return self._caught_up_at is not None

    def not_ready(self) -> list[str]:
        """Why the index may not answer yet (empty once caught up)."""
        if self.caught_up:
            return []
        if self._consumer is None:
            return [f"the index is waiting for the changelog topic {self.topic} (no worker has created it yet?)"]
        behind = sum(max(0, self._targets[p] - self._positions.get(p, 0)) for p in self._targets)
        return [f"the index is catching up on {self.topic}: {behind:,} records to go "
                f"({self.records:,} read in {time.monotonic() - self._started:.1f} s)"]

    def lag(self) -> int:
        """Records of the changelog not read yet, as of the last watermarks the consumer saw."""
        if self._consumer is None:
            return 0
        lag = 0
        for partition, position in self._positions.items():
            try:
                _, high = self._consumer.get_watermark_offsets(TopicPartition(self.topic, partition), cached=True)
            except KafkaException:
                continue
            if high is not None and high >= 0:
                lag += max(0, high - position)
        return lag

    # -- reading ---------------------------------------------------------------------------------------------

    def _open(self) -> bool:
        """Assign every partition of the topic from its start and take the catch-up targets; False while the
        topic does not exist (looked for again at most every :data:`TOPIC_RETRY_S`, :class:`TopicLook`)."""
        partitions = self._look.partitions()
        if partitions is None:
            return False
        targets = {}
        try:
            for partition in partitions:
                low, high = self._look.consumer.get_watermark_offsets(TopicPartition(self.topic, partition),
                                                                      timeout=10)
                targets[partition] = high
                self._positions[partition] = low
        except KafkaException as exc:  # the looking consumer stays for the next look
            log.warning("index: cannot read %s yet: %s", self.topic, exc)
            return False
        consumer = self._look.take()
        consumer.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in targets])
        self._targets, self._consumer = targets, consumer
        log.info("index: reading %s (%d partitions, %d records to catch up on)", self.topic, len(targets),
                 sum(targets[p] - self._positions[p] for p in targets))
        self._check_caught_up()
        return True

    def _check_caught_up(self) -> None:
        if self._caught_up_at is None and all(self._positions.get(p, 0) >= t for p, t in self._targets.items()):
            self._caught_up_at = time.monotonic()
            self.catch_up_s = self._caught_up_at - self._started
            log.info("index: caught up on %s in %.1f s (%d records, %d blocks)", self.topic, self.catch_up_s,
                     self.records, self.index.stats()["blocks"])

    def poll(self, timeout_s: float = 0.0) -> int:
        """Read what the consumer has (up to :data:`POLL_BATCH` records, waiting at most ``timeout_s``) into the
        index; returns the records read."""
        if self._consumer is None and not self._open():
            return 0
        messages = take_available(self._consumer, POLL_BATCH, timeout_s)
        if not messages:
            return 0
        apply_messages = getattr(self.index, "apply_messages", None)
        if apply_messages is not None:
            # the lean path: the index reads only what it keeps (no dict per entry, row and worker: most of a
            # catch-up's time went to building them), the whole batch in one call
            failures, errors = apply_messages(messages, self._positions, self._read_entry)
        else:  # an index that only has apply_entry: the codec's decoded entries
            failures, errors = self._apply_entries(messages)
        for message in errors:
            if message.error().code() != KafkaError._PARTITION_EOF:
                log.warning("index: reading %s: %s", self.topic, message.error())
        for message, exc in failures:
            self.undecodable += 1
            log.error("index: skipped record %s of %s[%d]@%d: %s", message.key()[:80], self.topic,
                      message.partition(), message.offset(), exc)
        self.records += len(messages)
        if self._caught_up_at is None:
            self._check_caught_up()
        return len(messages)

    def _apply_entries(self, messages: list) -> tuple[list, list]:
        """:meth:`poll`'s step for an index that has only ``apply_entry``: the codec's decoded entries, one by
        one. Returns ``(failures, errors)`` as ``FleetIndex.apply_messages``."""
        index, positions, decode = self.index, self._positions, self._codec.decode
        failures, errors = [], []
        with index.lock:
            for message in messages:
                if message.error() is not None:
                    errors.append(message)
                    continue
                positions[message.partition()] = message.offset() + 1
                if message.key() is None:
                    continue
                value = message.value()
                try:
                    index.apply_entry(message.key().decode(), decode(value) if value else None)
                except (DecodeError, ValueError, KeyError, TypeError) as exc:
                    failures.append((message, exc))
        return failures, errors

    async def run(self, idle_sleep_s: float = 0.01) -> None:
        """Read forever in the running event loop (a worker's, or ``kvstream index``'s): never blocks it for
        longer than one batch."""
        while not self._stop.is_set():
            try:
                # opened in a thread: it asks the broker for the topic's metadata and every partition's offsets,
                # which may wait seconds for a broker that is slow or not there yet
                if self._consumer is None and not await asyncio.to_thread(self._open):
                    await asyncio.sleep(TOPIC_RETRY_S)
                    continue
                read = self.poll(0)
            except KafkaException as exc:
                log.warning("index: %s; retrying", exc)
                read = 0
                await asyncio.sleep(TOPIC_RETRY_S)
            await asyncio.sleep(0 if read == POLL_BATCH else idle_sleep_s)

    def start_thread(self) -> threading.Thread:
        """Read forever in a daemon thread (the embedded library: a router's own process); :meth:`close` stops
        it."""
        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self.poll(0.05)
                except KafkaException as exc:
                    log.warning("index: %s; retrying", exc)
                    self._stop.wait(TOPIC_RETRY_S)
                if self._consumer is None:
                    self._stop.wait(0.05)
            self._close_consumer()  # here, not in close(): a consumer must not be closed while another thread polls it
        self._thread = threading.Thread(target=loop, name="kvstream-index-feed", daemon=True)
        self._thread.start()
        return self._thread

    def wait_caught_up(self, timeout_s: float) -> bool:
        """Block until caught up (for :meth:`start_thread` users); False after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.caught_up and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.caught_up

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop reading and close the consumer (waiting up to ``timeout_s`` for the feed's thread, if any)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        else:
            self._close_consumer()

    def _close_consumer(self) -> None:
        close_reader(self._look, self._consumer)
        self._consumer = None

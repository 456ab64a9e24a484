"""Feeding a :class:`~stream_apps.index.fleet_index.FleetIndex` straight from ``kv-events``: the fresh path.

The residency changelog follows an engine's event by the whole pipeline (the repartition, the agent, a changelog
interval), hundreds of milliseconds. This feed reads ``kv-events`` itself, as Dynamo's and Mooncake's indexers
read the engines' events, and applies what an event alone says to the index's fresh layer
(:mod:`stream_apps.index.fresh`) and to the sources' leases (:mod:`stream_apps.index.liveness`):

* ``BlockStored`` / ``BlockRemoved`` of a source with one publisher: a holder added or removed at once;
* ``AllBlocksCleared``, ``PublisherRestarted``, ``SourceUnregistered``: the source's holders in scope leave;
* every event and ``SourceHeartbeat`` renews the source's lease; ``SourceDisconnected`` (the bridge saw the engine
  go) marks it down until it is heard of again.

Like the changelog feed it joins no group and commits nothing. At start it reads back the last lease's worth of
``kv-events`` (by timestamp) for liveness only, so an index started after an engine died knows it is down, and
applies block events only from the end offsets it found (older ones are in the changelog it catches up on).
It runs in a thread of its own: a consume that waits for the next message wakes as soon as one arrives, where
a poll from the event loop would add its sleep to every event's delay.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable

from confluent_kafka import OFFSET_END, Consumer, KafkaError, KafkaException, TopicPartition

from kafka_io.config import client_config
from kafka_io.reader import take_available
from schemas import (
    ALL_BLOCKS_CLEARED,
    BLOCK_REMOVED,
    BLOCK_STORED,
    PUBLISHER_RESTARTED,
    SOURCE_DISCONNECTED,
    SOURCE_UNREGISTERED,
    AvroCodec,
    DecodeError,
)
from schemas.block_event import (
    R_BATCH_INDEX,
    R_BLOCK_HASH,
    R_CONTENT_HASH,
    R_DP_RANK,
    R_EPOCH,
    R_GROUP_IDX,
    R_INSTANCE,
    R_KIND,
    R_OWNERSHIP,
    R_PARENT,
    R_SEQ,
    R_TIER,
    R_TS,
    R_WORLD_SIZE,
    ROUTE_SLOTS,
    block_route,
)
from stream_apps.index.compacted_feed import TopicLook, close_reader
from stream_apps.index.fleet_index import FleetIndex
from stream_apps.index.fresh import CLEAR_TIERS

log = logging.getLogger(__name__)

#: Messages taken from the consumer per call (each one block-level event).
POLL_BATCH = 1000
#: Seconds one consume waits for a message: the feed wakes at once when one arrives, so this only bounds how
#: long a stop waits.
POLL_WAIT_S = 0.1
#: Most seconds of kv-events read back at start for liveness: the demo, the tests and the bench run with a lease
#: of a day, and a day of events decoded at every start would cost a worker minutes of CPU for marks that matter
#: only while a source's lease has not lapsed; a disconnect older than this is the lease's to settle.
HISTORY_MAX_S = 120.0
#: Seconds between looks for a kv-events topic that does not exist yet.
TOPIC_RETRY_S = 1.0


#: The kinds of a block event (the projection's ``event`` slot).
_BLOCK_KINDS = frozenset({BLOCK_STORED, BLOCK_REMOVED})


def _item(record: dict):
    """:meth:`EventsFeed._apply`'s item of a decoded ``kv_event`` record: a block event's route fields (as the
    projection reads them), any other event's record itself."""
    return block_route(record) if record["event"][0] in _BLOCK_KINDS else record


class EventsFeed:
    """Reads ``topic`` (``kv-events``) into ``index``'s fresh layer and leases (module docstring).

    Args:
        index: the index fed; its ``leases``, if set, get the sources' liveness.
        bootstrap_servers: Kafka bootstrap servers.
        topic: the ``kv-events`` topic (with the topic prefix).
        codec: reads ``kv_event`` values in either framing
            (``kafka_io.schema_registry.reader_codec("kv_event", ...)``).
        history_s: seconds of kv-events read back at start for liveness only (the lease), at most
            :data:`HISTORY_MAX_S`; 0: none.
        clear_tiers: the tiers an ``AllBlocksCleared`` removes (the workers' ``--clear-scope``; default GPU);
            None: every tier.
        consumer_factory: builds the consumer from its librdkafka settings (tests may pass their own).
    """

    def __init__(self, index: FleetIndex, bootstrap_servers: str, topic: str, codec: AvroCodec, *,
                 history_s: float = 0.0, clear_tiers: frozenset[str] | None = CLEAR_TIERS,
                 consumer_factory: Callable[[dict], Consumer] = Consumer) -> None:
        self.index, self.topic, self.clear_tiers = index, topic, clear_tiers
        self.history_s = min(history_s, HISTORY_MAX_S)
        self._decode = codec.decode
        self._project = codec.own_version_projection(ROUTE_SLOTS)
        self._consumer: Consumer | None = None
        #: partition -> the first offset whose block events apply (the end offset at start).
        self._live_from: dict[int, int] = {}
        self._look = TopicLook(topic, lambda: consumer_factory(client_config(bootstrap_servers, **{
            "group.id": f"kvstream-index-events-{uuid.uuid4().hex}", "enable.auto.commit": False,
            "enable.auto.offset.store": False, "auto.offset.reset": "latest",
            # a fetch returns as soon as one message is there: the feed's delay is the broker's, not a linger
            "fetch.wait.max.ms": 100, "fetch.min.bytes": 1, "queued.max.messages.kbytes": 65536})),
            TOPIC_RETRY_S)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: Messages read, and values that could not be decoded (logged, then skipped: the changelog has them).
        self.records = 0
        self.undecodable = 0
        #: Called after each batch with the wall time it was applied (s since the Unix epoch) and the engine
        #: timestamps (``kv_event.ts``) of its block events: what ``GET /metrics``'s freshness histogram and the
        #: bench measure (None: nobody listens).
        self.on_applied: Callable[[float, list[float]], None] | None = None

    @property
    def reading(self) -> bool:
        """True once the feed has its partitions."""
        return self._consumer is not None

    def _open(self) -> bool:
        partitions = self._look.partitions()
        if partitions is None:
            return False
        consumer = self._look.consumer
        starts = []
        try:
            since = int((time.time() - self.history_s) * 1000)
            found = consumer.offsets_for_times([TopicPartition(self.topic, p, since) for p in partitions],
                                               timeout=10) if self.history_s > 0 else []
            for partition in partitions:
                _, high = consumer.get_watermark_offsets(TopicPartition(self.topic, partition), timeout=10)
                self._live_from[partition] = high
            for tp in found:
                starts.append(TopicPartition(self.topic, tp.partition,
                                             tp.offset if tp.offset >= 0 else self._live_from[tp.partition]))
        except KafkaException as exc:
            log.warning("index: cannot read %s yet: %s", self.topic, exc)
            return False
        if not starts:
            starts = [TopicPartition(self.topic, p, OFFSET_END) for p in partitions]
        consumer = self._look.take()
        consumer.assign(starts)
        self._consumer = consumer
        log.info("index: applying %s as it arrives (%d partitions)", self.topic, len(partitions))
        return True

    def poll(self, timeout_s: float = 0.0) -> int:
        """Read what the consumer has (up to :data:`POLL_BATCH` messages, waiting at most ``timeout_s`` for the
        first) into the index; returns the messages read."""
        if self._consumer is None and not self._open():
            return 0
        messages = take_available(self._consumer, POLL_BATCH, timeout_s)
        index = self.index
        if not messages:
            with index.lock:
                index.fresh.expire()
            return 0
        items = []
        decode, project, live_from = self._decode, self._project, self._live_from
        for message in messages:
            if message.error() is not None:
                if message.error().code() != KafkaError._PARTITION_EOF:
                    log.warning("index: reading %s: %s", self.topic, message.error())
                continue
            value = message.value()
            try:
                # a block event's fields read from its bytes by the compiled projection, without the record's
                # dicts; another version's record, a source-wide event or no compiled module: decoded
                route = project(value) if project is not None else None
                item = route if route is not None and route[R_KIND] in _BLOCK_KINDS else _item(decode(value))
            except (DecodeError, ValueError, TypeError) as exc:
                self.undecodable += 1
                log.warning("index: skipped %s[%d]@%d: %s", self.topic, message.partition(), message.offset(), exc)
                continue
            # liveness goes by the producer's clock (the record's CreateTime): an event produced before a
            # disconnect but read after it, from another partition, must not bring the engine back
            _, produced = message.timestamp()
            items.append((item, message.offset() >= live_from.get(message.partition(), 0),
                          produced / 1000 if produced > 0 else None))
        self.records += len(messages)
        self._apply_items(items)
        return len(messages)

    def apply_records(self, records: list[dict], live: bool = True, now: float | None = None) -> None:
        """Apply decoded ``kv_event`` records as :meth:`poll` applies what it reads (``live`` False: liveness
        only, as the history read at start); ``now`` is the wall clock of their arrival (tests pass their own)."""
        self._apply_items([(_item(record), live, None) for record in records], now)

    def _apply_items(self, items: list[tuple], now: float | None = None) -> None:
        now = time.time() if now is None else now
        with self.index.lock:
            stamps = self._apply(items, now)
            self.index.fresh.expire()
        if stamps and self.on_applied is not None:
            self.on_applied(time.time(), stamps)

    def _apply(self, items: list[tuple], now: float) -> list[float]:
        """Apply ``(item, live, produced)`` triples: an item is a block event's
        :data:`~schemas.block_event.ROUTE_FIELDS` list or another event's decoded record; ``live`` False for the
        history read for liveness only; ``produced`` the record's Kafka timestamp (s), the clock liveness goes by
        (None: ``now``). The index's lock is held. Returns the applied block events' engine timestamps."""
        fresh, leases, clear_tiers = self.index.fresh, self.index.leases, self.clear_tiers
        stamps = []
        heard: dict[tuple[str, int], float] = {}
        for item, live, produced in items:
            at = now if produced is None else min(now, produced)
            if type(item) is list:
                source = (item[R_INSTANCE], item[R_DP_RANK])
                if at > heard.get(source, 0.0):
                    heard[source] = at
                if not live:
                    continue
                kind = item[R_KIND]
                if (item[R_WORLD_SIZE] or 1) > 1 or item[R_BLOCK_HASH] is None or item[R_TIER] is None or (
                        kind == BLOCK_REMOVED and (item[R_GROUP_IDX] or 0) > 0):
                    fresh.counters.left_to_changelog += 1  # what the event alone cannot settle
                    continue
                stored = kind != BLOCK_REMOVED
                fresh.block_event(stored, item[R_OWNERSHIP], item[R_BLOCK_HASH], item[R_INSTANCE], item[R_DP_RANK],
                                  item[R_TIER], (item[R_EPOCH], item[R_SEQ], item[R_BATCH_INDEX]),
                                  item[R_PARENT] if stored else None, item[R_CONTENT_HASH] if stored else None)
                stamps.append(item[R_TS])
                continue
            kind, body = item["event"]
            instance, rank = item["instance_id"], item["data_parallel_rank"]
            if kind == SOURCE_DISCONNECTED:
                if leases is not None:  # lifted by evidence produced after it only, in whatever order it is read
                    leases.mark_down(instance, rank, at)
                continue
            if kind == SOURCE_UNREGISTERED:
                if live:
                    fresh.retire(kind, instance, None if body["all_ranks"] else rank, None, None, item["ts"])
                continue
            if leases is not None:
                leases.heard(instance, rank, at)
            if not live:
                continue
            if (item["world_size"] or 1) > 1 and kind in (ALL_BLOCKS_CLEARED, PUBLISHER_RESTARTED):
                # its stores are the changelog's to apply (the agent's agreement rules), so are its retirements:
                # held out here, the rows it stores again after them would be missing until the hold-out ends
                fresh.counters.left_to_changelog += 1
                continue
            position = (item["publisher_epoch"], item["seq"], item["batch_index"])
            if kind == ALL_BLOCKS_CLEARED:
                fresh.retire(kind, instance, rank, clear_tiers, position, item["ts"])
            elif kind == PUBLISHER_RESTARTED:
                fresh.retire(kind, instance, rank, None, position, item["ts"])
        if leases is not None:
            for source, last in heard.items():  # once per source and batch: a lock and a dict write, not per event
                leases.heard(*source, last)
        return stamps

    def start_thread(self) -> threading.Thread:
        """Read forever in a daemon thread; :meth:`close` stops it."""
        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self.poll(POLL_WAIT_S)
                except KafkaException as exc:
                    log.warning("index: %s; retrying", exc)
                    self._stop.wait(TOPIC_RETRY_S)
                except Exception:  # noqa: BLE001 - a bug here must not stop the index's answers, only its freshness
                    log.exception("index: the kv-events feed failed on a batch; the changelog still feeds the index")
                    self._stop.wait(TOPIC_RETRY_S)
                if self._consumer is None:
                    self._stop.wait(0.05)
            close_reader(self._look, self._consumer)
            self._consumer = None
        self._thread = threading.Thread(target=loop, name="kvstream-index-events", daemon=True)
        self._thread.start()
        return self._thread

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop reading (waiting up to ``timeout_s`` for the thread) and close the consumer."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

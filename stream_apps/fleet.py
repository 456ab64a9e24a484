"""Fleet-wide views of the small tables: occupancy, ownerships and publisher status over every partition.

``tier-occupancy`` and ``sources`` are written per partition by the worker that applies it, but every worker
answers ``GET /occupancy/``, ``GET /sources/`` and the block lookups (which ask every known ownership) for the
whole fleet. :class:`FleetTables` gives each worker the whole of both: the partitions it applies come from its
own tables, as fresh as its last write; every other partition comes from the tables' changelog topics, which
:class:`ChangelogFollower` reads with a confluent-kafka consumer in a thread of its own.

Why not Faust's ``GlobalTable``: a global table's changelog runs through Faust's consumer, whose path costs
about as much per record as the agent's apply of a whole batch message, and every worker then reads its own
writes back. Both tables are written once per batch message and source, so at 10,000 events/s (bench latency
step) a worker took some 2,700 of these echoes per second against 330 batch messages, and spent about a
third of its CPU on them.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import defaultdict

import mode
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

from kafka_io.config import client_config
from schemas import AvroCodec, DecodeError

log = logging.getLogger(__name__)

#: Seconds before a :class:`ChangelogFollower` whose start failed tries again: the first wait, doubled after each
#: failure up to the second (a topic just created may not have its leader yet; a broker outage may last).
RETRY_S = (0.5, 5.0)


class ChangelogFollower:
    """Follows compacted changelog topics from their beginning and keeps each one's latest value per key.

    One daemon thread polls a confluent-kafka consumer assigned every partition of every topic (no consumer
    group offsets: it always starts from the beginning, which compaction keeps short). Values are decoded
    with the topic's codec; a tombstone deletes its key; a record the codec refuses is logged and skipped
    (the table that wrote it holds the same schema, so this means a foreign writer). If the start fails
    (a topic is missing, the broker does not answer), :attr:`error` says why and the thread starts over
    after a wait (:data:`RETRY_S`), reading everything again; meanwhile it keeps what it had read (the
    tables never delete a key, so a re-read only brings values up to date).

    Args:
        bootstrap_servers: Kafka bootstrap servers.
        codecs: changelog topic -> the ``AvroCodec`` of its values.
        group_id: the consumer's ``group.id`` (librdkafka wants one; nothing is committed under it).
    """

    def __init__(self, bootstrap_servers: str, codecs: dict[str, AvroCodec], group_id: str) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.codecs = dict(codecs)
        self.group_id = group_id
        self._rows: dict[str, dict[int, dict[str, dict]]] = {topic: defaultdict(dict) for topic in self.codecs}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._caught_up = threading.Event()
        self.error: str | None = None
        #: Records applied since the latest (re)start of the read (the catch-up's log line gives it).
        self.records = 0

    def start(self) -> None:
        """Start the thread (it reads every partition from its beginning); nothing if it runs already."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="kvstream-changelog-follower", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the thread and close its consumer (waits at most ``timeout_s``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def caught_up(self) -> bool:
        """True once every partition was read up to the end it had when the thread started."""
        return self._caught_up.is_set()

    def partition_rows(self, topic: str, skip: set[int] | frozenset = frozenset()) -> list[tuple[str, dict]]:
        """``(key, value)`` of every key of ``topic`` read so far, except the partitions in ``skip``."""
        with self._lock:
            return [item for partition, rows in self._rows[topic].items() if partition not in skip
                    for item in rows.items()]

    def _run(self) -> None:
        wait_s = RETRY_S[0]
        while not self._stop.is_set():
            try:
                self._follow()
            except Exception as exc:  # noqa: BLE001 - the worker's readiness names it, and the thread starts over
                self.error = f"{type(exc).__name__}: {exc}"
                log.warning("the changelog follower stopped (%s); starting over in %.1f s", self.error, wait_s)
                self._caught_up.clear()
                self._stop.wait(wait_s)
                wait_s = min(wait_s * 2, RETRY_S[1])

    def _follow(self) -> None:
        consumer = Consumer(client_config(self.bootstrap_servers, **{
            "group.id": self.group_id, "enable.auto.commit": False, "enable.partition.eof": False,
            "client.id": "kvstream-changelog-follower"}))
        try:
            started, self.records = time.monotonic(), 0
            ends = self._assign(consumer)
            self.error = None
            log.info("changelog follower reading %s from their beginning (%d partitions hold records)",
                     ", ".join(self.codecs), len(ends))
            while not self._stop.is_set():
                messages = consumer.consume(1000, 0.2)
                if messages:
                    self._apply(messages)
                if ends:
                    # librdkafka's position: the offset after the last record delivered (the small tables write no
                    # tombstones and no transactions, so each partition's last record survives compaction)
                    for tp in consumer.position([TopicPartition(t, p) for t, p in ends]):
                        if tp.offset >= ends[(tp.topic, tp.partition)]:
                            del ends[(tp.topic, tp.partition)]
                    if not ends:
                        self._caught_up.set()
                        log.info("changelog follower caught up: %d records in %.1f s", self.records,
                                 time.monotonic() - started)
        finally:
            consumer.close()

    def _assign(self, consumer: Consumer) -> dict[tuple[str, int], int]:
        """Assign every partition from its beginning; returns (topic, partition) -> end offset still to read."""
        assignment, ends = [], {}
        for topic in self.codecs:
            metadata = consumer.list_topics(topic, timeout=30).topics[topic]
            if metadata.error is not None:
                raise RuntimeError(f"cannot read {topic}: {metadata.error}")
            for partition in metadata.partitions:
                low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=30)
                if high > low:
                    ends[(topic, partition)] = high
                assignment.append(TopicPartition(topic, partition, OFFSET_BEGINNING))
        consumer.assign(assignment)
        if not ends:
            self._caught_up.set()
        return ends

    def _apply(self, messages: list) -> None:
        decoded = []
        for message in messages:
            error = message.error()
            if error is not None:
                if error.code() != KafkaError._PARTITION_EOF:
                    log.warning("changelog follower read error: %s", error)
                continue
            topic, partition, value = message.topic(), message.partition(), message.value()
            try:
                key = message.key().decode()
                decoded.append((topic, partition, key, None if value is None else self.codecs[topic].decode(value)))
            except (DecodeError, UnicodeDecodeError, AttributeError) as exc:
                log.warning("changelog follower skipped %s[%s]@%s: %s", topic, partition, message.offset(), exc)
        with self._lock:
            for topic, partition, key, value in decoded:
                rows = self._rows[topic][partition]
                if value is None:
                    rows.pop(key, None)
                else:
                    rows[key] = value
            self.records += len(decoded)


class ChangelogFollowerService(mode.Service):
    """Runs a :class:`ChangelogFollower` for the worker's lifetime: stops it with the Faust app, and starts it
    with the app unless it runs already (``kvstream worker`` starts it before Faust, whose services start only
    after the tables are recovered: the follower would then hold ``/ready`` back after Faust says it is ready)."""

    def __init__(self, follower: ChangelogFollower, **kwargs) -> None:
        super().__init__(**kwargs)
        self.follower = follower

    async def on_start(self) -> None:
        self.follower.start()

    async def on_stop(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.follower.stop)


class FleetTables:
    """Every partition of ``tier-occupancy`` and ``sources`` for one worker's views.

    A partition this worker applies comes from its table, as fresh as its last write; every other partition
    from a :class:`ChangelogFollower` of the two changelogs, which lags the workers that write them by their
    producer's linger and a fetch. Standby partitions come from the follower too (Faust applies a standby's
    records in batches of ``standby_buffer_size``, so its copy lags), and so does everything while the group
    rebalances or the app recovers its tables: a partition that moved away stays in the table until Faust's
    recovery ends, and one being recovered is incomplete there.

    Args:
        tables: the worker's :class:`stream_apps.tables.Tables`.
        bootstrap_servers: Kafka bootstrap servers.
        group_id: the follower consumer's ``group.id``.
    """

    def __init__(self, tables, bootstrap_servers: str, group_id: str) -> None:
        self.tier_occupancy = tables.tier_occupancy
        self.sources = tables.sources
        self.follower = ChangelogFollower(bootstrap_servers, {
            table.changelog_topic.get_topic_name(): AvroCodec(table.value_type.family)
            for table in (self.tier_occupancy, self.sources)}, group_id)

    def items(self, table) -> list[tuple[str, dict]]:
        """``(key, value)`` of every partition of ``table`` (``tier_occupancy`` or ``sources``)."""
        changelog = table.changelog_topic.get_topic_name()
        app = table.app
        if app.rebalancing or app.in_recovery or not app.tables.recovery.completed.is_set():
            return self.follower.partition_rows(changelog)
        standbys = {tp.partition for tp in app.assignor.assigned_standbys() if tp.topic == changelog}
        local = {partition: items for partition, items in table.data.items_by_partition().items()
                 if partition not in standbys}
        theirs = self.follower.partition_rows(changelog, skip=set(local))
        return [item for items in local.values() for item in items] + theirs

    def not_ready(self) -> str | None:
        """Why the fleet-wide views are not yet whole, or None (a :class:`stream_apps.health.Readiness`
        condition)."""
        if self.follower.error is not None:
            return f"cannot read the tier-occupancy and sources changelogs ({self.follower.error}); retrying"
        if not self.follower.caught_up:
            return "reading the tier-occupancy and sources changelogs (fleet-wide views)"
        return None


def occupancy_rows(fleet: FleetTables) -> list[dict]:
    """Resident blocks per (ownership, tier, instance), summed over partitions, sorted."""
    totals: dict[tuple, int] = defaultdict(int)
    for _, value in fleet.items(fleet.tier_occupancy):
        totals[(value["ownership"] or "", value["tier"], value["instance_id"])] += value["resident_blocks"]
    return [{"ownership": own or None, "tier": tier, "instance_id": inst, "resident_blocks": n}
            for (own, tier, inst), n in sorted(totals.items()) if n]


def known_ownerships(fleet: FleetTables) -> set[str | None]:
    """Ownerships with resident blocks anywhere (None = primary), from ``tier-occupancy``."""
    return {None} | {value["ownership"] for _, value in fleet.items(fleet.tier_occupancy)}


def source_rows(fleet: FleetTables, now: float | None = None) -> list[dict]:
    """One status per publisher, merged over partitions, sorted.

    Source-wide facts (epoch, restarts, stale) come from the partition copy with the newest epoch and most
    restarts; ``events_applied`` is the sum over partitions, ``last_event_ts`` and ``last_seq`` the newest.
    ``lag_s`` is ``now`` minus ``last_event_ts`` (the engine's clock against this worker's).
    """
    now = time.time() if now is None else now
    groups: dict[tuple, list[dict]] = defaultdict(list)
    # in key order, so that ties (several partitions' copies with the same epoch) resolve alike on every worker,
    # whatever order its copy of the table was filled in
    for _, status in sorted(fleet.items(fleet.sources), key=lambda item: item[0]):
        groups[(status["instance_id"], status["data_parallel_rank"], status["worker_rank"])].append(status)
    rows = []
    for _, copies in sorted(groups.items()):
        facts = max(copies, key=lambda c: (c["publisher_epoch"], c["restarts"]))
        newest = max(copies, key=lambda c: c["last_event_ts"] or 0.0)
        last_ts = newest["last_event_ts"]
        rows.append({**facts, "worker_rank": None if facts["worker_rank"] < 0 else facts["worker_rank"],
                     "events_applied": sum(c["events_applied"] for c in copies), "last_event_ts": last_ts,
                     "last_seq": newest["last_seq"], "lag_s": None if last_ts is None else round(now - last_ts, 3)})
    return rows

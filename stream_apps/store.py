"""The tables' stores: Faust's RocksDB and memory stores, extended for the materializing agent's hot path.

Faust picks a table's store class by the scheme of its store URL from a registry that the ``faust.stores``
entry point extends; ``pyproject.toml`` registers the two classes here:

- ``kvstream-rocksdb://`` -> :class:`RocksDBTableStore` (the ``residency`` table with ``--store rocksdb://``);
- ``kvstream-compact-memory://`` -> :class:`CompactMemoryTableStore` (``residency`` with ``--store memory://``);
- ``kvstream-memory://`` -> :class:`MemoryTableStore` (the small
  tables: ``clear-watermarks``, ``publisher-epochs``, ``tier-occupancy``, ``sources``).

All three add the same few methods, which the agent uses instead of ``table[key] = value``:

- :meth:`~RocksDBTableStore.entry` / :meth:`~RocksDBTableStore.lookup` read a value for the agent or a query;
- :meth:`~RocksDBTableStore.write` stores a value, where reads find it at once, and buffers its changelog
  record (same key bytes, same Avro value bytes, the partition being applied). Faust's own write sends each
  changelog record through its producer, which costs more per key than applying the event;
- :meth:`~RocksDBTableStore.produce_changelog` produces the buffered records, the latest value of each key
  written since the last call, through the worker's output producer
  (:class:`stream_apps.outputs.OutputTopics`). The checkpoint calls it first, and the worker every
  ``--changelog-interval-s`` (``--global-changelog-interval-s`` for the global tables; see below);
- :meth:`~RocksDBTableStore.persist` runs at each checkpoint (:class:`stream_apps.checkpoint.Checkpoint`),
  after every changelog record was acknowledged.

Ordering rule of the RocksDB store: the disk never runs ahead of the changelog. A written entry waits in
memory (where reads find it) until its changelog record is acknowledged; :meth:`RocksDBTableStore.persist`
then writes it, with the changelog offset it reaches, in one atomic batch per partition. A worker killed
mid-batch restarts from the disk plus whatever changelog records did arrive, and the redelivered events
redo the rest. (Writing the disk first, as Faust does, loses an update for good: the restarted worker keeps
the newer value, ignores the redelivered event as a duplicate, and the changelog never gets it.)

Why the changelog records are buffered: a key written by several messages within an interval gets one
record, the last value, as Kafka Streams' record cache does between commits. The two global tables are
written by every batch message (a count per tier and instance, an activity row per publisher) and every
worker consumes every record of their changelogs through Faust, its own writes included: per message,
that consumption cost more than applying the message's events (bench/PROFILE.md, "Latency at 10,000
events/s"). Buffered, they are written a few times per interval instead of several times per message. The
records of all tables are produced together, as one message's were before: a crash leaves the changelogs
as consistent with each other as it did. What waits longer is what only the changelogs carry: the other
workers' copies of the global tables (their fleet views) and standby replicas, by up to the interval.

On each rebalance the RocksDB store also copies the changelog of its newly assigned partitions straight
into their databases before Faust's recovery starts (:mod:`stream_apps.changelog_recovery`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict, defaultdict
from itertools import islice
from typing import TYPE_CHECKING, Any, Callable, Mapping

import faust.stores.memory
import faust.stores.rocksdb
from faust.types import TP

from schemas import AvroCodec
from stream_apps import changelog_recovery
from stream_apps.delivery_reports import DeliveryReports
from stream_apps.residency import key_partition
from stream_apps.residency.records import EntryCodec, EntryForm, entry_form
from stream_apps.store_settings import ResidencyRocksDBOptions

if TYPE_CHECKING:
    from stream_apps.outputs import OutputTopics

log = logging.getLogger(__name__)

#: Store URL scheme of each ``--store`` choice (the ``faust.stores`` entry points in pyproject.toml).
STORE_SCHEMES = {"rocksdb://": "kvstream-rocksdb://", "memory://": "kvstream-compact-memory://"}


def value_encoder(codec: AvroCodec) -> Callable[[Any], bytes]:
    """The fastest encoder of a table's values: a residency entry's :class:`EntryCodec` (the compiled record's
    writer, or the hand-written writer of the dicts, where they know the codec's schema), fastavro otherwise."""
    if codec.family == "residency":
        return EntryCodec(codec).encode
    return codec.encode


class PartitionNotHeld(LookupError):
    """A query for a key whose partition this worker does not hold as active now (not assigned here, or
    assigned and its database not open yet): the answer is unknown here, not empty. The views answer 503."""


class _BoundStore:
    """What both store classes need from the worker, given once by :meth:`bind` after the app is built."""

    outputs: OutputTopics
    codec: AvroCodec
    encode: Callable[[Any], bytes]
    decode: Callable[[bytes], Any]
    changelog: str

    #: Whether :meth:`persist` keeps the offset its partitions' changelog records reached, which only the
    #: successful delivery reports give: True, the output producer must report every record; False (the
    #: memory stores, whose changelog is their only durable copy), refusals are all it needs
    #: (:attr:`stream_apps.outputs.OutputTopics.report_successes`).
    needs_acknowledged_offsets = False

    def bind(self, outputs: OutputTopics, *, bootstrap_servers: str, cache_entries: int = 0,
             recovery_timeout_s: float = 600.0, compiled_entries: bool | None = None) -> None:
        """Give the store the output producer and the settings it needs (``kvstream worker`` options).
        ``compiled_entries``: residency entries as compiled records (True), the dicts (False), or the records where
        they are built (None; :func:`stream_apps.residency.records.entry_form`).

        Raises:
            ValueError: the store keeps its changelog's offsets and ``outputs`` reports refusals only.
        """
        if self.needs_acknowledged_offsets and not outputs.report_successes:
            raise ValueError(f"{self.table.name}: this store persists its changelog's offsets, which the output "
                             "producer only learns from every record's delivery report (report_successes=True)")
        self.outputs = outputs
        self.codec = AvroCodec(self.table.value_type.family)
        if self.codec.family == "residency":
            entries = EntryCodec(self.codec, compiled=compiled_entries)
            self.encode, self.decode = entries.encode, entries.decode
        else:
            entries = None
            self.encode, self.decode = self.codec.encode, self.codec.decode
        #: The form of the entries this store holds, and the rules that take it (the agent applies with them).
        self.entry_form: EntryForm = entry_form(entries is not None and entries.compiled)
        self.changelog = self.table.changelog_topic.get_topic_name()
        self.bootstrap_servers = bootstrap_servers
        self.cache_entries = cache_entries
        self.recovery_timeout_s = recovery_timeout_s
        #: Changelog records written and not yet produced: (partition, key) -> the key's latest value, in
        #: the form :meth:`_changelog_value` turns into the record's bytes (None: a tombstone).
        self._unproduced: dict[tuple[int, str], Any] = {}
        #: Changelog records produced, in all (``kvstream_changelog_records_total``).
        self.changelog_records = 0
        #: The delivery reports of this store's changelog records, per partition (:meth:`acknowledged_offsets`).
        self._reports = self._changelog_delivery = DeliveryReports()

    def holds(self, partition: int) -> bool:
        """Whether this store can answer a lookup of ``partition`` now. The memory stores always can (what
        they do not hold is not assigned here, which the caller checks with Faust's assignor)."""
        return True

    def acknowledged_offsets(self) -> dict[int, int]:
        """Partition -> offset of the last changelog record acknowledged since the previous call (what a
        checkpoint persists); empty where the output producer reports refusals only.

        Raises:
            RuntimeError: the broker refused a changelog record since; every later call raises too (the worker
                must stop, and a restart reads the messages again).
        """
        refused = self._reports.refused()
        if refused:
            raise RuntimeError(f"{self.changelog}: {len(refused)} changelog records refused by the broker, first: "
                               f"{refused[0]}")
        return self._reports.take_offsets()

    #: Whether the buffered values are the records' value bytes already (:meth:`_changelog_value` is the identity).
    buffers_bytes = True

    def _changelog_value(self, value: Any) -> bytes | None:
        """The changelog record's value bytes of a buffered value (these stores buffer the bytes)."""
        return value

    #: Partition -> delivery callback of this store's changelog records to it (None: the output producer's own
    #: for every partition). :meth:`bind` gives every store its own (:class:`DeliveryReports`).
    _changelog_delivery: Mapping[int, Callable] | None = None
    #: Called with (key, buffered value) for each changelog record, just before it is produced: a topic that
    #: mirrors the table gets the same records, each key's latest value once per :meth:`produce_changelog`
    #: (``tier-occupancy`` -> ``kv-tier-occupancy``, :meth:`stream_apps.outputs.OutputTopics.occupancy`). None:
    #: no mirror.
    mirror: Callable[[str, Any], None] | None = None

    def produce_changelog(self) -> int:
        """Produce one changelog record per key written since the last call, with its latest value, to the
        partition it was written for; returns how many. Nothing waits for the broker: the checkpoint's flush
        does (:class:`stream_apps.checkpoint.Checkpoint`).

        Raises:
            Exception: a value could not be encoded, or librdkafka refused to enqueue a record (e.g. too
                large). That record and the ones after it stay buffered: a RocksDB store then refuses to
                persist, and nothing written is dropped unseen.
        """
        unproduced = self._unproduced
        if not unproduced:
            return 0
        self._unproduced = {}
        outputs, changelog, delivery = self.outputs, self.changelog, self._changelog_delivery
        # librdkafka's produce itself, positional, and no call per record for a value buffered as its bytes:
        # this runs once per key written (about once per event for the residency table). outputs.produce only
        # when librdkafka's queue is full (it waits for room).
        enqueue = outputs.producer.produce
        value_bytes = None if self.buffers_bytes else self._changelog_value
        mirror = self.mirror
        produced = 0
        try:
            for (partition, key), value in unproduced.items():
                if mirror is not None:  # first: a record it fails on stays buffered, changelog record included
                    mirror(key, value)
                if value_bytes is not None:
                    value = value_bytes(value)
                callback = None if delivery is None else delivery[partition]
                try:
                    enqueue(changelog, value, key.encode(), partition, callback)
                except BufferError:
                    outputs.produce(changelog, key.encode(), value, partition, callback)
                produced += 1
        except BaseException:
            left = dict(islice(unproduced.items(), produced, None))
            left.update(self._unproduced)
            self._unproduced = left
            raise
        finally:
            self.changelog_records += produced
        return produced


class _EntryCache:
    """The decoded-entry cache both residency stores keep in front of their encoded entries."""

    _cache: OrderedDict[str, dict | None]
    cache_entries: int

    def _remember(self, key: str, entry: dict | None) -> None:
        """Put ``entry`` (None: known absent) under ``key`` as the most recent; evict the least recent."""
        cache = self._cache
        cache[key] = entry
        cache.move_to_end(key)
        if len(cache) > self.cache_entries:
            cache.popitem(last=False)

    def forget_cache(self) -> None:
        """Drop the decoded entries (partitions were revoked or assigned: another worker may have written
        their keys). Entries waiting for their changelog acknowledgement, if any, stay."""
        self._cache.clear()


class MemoryTableStore(_BoundStore, faust.stores.memory.Store):
    """Faust's memory store whose writes produce their changelog records through the output producer.

    Values are the decoded dicts. The key -> partition map is Faust's own (it drops a revoked partition's
    keys by it); this class keeps it current on every write. The ``residency`` table uses
    :class:`CompactMemoryTableStore` instead.

    :attr:`written_at` keeps, per key, the wall-clock time its value was last written by a worker: this one's
    clock at :meth:`write`, or the timestamp of the changelog record it was read from (the writing worker's clock
    when it produced the record, at most ``--changelog-interval-s`` after the write, or
    ``--global-changelog-interval-s`` for a global table), so a restarted worker knows it too. ``GET /sources/``
    measures each publisher's arrival lag by it.
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        #: Key -> seconds since the Unix epoch when a worker last wrote its value.
        self.written_at: dict[str, float] = {}

    def _create_batch_iterator(self, mark_as_delete, to_key, to_value, batch):
        """Faust's changelog apply (one item per record, in order), each key's record timestamp kept in
        :attr:`written_at`."""
        batch = list(batch)
        written_at = self.written_at
        for event, item in zip(batch, super()._create_batch_iterator(mark_as_delete, to_key, to_value, batch)):
            if event.message.value is None:
                written_at.pop(item[0], None)
            else:
                written_at[item[0]] = event.message.timestamp or time.time()
            yield item

    def apply_changelog_batch(self, batch, to_key, to_value) -> None:
        """Faust's apply of changelog records, except for a global table outside recovery: there the records of
        the partitions this worker applies itself are echoes of its own writes, possibly older than what the
        agent has written since, and are skipped. The other workers' partitions (standbys to this worker) are
        applied as they arrive, so every worker holds the whole table."""
        if self.table.is_global and not self.app.in_recovery:
            is_standby = self.app.assignor.is_standby
            batch = [event for event in batch if is_standby(TP(self.changelog, event.message.partition))]
            if not batch:
                return
        super().apply_changelog_batch(batch, to_key, to_value)

    def entry(self, partition: int, key: str) -> dict | None:
        """The value under ``key`` (the agent applying ``partition``)."""
        return self.data.get(key)

    def lookup(self, key: str, partition: int) -> dict | None:
        """The value under ``key`` for a query (``partition``: the key's)."""
        return self.data.get(key)

    def write(self, partition: int, key: str, value: dict | None) -> None:
        """Store ``value`` (None: delete) and buffer its changelog record to ``partition``
        (:meth:`produce_changelog` encodes the key's value as it is then)."""
        if value is None:
            self.data.pop(key, None)
            self.written_at.pop(key, None)
        else:
            self.data[key] = value
            self.written_at[key] = time.time()
        self._key_partition[key] = partition
        self._unproduced[(partition, key)] = value

    #: Values are buffered as dicts (:meth:`_changelog_value` encodes them).
    buffers_bytes = False

    def _changelog_value(self, value: dict | None) -> bytes | None:
        """These values are buffered as dicts: encoded once per record produced, not once per write."""
        return None if value is None else self.encode(value)

    def persist(self) -> None:
        """Nothing to persist, the changelog is this store's only durable copy: only checks that the broker
        refused none of its records (:meth:`acknowledged_offsets` raises then)."""
        self.acknowledged_offsets()

    def partition_keys(self, partition: int) -> list[str]:
        """Keys of ``partition`` held here (a scan, for rare source-wide events)."""
        return [key for key, p in list(self._key_partition.items()) if p == partition and key in self.data]

    def forget_cache(self) -> None:
        """No cache to drop."""


class CompactMemoryTableStore(_EntryCache, MemoryTableStore):
    """The memory store of the ``residency`` table (``--store memory://``): each entry held as the Avro bytes of
    its changelog record, with a cache of decoded entries in front (``--residency-cache``).

    A decoded entry is five Python containers per row (about 1,200 bytes); its Avro bytes are about 75, so a
    resident row costs about 220 bytes here (key, bytes object, the dict's slot; bench/PROFILE.md). The bytes
    are encoded at every write anyway, for the changelog. A key's partition is its murmur2 partition
    (:func:`stream_apps.residency.key_partition`), computed when needed rather than kept per key.
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        #: Key -> decoded entry (None: known absent), least recently used first, as RocksDBTableStore's.
        self._cache: OrderedDict[str, dict | None] = OrderedDict()

    def _create_batch_iterator(self, mark_as_delete, to_key, to_value, batch):
        """Recovery: the changelog records' bytes as they are (Faust's decoded value is not kept)."""
        for event in batch:
            value = event.message.value
            if value is None:
                mark_as_delete(to_key(event.key))
            yield to_key(event.key), value

    def apply_changelog_batch(self, batch, to_key, to_value) -> None:
        """Faust's apply of changelog records; afterwards the cache may be older than the data, so it goes."""
        faust.stores.memory.Store.apply_changelog_batch(self, batch, to_key, to_value)
        self._cache.clear()

    def _partition_of(self, key: str) -> int:
        return key_partition(key, self.table.partitions)

    def entry(self, partition: int, key: str) -> dict | None:
        """The entry under ``key`` for the agent applying ``partition`` (remembered in the cache)."""
        cache = self._cache
        if key in cache:
            cache.move_to_end(key)
            return cache[key]
        raw = self.data.get(key)
        entry = None if raw is None else self.decode(raw)
        self._remember(key, entry)
        return entry

    def lookup(self, key: str, partition: int) -> dict | None:
        """The entry under ``key`` for a query (does not fill the cache)."""
        if key in self._cache:
            return self._cache[key]
        raw = self.data.get(key)
        return None if raw is None else self.decode(raw)

    def write(self, partition: int, key: str, value: dict | None) -> None:
        """Store ``value`` (None: delete) as its Avro bytes and buffer them as its changelog record to
        ``partition``."""
        encoded = None if value is None else self.encode(value)
        if encoded is None:
            self.data.pop(key, None)
        else:
            self.data[key] = encoded
        self._remember(key, value)
        self._unproduced[(partition, key)] = encoded

    #: Buffered as the bytes it stores (its parent, :class:`MemoryTableStore`, buffers dicts).
    buffers_bytes = True

    def _changelog_value(self, value: bytes | None) -> bytes | None:
        """Buffered as the bytes it stores: already encoded."""
        return value

    def partition_keys(self, partition: int) -> list[str]:
        """Keys of ``partition`` held here (a scan computing each key's partition, for rare source-wide events)."""
        partition_of = self._partition_of
        return [key for key in list(self.data) if partition_of(key) == partition]

    async def on_recovery_completed(self, active_tps, standby_tps) -> None:
        """Drop the keys of partitions this worker no longer holds (Faust does it by its per-key map)."""
        active = {tp.partition for tp in active_tps}
        partition_of = self._partition_of
        for key in [key for key in self.data if partition_of(key) not in active]:
            del self.data[key]
        self._cache.clear()


class RocksDBTableStore(_EntryCache, _BoundStore, faust.stores.rocksdb.Store):
    """Faust's RocksDB store with an entry cache, changelog-acknowledged writes and a fast changelog copy.

    Written through its partitions' databases, not Faust's ``_set``/``_del``, which remember every key ever
    written in a Python dict (``_key_index``), which grows with the table.
    """

    #: A restarted worker reads each partition's changelog from the offset its last persist wrote.
    needs_acknowledged_offsets = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Faust's options class ignores the memtable filter of the table's options (store_settings)
        self.rocksdb_options = ResidencyRocksDBOptions(**self.options, use_rocksdict=self.use_rocksdict)
        #: Key -> decoded entry (None: known absent), least recently used first. An OrderedDict: evicting
        #: a plain dict's oldest key scans the slots its earlier deletions left at the front, while
        #: ``popitem(last=False)`` is O(1).
        self._cache: OrderedDict[str, dict | None] = OrderedDict()
        #: Partition -> key -> (entry or None, Avro bytes or None): written, not yet acknowledged nor on disk.
        self._pending: dict[int, dict[str, tuple[dict | None, bytes | None]]] = defaultdict(dict)
        #: Changelog records copied into the databases at rebalances, and the seconds it took (for the metrics).
        self.recovered_records = 0
        self.recovered_seconds = 0.0

    def entry(self, partition: int, key: str) -> dict | None:
        """The entry under ``key`` for the agent applying ``partition`` (remembered in the cache)."""
        pending = self._pending[partition].get(key)
        if pending is not None:
            return pending[0]
        cache = self._cache
        if key in cache:
            return cache[key]
        raw = self._db_for_partition(partition).get(key.encode())
        if raw is None:  # not remembered: most absent keys are about to be written, which remembers them
            return None
        entry = self.decode(raw)
        self._remember(key, entry)
        return entry

    def holds(self, partition: int) -> bool:
        """Whether ``partition``'s database is open here. Faust opens it in the rebalance after the assignment
        that names this worker (and keeps retrying a database another process still locks), so the
        assignor can say a partition is this worker's before its database is there."""
        return partition in self._dbs

    def lookup(self, key: str, partition: int) -> dict | None:
        """The entry under ``key`` for a query, if this worker holds ``partition``.

        Never fills the cache: a query can come while a partition is still being recovered (Faust writes
        recovered entries to the databases directly).
        """
        pending = self._pending[partition].get(key)
        if pending is not None:
            return pending[0]
        if key in self._cache:
            return self._cache[key]
        db = self._dbs.get(partition)
        raw = None if db is None else db.get(key.encode())
        return None if raw is None else self.decode(raw)

    def write(self, partition: int, key: str, entry: dict | None) -> None:
        """Buffer ``entry``'s changelog record (None: a tombstone) to ``partition``; it reaches the disk at
        the first :meth:`persist` after the record is produced and acknowledged."""
        value = None if entry is None else self.encode(entry)
        self._pending[partition][key] = (entry, value)
        self._remember(key, entry)
        self._unproduced[(partition, key)] = value

    def persist(self) -> None:
        """Write the pending entries and the changelog offset they reach, atomically per partition.

        Call only after :meth:`produce_changelog` and a flush that acknowledged every changelog record
        (:class:`stream_apps.checkpoint.Checkpoint`).

        Raises:
            RuntimeError: changelog records are still buffered (the disk would run ahead of the changelog), or
                the broker refused one (then nothing is written, and every later persist refuses too: the
                worker must stop).
        """
        from rocksdict import WriteBatch

        if self._unproduced:
            raise RuntimeError(f"{self.changelog}: persist() with {len(self._unproduced)} changelog records not "
                               "produced")
        acked = self.acknowledged_offsets()

        for partition, entries in self._pending.items():
            if not entries:
                continue
            batch = WriteBatch(raw_mode=True)
            for key, (_, value) in entries.items():
                if value is None:
                    batch.delete(key.encode())
                else:
                    batch.put(key.encode(), value)
            if partition in acked:
                batch.put(self.offset_key, str(acked.pop(partition)).encode())
            self._db_for_partition(partition).write(batch)
            entries.clear()

    def partition_keys(self, partition: int) -> list[str]:
        """Keys of ``partition``: on disk and pending (a scan, for rare source-wide events)."""
        on_disk = [raw.decode() for raw in self._db_for_partition(partition).keys() if raw != self.offset_key]
        return list(dict.fromkeys([*on_disk, *self._pending[partition]]))

    async def on_rebalance(self, assigned, revoked, newly_assigned, generation_id: int = 0) -> None:
        """Faust's rebalance (opens the newly assigned partitions' databases), then the changelog copy into
        them (:func:`stream_apps.changelog_recovery.fill_from_changelog`), before Faust's recovery reads
        their persisted offsets."""
        await super().on_rebalance(assigned, revoked, newly_assigned, generation_id)
        standbys = self.app.assignor.assigned_standbys()
        partitions = sorted(tp.partition for tp in newly_assigned
                            if tp.topic == self.changelog and tp not in standbys)
        # a database the store could not open (locked, and the group moved on) stays with Faust's recovery
        dbs = {p: self._dbs[p] for p in partitions if p in self._dbs}
        if not dbs:
            return
        stop = threading.Event()
        try:
            result = await asyncio.get_running_loop().run_in_executor(None, lambda: (
                changelog_recovery.fill_from_changelog(self.bootstrap_servers, self.changelog, dbs, self.offset_key,
                                                       timeout_s=self.recovery_timeout_s, stop=stop)))
        except asyncio.CancelledError:
            stop.set()
            raise
        self.recovered_records += result.records
        self.recovered_seconds += result.seconds
        log.info("changelog recovery of %s: %d records from %d partitions %s in %.1f s (%.0f records/s)",
                 self.changelog, result.records, result.partitions, sorted(dbs), result.seconds,
                 result.records_per_s)
        if result.seconds > self.app.conf.broker_session_timeout:
            log.warning("changelog recovery took %.1f s, longer than the consumer session timeout (%.0f s, "
                        "BROKER_SESSION_TIMEOUT): the group expels this worker and rebalances once more",
                        result.seconds, self.app.conf.broker_session_timeout)

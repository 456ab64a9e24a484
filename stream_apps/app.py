"""The Faust stream app: kv-events -> residency tables, with HTTP lookups.

Topology (DESIGN.md "Data flow"), one module so ``faust -A stream_apps.app
worker`` finds everything:

1. The repartition stage (:mod:`stream_apps.repartition`, a confluent-kafka
   consumer loop in a child process of the worker, consumer group
   ``<app id>-repartition``): re-keys every event of ``kv-events`` by
   ``<ownership or primary>/<block hash hex>`` into
   ``<app id>-kv-events-by-ownership``, so each ownership has its own key space
   while the load stays spread over every partition. Events are forwarded in
   batches, one ``ownership_batch`` message per destination partition (the
   partition Kafka's murmur2 gives each key), each event stamped with its
   source's latest ``AllBlocksCleared`` before it on its upstream partition
   (``clear_mark``), because after re-keying a clear's copy and a block's
   events can arrive in either order. It runs outside Faust because Faust
   spends about 70 µs per consumed message, and every block event is a message.
2. ``materialize_residency`` (Faust agent on the re-keyed topic, consumer
   group ``<app id>``): applies each event to the ``residency`` table
   (changelog-backed; each touched key written once per batch message, see
   :class:`_ResidencyStore`) with
   :mod:`stream_apps.residency`, aggregating the reports of a source's workers
   inside each row; keeps ``tier-occupancy`` (a global table of resident
   blocks per partition, ownership, tier and instance) in step; applies the
   bridge's ``PublisherRestarted`` (epoch retirement) and ``SourceStale`` to
   the ``sources`` table; publishes every residency transition to
   ``kv-residency-changes`` and occupancy to ``kv-tier-occupancy``.
3. HTTP views on the Faust web server: ``GET /residency/{block_hash_hex}/``,
   ``POST /prefix-match/``, ``GET /occupancy/``, ``GET /sources/``,
   ``GET /stats/``. A lookup of a key held by another worker is forwarded to
   that worker.

Records that cannot be decoded or applied go to ``kv-events-dead-letter`` with
the reason in the ``kvstream-error`` header and the original bytes as the value.

Configuration comes from the environment (``kvstream worker`` sets it from its
options): ``KVSTREAM_BOOTSTRAP_SERVERS``, ``KVSTREAM_PARTITIONS``,
``KVSTREAM_DATA_DIR``, ``KVSTREAM_STORE`` (``memory://`` or ``rocksdb://``),
``KVSTREAM_WEB_PORT``, ``KVSTREAM_WEB_BIND``, ``KVSTREAM_WEB_HOST`` (the host
other workers reach this one at), ``KVSTREAM_CLEAR_SCOPE`` (``gpu`` or ``all``,
per instance with ``INSTANCE=all``), ``KVSTREAM_AGGREGATION``
(``INSTANCE=WORLD_SIZE[:MODE]``), ``KVSTREAM_APP_ID``.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import time
import types
from collections import OrderedDict, defaultdict
from urllib.parse import quote

import aiohttp
import faust
import faust.stores.memory
import mode
from faust.serializers import codecs

from schemas import (ALL_BLOCKS_CLEARED, SOURCE_STALE, SOURCE_WIDE_EVENTS, AvroCodec, DecodeError,
                     InvalidBlockHash, parse_hex_block_hash)
from schemas.codec import ResidencyChangeWriter, ResidencyWriter
from schemas.topics import (KV_EVENTS, KV_EVENTS_DEAD_LETTER, KV_RESIDENCY_CHANGES, KV_TIER_OCCUPANCY,
                           by_ownership_topic)
from stream_apps.residency import (NO_CLEAR, PRIMARY, ApplyStats, SourceSettings, apply_block_event,
                                   apply_clear, key_partition, parse_tier_weights, prefix_match,
                                   residency_key, retire_epoch)
from stream_apps.repartition import RepartitionProcess, source_clears_topic
from stream_apps.store_settings import residency_rocksdb_options
from stream_apps import changelog_recovery

log = logging.getLogger(__name__)

BOOTSTRAP_SERVERS = os.environ.get("KVSTREAM_BOOTSTRAP_SERVERS", "127.0.0.1:9092")
PARTITIONS = int(os.environ.get("KVSTREAM_PARTITIONS", "8"))
#: Clear scopes and aggregation per source (``kvstream worker --clear-scope/--aggregation``).
SOURCES = SourceSettings.parse(os.environ.get("KVSTREAM_CLEAR_SCOPE", "gpu"), os.environ.get("KVSTREAM_AGGREGATION", ""))
ERROR_HEADER = "kvstream-error"
#: Stage 1 reads up to this many events, or what arrived within REPARTITION_WITHIN_S, per batch.
REPARTITION_BATCH = int(os.environ.get("KVSTREAM_REPARTITION_BATCH", "10000"))
REPARTITION_WITHIN_S = float(os.environ.get("KVSTREAM_REPARTITION_WITHIN_S", "0.1"))
#: Tier weights of POST /prefix-match/ (``GPU=1.0,CPU=0.8,STORAGE=0.5``; other tiers 0.25).
TIER_WEIGHTS = parse_tier_weights(os.environ.get("KVSTREAM_TIER_WEIGHTS", ""))
#: Limits of POST /prefix-match/: request body bytes and block hashes per request.
MAX_REQUEST_BYTES = 256 * 1024
MAX_PREFIX_BLOCKS = 2048


class _AvroFaustCodec(codecs.Codec):
    """Faust codec over :class:`schemas.codec.AvroCodec` (single-object framing)."""

    def __init__(self, family: str) -> None:
        super().__init__(family=family)
        self._avro = AvroCodec(family)

    def _dumps(self, obj) -> bytes:
        return self._avro.encode(obj)

    def _loads(self, data: bytes):
        return self._avro.decode(data)


#: Faust codec name -> codec of the tables' values.
TABLE_CODECS = {"kv_residency": _AvroFaustCodec("residency"), "kv_clear_watermark": _AvroFaustCodec("clear_watermark"),
                "kv_tier_occupancy": _AvroFaustCodec("tier_occupancy"),
                "kv_source_status": _AvroFaustCodec("source_status")}
for _name, _codec in TABLE_CODECS.items():
    codecs.register(_name, _codec)

def _broker_credentials():
    """Faust credentials from the security environment (kafka_io.config.SECURITY_ENVIRONMENT)."""
    from kafka_io.config import aiokafka_security

    settings = aiokafka_security()
    protocol = settings.get("security_protocol", "PLAINTEXT")
    if protocol.startswith("SASL"):
        return faust.SASLCredentials(username=settings["sasl_plain_username"],
                                     password=settings["sasl_plain_password"], mechanism=settings["sasl_mechanism"],
                                     ssl_context=settings.get("ssl_context"))
    if protocol == "SSL":
        return faust.SSLCredentials(settings["ssl_context"])
    return None


app = faust.App(
    os.environ.get("KVSTREAM_APP_ID", "kvstream"),
    broker=[f"kafka://{server}" for server in BOOTSTRAP_SERVERS.split(",")],
    store=os.environ.get("KVSTREAM_STORE", "memory://"),
    datadir=os.environ.get("KVSTREAM_DATA_DIR", ".kvstream/worker"),
    topic_partitions=PARTITIONS,
    processing_guarantee="at_least_once",
    consumer_auto_offset_reset="earliest",
    web_port=int(os.environ.get("KVSTREAM_WEB_PORT", "6066")),
    web_bind=os.environ.get("KVSTREAM_WEB_BIND", "127.0.0.1"),
    web_host=os.environ.get("KVSTREAM_WEB_HOST", "127.0.0.1"),
    key_serializer="raw",
    value_serializer="raw",
    broker_credentials=_broker_credentials(),
    # No standby replicas. A partition that moved away and back came back with rows missing in the chaos
    # rebalance scenario (twice in about ten runs); with standbys off, a partition a worker gets is
    # recovered from its changelog (RocksDB: from the offset on disk), and the scenario has not failed since.
    table_standby_replicas=int(os.environ.get("KVSTREAM_STANDBY_REPLICAS", "0")),
)

kv_events_by_ownership = app.topic(by_ownership_topic(app.conf.id), key_type=bytes, value_type=bytes,
                                   partitions=PARTITIONS, internal=True)
dead_letter = app.topic(KV_EVENTS_DEAD_LETTER, key_type=bytes, value_type=bytes, partitions=1, internal=True)


class _TableType:
    """Key or value type of a table, as Faust 0.15 wants it.

    Faust takes a table's key and value serializers from its key and value
    types' ``_options.serializer`` (defaulting to json) and rebuilds values read
    from the changelog with ``type.from_data``. These types name our codecs and
    hand plain values through: string keys as raw UTF-8 (so Faust's router hashes
    the same bytes as :func:`partition_of`), values as Avro records (dicts).
    """

    def __init__(self, serializer: str, decode=lambda data: data) -> None:
        self._options = types.SimpleNamespace(serializer=serializer)
        self._decode = decode

    def from_data(self, data, preferred_type=None):
        return self._decode(data)


_STR_KEY = _TableType("raw", decode=lambda data: data.decode() if isinstance(data, bytes) else data)


#: The in-memory store for the small tables. Not plain ``memory://``: Faust picks a table's own store with
#: ``table._store or app.conf.store``, and yarl's URL('memory://') is falsy (no host, no path).
SMALL_TABLE_STORE = "memory://local"


def _avro_table(name: str, codec_name: str, help: str, table=None, store: str | None = SMALL_TABLE_STORE,
                options: dict | None = None):
    """A table with UTF-8 string keys and Avro values (DESIGN.md: the codec on every table, read path included).

    ``store``: the small tables (per source or per partition) stay in memory and are rebuilt from their
    changelogs at start; only ``residency`` (one row per block) takes the configured store (``None``).
    ``options``: the store's options (RocksDB settings, :mod:`stream_apps.store_settings`).
    """
    factory = table or app.Table
    return factory(name, key_type=_STR_KEY, value_type=_TableType(codec_name), partitions=PARTITIONS, help=help,
                   store=store, options=options)


#: '<ownership or primary>/<block hash hex>' -> ResidencyEntry (schemas/residency_v1.avsc).
residency = _avro_table("residency", "kv_residency",
                        "Where each block of each ownership is resident, one row per residency identity.", store=None,
                        options=residency_rocksdb_options())
# RocksDB partitions newly assigned to this worker are filled straight from the changelog before Faust's own
# recovery (about 5,000 records/s) starts: stream_apps/changelog_recovery.py.
changelog_recovery.install(app, residency, BOOTSTRAP_SERVERS)
#: '<by-ownership partition>/<instance>/<dp rank>' -> latest clear applied on that partition.
clear_watermarks = _avro_table("clear-watermarks", "kv_clear_watermark",
                               "Latest AllBlocksCleared applied per source and partition.")
#: '<partition>/<ownership or primary>/<tier>/<instance>' -> resident blocks (global: every worker sees all).
tier_occupancy = _avro_table("tier-occupancy", "kv_tier_occupancy",
                             "Resident blocks per partition, ownership, tier, instance.", table=app.GlobalTable)

#: '<partition>/<instance>/<dp rank>/<worker rank or -1>' -> SourceStatus (global: any worker answers /sources/).
sources = _avro_table("sources", "kv_source_status", "Epoch and staleness per publisher, from the bridge's events.",
                      table=app.GlobalTable)
#: '<by-ownership partition>/<instance>/<dp rank>/<worker rank or -1>' -> latest PublisherRestarted applied there.
publisher_epochs = _avro_table("publisher-epochs", "kv_clear_watermark",
                               "Latest publisher epoch started per publisher and partition.")

event_codec = AvroCodec("kv_event")
batch_codec = AvroCodec("ownership_batch")
change_codec = AvroCodec("residency_change")
occupancy_codec = AvroCodec("tier_occupancy")


def _hand_written(writer_class, codec: AvroCodec):
    """``writer_class(codec)``, the hand-written encoder of a stage-2 hot-path record (schemas.codec), or None
    when it refuses the codec's writer schema (a new version): then fastavro writes it, more slowly."""
    try:
        return writer_class(codec)
    except ValueError as exc:
        log.warning("%s; writing %s records with fastavro (slower)", exc, codec.family)
        return None


#: The arguments of :meth:`ResidencyChangeWriter.change`: residency_change v1's fields, in order.
_CHANGE_FIELDS = ("block_hash", "ownership", "instance_id", "data_parallel_rank", "tier", "medium", "locality",
                  "group_idx", "resident", "copies", "ts", "cause")


def _change_record(*fields) -> bytes:
    """:meth:`ResidencyChangeWriter.change` done by fastavro (a residency_change schema it does not encode)."""
    return change_codec.encode(dict(zip(_CHANGE_FIELDS, fields)))


#: Encodes a residency_change from its fields in the schema's order.
_encode_change = getattr(_hand_written(ResidencyChangeWriter, change_codec), "change", _change_record)


class _OutputTopics:
    """Stage 2's outputs, written with confluent-kafka: the analytics topics kv-residency-changes and
    kv-tier-occupancy, and the tables' changelog records (:class:`_ResidencyStore`, :func:`write_small_table`).

    A Faust send costs about as much as processing ten events; librdkafka enqueues in about a
    microsecond. Outputs are flushed when Faust is about to commit offsets (:class:`_CommitGate`) and
    when partitions are revoked, so every output of an acknowledged message is on the broker before that
    message's offset is committed: at least once, like Faust's own table writes.
    """

    def __init__(self) -> None:
        self._producer = None
        #: Outputs the broker refused (after librdkafka's retries): "topic[partition]: error".
        self.delivery_errors: list[str] = []

    @property
    def producer(self):
        if self._producer is None:
            from confluent_kafka import Producer

            from kafka_io.config import producer_config
            self._producer = Producer(producer_config(BOOTSTRAP_SERVERS, on_delivery=self.on_delivery))
        return self._producer

    def on_delivery(self, error, message) -> None:
        """Delivery report of one output: remembers a failure, which :meth:`flush` then raises."""
        if error is not None:
            self.delivery_errors.append(f"{message.topic()}[{message.partition()}]: {error}")

    def change(self, block_hash: bytes, ownership: str | None, instance_id: str, data_parallel_rank: int,
               tier: str, medium: str | None, locality: str | None, group_idx: int | None, resident: bool,
               copies: int, ts: float, cause: str) -> None:
        """One kv-residency-changes record, from the residency_change fields in the schema's order."""
        self.produce(KV_RESIDENCY_CHANGES, block_hash, _encode_change(
            block_hash, ownership, instance_id, data_parallel_rank, tier, medium, locality, group_idx, resident,
            copies, ts, cause))

    def occupancy(self, key: str, value: dict) -> None:
        self.produce(KV_TIER_OCCUPANCY, key.encode(), occupancy_codec.encode(value))

    def produce(self, topic: str, key: bytes, value: bytes | None, partition: int | None = None,
                on_delivery=None) -> None:
        """Enqueue one record (``partition`` None: the key's murmur2 partition); waits while the queue is full."""
        extra = {} if partition is None else {"partition": partition}
        if on_delivery is not None:
            extra["on_delivery"] = on_delivery
        while True:
            try:
                self.producer.produce(topic, key=key, value=value, **extra)
                return
            except BufferError:
                self.producer.poll(0.05)

    def flush(self) -> None:
        """Wait until every output is acknowledged.

        Raises:
            RuntimeError: outputs still unacknowledged after 60 s, or refused by the broker (the worker must
                not commit the offsets of the messages that made them).
        """
        if self._producer is not None and self._producer.flush(60):
            raise RuntimeError("stage-2 outputs (changelogs, kv-residency-changes, kv-tier-occupancy) not "
                               "acknowledged within 60 s")
        if self.delivery_errors:
            errors, self.delivery_errors = self.delivery_errors, []
            raise RuntimeError(f"{len(errors)} stage-2 outputs refused by the broker, first: {errors[0]}")


outputs = _OutputTopics()


def _warn_on_long_gc_pauses(threshold_s: float = 0.2) -> None:
    """Log a warning when a full (generation 2) collection of Python's cyclic GC stops the worker for longer
    than ``threshold_s``: it scans every object the worker holds, a memory store's rows included."""
    started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        elif info["generation"] == 2:
            paused = time.perf_counter() - started[0]
            if paused > threshold_s:
                log.warning("a full Python GC stopped the worker for %.2f s (%d objects freed)", paused,
                            info["collected"])

    gc.callbacks.append(on_gc)


_warn_on_long_gc_pauses()
stats = ApplyStats()
#: This worker's event counters, served by /stats/.
counters: dict[str, int] = {"materialized": 0, "dead_lettered": 0}


def _mark_of(watermark: dict | None) -> tuple[int, int, int]:
    """Position (epoch, seq, batch_index) of a ClearWatermark or ClearMark record; NO_CLEAR for None."""
    if watermark is None:
        return NO_CLEAR
    return watermark["publisher_epoch"], watermark["seq"], watermark["batch_index"]


def _watermark(record: dict) -> dict:
    return {"instance_id": record["instance_id"], "data_parallel_rank": record["data_parallel_rank"],
            "publisher_epoch": record["publisher_epoch"], "seq": record["seq"], "batch_index": record["batch_index"]}


async def _dead_letter(event: faust.EventT, reason: str, key: bytes | None = None, value: bytes | None = None) -> None:
    """Send the event's original bytes (or the given part of it) to the dead-letter topic with the reason."""
    counters["dead_lettered"] += 1
    log.warning("dead-lettering %s[%s]@%s: %s", event.message.topic, event.message.partition,
                event.message.offset, reason)
    await dead_letter.send(key=event.message.key if key is None else key,
                           value=event.message.value if value is None else value, force=True,
                           headers={ERROR_HEADER: reason.encode()[:1000],
                                    "kvstream-source": f"{event.message.topic}/{event.message.partition}/"
                                                       f"{event.message.offset}".encode()})


class _RepartitionStage(mode.Service):
    """Runs stage 1 (:class:`stream_apps.repartition.RepartitionProcess`) in a child process for the worker's
    lifetime.

    If the stage dies (e.g. the broker refuses its outputs), the worker crashes, so that a supervisor restarts
    it and the unacknowledged batch is read again.
    """

    stage: RepartitionProcess | None = None

    async def on_start(self) -> None:
        _RepartitionStage.stage = RepartitionProcess(BOOTSTRAP_SERVERS, app.conf.id, PARTITIONS,
                                                     batch_size=REPARTITION_BATCH, within_s=REPARTITION_WITHIN_S)
        self.stage.start()

    @mode.Service.task
    async def _watch(self) -> None:
        while not self.should_stop:
            await self.sleep(1.0)
            code = self.stage.exitcode if self.stage is not None else None
            if code is not None and not self.should_stop:
                await app.crash(RuntimeError(f"the repartition stage exited with code {code} (its log is above)"))
                return

    async def on_stop(self) -> None:
        if self.stage is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.stage.stop)


def all_counters() -> dict[str, int]:
    """This worker's event counters: stage 2's plus the repartition stage's (``/stats/``)."""
    stage = _RepartitionStage.stage.counters() if _RepartitionStage.stage is not None else {}
    return {**counters, "repartitioned": stage.get("repartitioned", 0),
            "dead_lettered": counters["dead_lettered"] + stage.get("dead_lettered", 0)}


app.service(_RepartitionStage)


def _occupancy_key(partition: int, ownership: str | None, tier: str, instance_id: str) -> str:
    return f"{partition}/{ownership or PRIMARY}/{tier}/{instance_id}"


def _add_occupancy(partition: int, deltas: dict[tuple, int]) -> None:
    for (ownership, tier, instance_id), delta in deltas.items():
        if not delta:
            continue
        key = _occupancy_key(partition, ownership, tier, instance_id)
        current = tier_occupancy.get(key)
        blocks = (current["resident_blocks"] if current else 0) + delta
        value = {"ownership": ownership, "tier": tier, "instance_id": instance_id, "resident_blocks": blocks}
        write_small_table(tier_occupancy, partition, key, value)
        outputs.occupancy(key, value)


def write_small_table(table, partition: int, key: str, value: dict) -> None:
    """``table[key] = value`` for an in-memory table (``SMALL_TABLE_STORE``) on stage 2's path, without Faust.

    Writes the store's dict and its key -> partition map (Faust drops a revoked partition's keys by it) and
    produces the changelog record (UTF-8 key, the table's Avro codec) to ``partition``, the stage-2
    partition being applied, as Faust's own send would. Faust's send costs about 100 µs per key and a batch
    message writes tens of keys; this record goes through the output producer, which is flushed before the
    batch's offset can be committed (at least once, like the residency writes).
    """
    store = table.data
    store.data[key] = value
    store._key_partition[key] = partition
    outputs.produce(table.changelog_topic.get_topic_name(), key.encode(),
                    TABLE_CODECS[table.value_type._options.serializer]._avro.encode(value), partition)


def partition_of(key: str) -> int:
    """Partition of a residency key in this app (:func:`stream_apps.residency.key_partition`)."""
    return key_partition(key, PARTITIONS)


class _ResidencyStore:
    """Reads and writes the ``residency`` table on stage 2's hot path, bypassing Faust's per-key changelog send.

    Faust's ``table[key] = value`` sends one changelog record through its own producer, about 100 µs each,
    more than applying the event. Here an entry is written to the table's store and its Avro bytes are
    produced to the table's changelog topic (same key bytes, same value codec, the partition being
    processed) through the confluent-kafka producer of the output topics, which is flushed before any
    offset is committed (:func:`settle_outputs`): at least once, as Faust's own table writes. Faust
    still recovers the table from that changelog, serves standbys from it and routes lookups by key.

    A RocksDB store is written only after the changelog records are acknowledged (entries wait in
    ``_pending``, where reads find them), in one atomic write batch per partition with the changelog offset
    it now holds (Faust reads the changelog on from there at start).
    So the disk never runs ahead of the changelog: a worker killed mid-batch restarts from the disk plus
    whatever changelog records did arrive, and the redelivered events redo the rest. (Writing the disk
    first, as Faust does, loses an update for good: the restarted worker keeps the newer value, ignores
    the redelivered event as a duplicate, and the changelog never gets it; ``make chaos`` found it.)
    """

    #: Decoded entries kept in front of a RocksDB store (a read decodes Avro, ~18 µs; a block's events come
    #: close together). Written through; emptied when partitions are revoked.
    CACHE_ENTRIES = int(os.environ.get("KVSTREAM_RESIDENCY_CACHE", "100000"))

    def __init__(self, table) -> None:
        self.table = table
        self.codec = AvroCodec("residency")
        #: Encodes an entry's changelog value: the hand-written writer (about 6x faster than fastavro).
        self.encode = getattr(_hand_written(ResidencyWriter, self.codec), "encode", self.codec.encode)
        self.topic = table.changelog_topic.get_topic_name()
        #: Highest changelog offset acknowledged per partition since the last :meth:`persist_offsets`.
        self._acked: dict[int, int] = {}
        #: Key -> decoded entry (None: known absent), least recently written or read first; RocksDB stores
        #: only. An OrderedDict: evicting the oldest key of a plain dict (``del d[next(iter(d))]``) scans the
        #: slots its earlier deletions left at the front, 22 µs per eviction at 100,000 keys, which was 42% of
        #: stage 2's time with a RocksDB store (py-spy); ``popitem(last=False)`` is O(1).
        self._cache: OrderedDict[str, dict | None] = OrderedDict()
        #: Partition -> key -> (entry or None, Avro bytes or None): written, not yet acknowledged nor on disk.
        self._pending: dict[int, dict[str, tuple[dict | None, bytes | None]]] = defaultdict(dict)

    def forget(self) -> None:
        """Drop the cache (partitions were revoked: another worker may write their keys now).

        Pending entries stay: they belong to the batch in hand, which finishes before the rebalance does.
        """
        self._cache.clear()

    @property
    def _memory(self) -> bool:
        # the store exists once the app has started; an isinstance check per write showed up in profiles
        memory = self.__dict__.get("_memory_store")
        if memory is None:
            memory = self.__dict__["_memory_store"] = isinstance(self.table.data, faust.stores.memory.Store)
        return memory

    def get(self, partition: int, key: str) -> dict | None:
        """The entry under ``key`` for the agent applying a batch of ``partition`` (remembered in the cache)."""
        if self._memory:
            return self.table.data.data.get(key)
        pending = self._pending[partition].get(key)
        if pending is not None:
            return pending[0]
        cache = self._cache
        if key in cache:
            return cache[key]
        raw = self.table.data._db_for_partition(partition).get(key.encode())
        entry = None if raw is None else self.codec.decode(raw)
        self._remember(key, entry)
        return entry

    def lookup(self, key: str) -> dict | None:
        """The entry under ``key`` for a query, if this worker holds the key's partition. Never fills the
        cache: a query can come while a partition is still being recovered (Faust writes recovered entries
        to the store directly)."""
        if self._memory:
            return self.table.data.data.get(key)
        partition = partition_of(key)
        pending = self._pending[partition].get(key)
        if pending is not None:
            return pending[0]
        if key in self._cache:
            return self._cache[key]
        db = self.table.data._dbs.get(partition)
        raw = None if db is None else db.get(key.encode())
        return None if raw is None else self.codec.decode(raw)

    def _remember(self, key: str, entry: dict | None) -> None:
        cache = self._cache
        cache[key] = entry
        cache.move_to_end(key)
        if len(cache) > self.CACHE_ENTRIES:
            cache.popitem(last=False)

    def put(self, partition: int, key: str, entry: dict | None) -> None:
        """Write ``entry`` (None: delete) to the store and its changelog record to ``partition``.

        A RocksDB store is written through its partition's database, not Faust's ``_set``/``_del``, which
        remember every key ever written in a Python dict (``_key_index``): a gigabyte at 10 million rows.
        """
        store = self.table.data
        raw_key = key.encode()
        value = None if entry is None else self.encode(entry)
        if self._memory:
            if entry is None:
                store.data.pop(key, None)
            else:
                store.data[key] = entry
            store._key_partition[key] = partition  # lets Faust drop the key when the partition is revoked
            outputs.produce(self.topic, raw_key, value, partition)
        else:
            self._pending[partition][key] = (entry, value)
            self._remember(key, entry)
            outputs.produce(self.topic, raw_key, value, partition, on_delivery=self._on_delivery)

    def _on_delivery(self, error, message) -> None:
        if error is None:
            partition = message.partition()
            self._acked[partition] = max(self._acked.get(partition, -1), message.offset())
        else:
            outputs.on_delivery(error, message)

    def persist_offsets(self) -> None:
        """After a flush that acknowledged every output: write a RocksDB store's pending entries and the
        changelog offset they reach, atomically per partition (no-op in memory)."""
        if self._memory:
            return
        from rocksdict import WriteBatch

        store = self.table.data
        for partition, entries in self._pending.items():
            if not entries:
                continue
            batch = WriteBatch(raw_mode=True)
            for key, (_, value) in entries.items():
                if value is None:
                    batch.delete(key.encode())
                else:
                    batch.put(key.encode(), value)
            if partition in self._acked:
                batch.put(store.offset_key, str(self._acked[partition]).encode())
            store._db_for_partition(partition).write(batch)
            entries.clear()
        self._acked.clear()

    def keys_of(self, partition: int) -> list[str]:
        """Keys of this worker's store that belong to ``partition`` (a scan: for rare source-wide events).

        Uses the stores' own partition bookkeeping (the memory store's key -> partition map, the RocksDB
        store's database per partition), so a scan costs one pass over that partition's keys.
        """
        store = self.table.data
        if self._memory:
            return [key for key, p in list(store._key_partition.items()) if p == partition and key in store.data]
        on_disk = [raw.decode() for raw in store._db_for_partition(partition).keys() if raw != store.offset_key]
        return list(dict.fromkeys([*on_disk, *self._pending[partition]]))


residency_store = _ResidencyStore(residency)


def settle_outputs() -> None:
    """Wait for every stage-2 output to be acknowledged, then write the acknowledged residency entries to
    RocksDB (:meth:`_ResidencyStore.persist_offsets`). Raises RuntimeError as :meth:`_OutputTopics.flush`."""
    outputs.flush()
    residency_store.persist_offsets()


class _CommitGate(faust.Sensor):
    """Settles stage 2's outputs whenever Faust is about to commit offsets.

    Faust calls ``on_commit_initiated`` synchronously at the start of every offset commit (the commit
    timer, rebalances, errors), before it picks the offsets of the acknowledged messages. A message is
    acknowledged only after the agent has finished it, and so has produced all its outputs; flushing here
    puts them on the broker before any of those offsets is committed: at least once. One flush per commit
    (every ``broker_commit_interval``, 2.8 s) instead of one per batch message: at 10,000 events/s the
    per-message flush was a quarter of stage 2's time, each waiting a broker round trip. It also freezes
    Python's GC at each commit (see the comment in :meth:`on_commit_initiated`).
    """

    def on_commit_initiated(self, consumer) -> None:
        # Python's full GC scans every tracked object: with a memory store's million rows it stopped the worker
        # for 0.5-1 s every few seconds (and freed almost nothing: rows are freed by reference counting).
        # Freezing moves what exists now out of the collector's sight, so each collection scans only what
        # was allocated since the last commit. The cost: cyclic garbage made before a freeze is never freed
        # (a few dozen objects per collection were seen).
        gc.freeze()
        try:
            settle_outputs()
        except RuntimeError as exc:  # nothing may be committed; a restart reads the messages again
            log.error("stopping the worker: %s", exc)
            asyncio.ensure_future(app.crash(exc))
            raise


app.sensors.add(_CommitGate())


@app.on_partitions_revoked.connect
async def _forget_cached_entries_on_revoke(app, revoked, **kwargs) -> None:
    settle_outputs()  # pending RocksDB entries of revoked partitions reach the disk before their DBs close
    residency_store.forget()


@app.on_partitions_assigned.connect
async def _forget_cached_entries_on_assign(app, assigned, **kwargs) -> None:
    residency_store.forget()


@app.agent(kv_events_by_ownership, name="materialize-residency")
async def materialize_residency(stream):
    """Stage 2: apply each batch message to the residency table; write each touched key once per message.

    The outputs (changelog records included) are flushed before Faust commits offsets (:class:`_CommitGate`),
    not per message; Faust acknowledges each message as it ends. Outputs of several messages can therefore be
    unflushed at once, so a source-wide event flushes its row changes before the record that marks it
    applied (:meth:`_BatchApplier.apply`, :func:`_apply_source_event`). (Grouping messages with Faust's
    ``take_events`` failed 2 of 13 chaos crash runs before that ordering existed; it is not needed now.)
    """
    async for event in stream.events():
        try:
            batch = batch_codec.decode(event.value)
        except DecodeError as exc:
            await _dead_letter(event, str(exc))
            continue
        applier = _BatchApplier(event.message.partition)
        for item in batch["events"]:
            try:
                applier.apply(item, event_codec.decode(item["event"]))
            except (DecodeError, InvalidRecord) as exc:
                await _dead_letter(event, str(exc), key=item["key"].encode(), value=item["event"])
            except Exception as exc:  # a record this code cannot apply: keep it, say why, go on
                log.exception("could not apply %s", item["key"])
                await _dead_letter(event, f"could not apply: {type(exc).__name__}: {exc}",
                                   key=item["key"].encode(), value=item["event"])
        applier.finish()


class InvalidRecord(ValueError):
    """A decodable kv_event that cannot be applied as routed (the message says why; it is dead-lettered)."""


class _BatchApplier:
    """Applies one stage-2 batch message (one partition) and writes each touched key once at the end.

    Small per-batch caches spare a Faust table lookup per event: clear watermarks per source and publisher
    epochs per publisher (both change only through source-wide events, which are applied in order here).
    """

    def __init__(self, partition: int) -> None:
        self.partition = partition
        #: Residency key -> entry (None: deleted), written back at :meth:`finish` or before a source-wide event.
        self.touched: dict[str, dict | None] = {}
        #: (ownership, tier, instance) -> change of resident blocks.
        self.occupancy: dict[tuple, int] = defaultdict(int)
        #: Publisher key -> {"record": newest, "count": events}.
        self.publishers: dict[str, dict] = {}
        #: Touched keys that were absent from the store: deleting one again writes nothing (no tombstone).
        self.new_keys: set[str] = set()
        self._watermarks: dict[str, tuple[int, int, int]] = {}
        self._epochs: dict[str, int | None] = {}

    def _watermark(self, source: str) -> tuple[int, int, int]:
        mark = self._watermarks.get(source)
        if mark is None:
            mark = self._watermarks[source] = _mark_of(clear_watermarks.get(source))
        return mark

    def _retired_epoch(self, publisher: str) -> int | None:
        if publisher not in self._epochs:
            known = publisher_epochs.get(publisher)
            self._epochs[publisher] = None if known is None else known["publisher_epoch"]
        return self._epochs[publisher]

    def write_back(self) -> None:
        """Write every touched entry to the table (one changelog record per key)."""
        new_keys = self.new_keys
        for key, entry in self.touched.items():
            if entry is not None or key not in new_keys:
                residency_store.put(self.partition, key, entry)
        self.touched.clear()
        new_keys.clear()

    def finish(self) -> None:
        """Write the batch's entries, occupancy changes and per-publisher activity."""
        self.write_back()
        _add_occupancy(self.partition, self.occupancy)
        _note_applied(self.partition, self.publishers)

    def apply(self, item: dict, record: dict) -> None:
        """Apply one re-keyed event (``item`` from the ownership batch, ``record`` its decoded kv_event)."""
        counters["materialized"] += 1
        partition = self.partition
        source = f"{partition}/{record['instance_id']}/{record['data_parallel_rank']}"
        watermark = self._watermark(source)
        mark = _mark_of(item["clear_mark"])
        kind, body = record["event"]
        if kind in SOURCE_WIDE_EVENTS:
            self.write_back()  # source-wide events scan the stored entries
            self._watermarks.clear()
            self._epochs.clear()
            if kind == ALL_BLOCKS_CLEARED:
                if mark <= watermark:
                    stats.duplicates += 1
                    return
                _apply_clear_on_partition(partition, record, mark, self.occupancy)
                # the watermark says "applied": it may reach the broker only after the rows the clear removed
                # did, or a worker restarted after a crash would skip the redelivered clear as a duplicate
                # while some of its removals never reached the changelog (make chaos, crash scenario)
                settle_outputs()
                write_small_table(clear_watermarks, partition, source, _watermark(record))
            else:
                _apply_source_event(partition, record, self.occupancy)
            return
        worker = record["worker_rank"]
        publisher = f"{source}/{-1 if worker is None else worker}"
        retired = self._retired_epoch(publisher)
        if retired is not None and record["publisher_epoch"] < retired:
            stats.retired_late += 1
            return
        key = item["key"]
        block_hash = record["block_hash"]
        if block_hash is None or key != f"{body['ownership'] or PRIMARY}/{block_hash.hex()}":
            # routed by its kvstream-ownership header (stream_apps/repartition.py), which the record contradicts
            raise InvalidRecord(f"routed as {key!r}, but the record's ownership is {body['ownership']!r} and its "
                                f"block hash {None if block_hash is None else block_hash.hex()}")
        touched = self.touched
        if key in touched:
            entry = touched[key]
        else:
            entry = residency_store.get(self.partition, key)
            if entry is None:
                self.new_keys.add(key)
        instance = record["instance_id"]
        entry, delta, copies = apply_block_event(entry, record, mark, watermark, SOURCES.clear_tiers(instance), stats,
                                                 SOURCES.aggregation.get(instance))
        touched[key] = entry
        seen = self.publishers.get(publisher)
        if seen is None:
            seen = self.publishers[publisher] = {"record": record, "count": 0}
        seen["record"] = record
        seen["count"] += 1
        if delta:
            self.occupancy[(body["ownership"], record["tier"], instance)] += delta
            outputs.change(block_hash, body["ownership"], instance, record["data_parallel_rank"], record["tier"],
                           body["medium"], body["locality"], body["group_idx"], delta > 0, copies, record["ts"],
                           kind.rsplit(".", 1)[-1])


def _publisher_key(partition: int, record: dict) -> str:
    worker = -1 if record["worker_rank"] is None else record["worker_rank"]
    return f"{partition}/{record['instance_id']}/{record['data_parallel_rank']}/{worker}"


def _source_status(key: str, record: dict) -> dict:
    return sources.get(key) or {
        "instance_id": record["instance_id"], "data_parallel_rank": record["data_parallel_rank"],
        "worker_rank": -1 if record["worker_rank"] is None else record["worker_rank"],
        "publisher_epoch": record["publisher_epoch"], "stale": False, "first_lost_seq": None, "last_lost_seq": None,
        "gaps": 0, "restarts": 0, "last_seq": None, "last_event_ts": None, "events_applied": 0,
        "changed_ts": record["ts"]}


def _note_applied(partition: int, seen: dict[str, dict]) -> None:
    """Fold a batch's per-publisher activity (``{publisher key: {"record": newest, "count": n}}``) into ``sources``."""
    for key, last in seen.items():
        record = last["record"]
        status = _source_status(key, record)
        status.update(publisher_epoch=max(status["publisher_epoch"], record["publisher_epoch"]),
                      last_seq=record["seq"], last_event_ts=record["ts"],
                      events_applied=status["events_applied"] + last["count"])
        write_small_table(sources, partition, key, status)


def _apply_source_event(partition: int, record: dict, occupancy: dict[tuple, int]) -> None:
    """PublisherRestarted: retire the earlier epochs' residency on this partition; SourceStale: mark the source."""
    kind, body = record["event"]
    key = _publisher_key(partition, record)
    status = _source_status(key, record)
    if kind == SOURCE_STALE:
        if record["publisher_epoch"] < status["publisher_epoch"]:
            return  # a loss in an epoch that has since ended
        status.update(stale=True, first_lost_seq=body["first_lost_seq"], last_lost_seq=body["last_lost_seq"],
                      publisher_epoch=record["publisher_epoch"], gaps=status["gaps"] + 1, changed_ts=record["ts"])
        write_small_table(sources, partition, key, status)
        return
    new_epoch = record["publisher_epoch"]
    known = publisher_epochs.get(key)
    if known is not None and new_epoch <= known["publisher_epoch"]:
        stats.duplicates += 1
        return
    instance, dp_rank = record["instance_id"], record["data_parallel_rank"]
    retired = _rewrite_partition(partition, instance, occupancy, lambda entry: retire_epoch(
        entry, instance, dp_rank, record["worker_rank"], new_epoch, stats), record["ts"], "PublisherRestarted")
    settle_outputs()  # the retired rows reach the changelog before the epoch that marks them done (as a clear)
    write_small_table(publisher_epochs, partition, key, _watermark(record))
    status.update(stale=False, first_lost_seq=None, last_lost_seq=None, publisher_epoch=new_epoch, gaps=0,
                  restarts=status["restarts"] + 1, changed_ts=record["ts"])
    write_small_table(sources, partition, key, status)
    log.info("publisher %s restarted (epoch %d): %d resident rows retired on partition %d", key, new_epoch,
             retired, partition)


def source_rows(now: float | None = None) -> list[dict]:
    """One status per publisher, merged over partitions, sorted.

    Source-wide facts (epoch, restarts, stale) come from the partition copy with the newest epoch and most
    restarts; ``events_applied`` is the sum over partitions, ``last_event_ts`` and ``last_seq`` the newest.
    ``lag_s`` is ``now`` minus ``last_event_ts`` (the engine's clock against this worker's).
    """
    now = time.time() if now is None else now
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for status in sources.values():
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


def _rewrite_partition(partition: int, instance: str, occupancy: dict[tuple, int], rewrite, ts: float,
                       cause: str) -> int:
    """Rewrite every residency entry of this partition with ``rewrite(entry) -> (entry, stopped rows, changed)``.

    Source-wide events are rare, so a scan of the partition's keys is fine; only changed entries are
    written (one changelog record each). Returns the number of rows that stopped being resident.
    """
    stopped_total = 0
    for key in residency_store.keys_of(partition):
        entry = residency_store.get(partition, key)
        if entry is None:
            continue
        new_entry, stopped, changed = rewrite(entry)
        if new_entry is None or changed:
            residency_store.put(partition, key, new_entry)
        for row in stopped:
            stopped_total += 1
            occupancy[(entry["ownership"], row["tier"], instance)] -= 1
            outputs.change(entry["block_hash"], entry["ownership"], row["instance_id"], row["data_parallel_rank"],
                           row["tier"], None, row["locality"], row["group_idx"], False, 0, ts, cause)
    return stopped_total


def _apply_clear_on_partition(partition: int, record: dict, mark: tuple[int, int, int],
                              occupancy: dict[tuple, int]) -> None:
    """Remove the source's rows in scope on this partition (a clear is rare: a scan is fine)."""
    instance, dp_rank = record["instance_id"], record["data_parallel_rank"]
    cleared = _rewrite_partition(partition, instance, occupancy, lambda entry: apply_clear(
        entry, instance, dp_rank, mark, SOURCES.clear_tiers(instance), stats), record["ts"], "AllBlocksCleared")
    log.info("AllBlocksCleared from %s/%s applied on partition %d: %d resident rows removed", instance, dp_rank,
             partition, cleared)


def occupancy_rows() -> list[dict]:
    """Resident blocks per (ownership, tier, instance), summed over partitions, sorted."""
    totals: dict[tuple, int] = defaultdict(int)
    for value in tier_occupancy.values():
        totals[(value["ownership"] or "", value["tier"], value["instance_id"])] += value["resident_blocks"]
    return [{"ownership": own or None, "tier": tier, "instance_id": inst, "resident_blocks": n}
            for (own, tier, inst), n in sorted(totals.items()) if n]


def known_ownerships() -> set[str | None]:
    """Ownerships with resident blocks anywhere (None = primary), from the global occupancy table."""
    return {None} | {value["ownership"] for value in tier_occupancy.values()}


def _row_json(ownership: str | None, row: dict) -> dict:
    return {"ownership": ownership, "instance_id": row["instance_id"],
            "data_parallel_rank": row["data_parallel_rank"], "tier": row["tier"], "medium": row["medium"],
            "locality": row["locality"], "group_idx": row["group_idx"], "copies": row["copies"],
            "since": row["since"], "last_ts": row["last_ts"],
            "workers": [{"worker_rank": None if w["worker_rank"] < 0 else w["worker_rank"], "count": w["count"],
                         "publisher_epoch": w["publisher_epoch"], "last_seq": w["seq"]} for w in row["workers"]]}


def entry_json(key: str) -> list[dict]:
    """Resident rows of one local residency key, as JSON-ready dicts."""
    entry = residency_store.lookup(key)
    if entry is None:
        return []
    return [_row_json(entry["ownership"], row) for row in entry["rows"] if row["copies"] > 0]


@app.page("/residency-key/{key:.+/[0-9a-f]+}/")
@app.table_route(table=residency, match_info="key")
async def residency_key_view(web, request, key: str):
    """Internal: resident rows of one table key, answered by the worker that holds it."""
    return web.json({"rows": entry_json(key)})


@app.page("/residency/{block_hash_hex}/")
async def residency_view(web, request, block_hash_hex: str):
    """Every resident row of a block, over all ownerships, and the freshness of each source holding it:
    ``{"block_hash": hex, "rows": [...], "sources": [{..., "last_event_ts", "lag_s", "stale"}]}``."""
    try:
        block_hash = parse_hex_block_hash(block_hash_hex)
    except InvalidBlockHash as exc:
        return web.json({"error": str(exc)}, status=400)
    try:
        rows = await _block_rows(block_hash)
    except (aiohttp.ClientError, OSError, KeyError) as exc:  # the owner is gone or not yet assigned: rebalancing
        return web.json({"error": f"the worker holding this block did not answer ({type(exc).__name__}); "
                                  "the group is probably rebalancing: retry"}, status=503)
    holders = {(row["instance_id"], row["data_parallel_rank"]) for row in rows}
    freshness = [{name: source[name] for name in ("instance_id", "data_parallel_rank", "worker_rank",
                                                  "publisher_epoch", "last_event_ts", "lag_s", "stale")}
                 for source in source_rows() if (source["instance_id"], source["data_parallel_rank"]) in holders]
    return web.json({"block_hash": block_hash.hex(), "rows": rows, "sources": freshness})


async def _block_rows(block_hash: bytes) -> list[dict]:
    """Resident rows of one block over all ownerships, from whichever workers hold them."""
    keys = [residency_key(own, block_hash) for own in sorted(known_ownerships(), key=lambda o: o or "")]
    parts = await asyncio.gather(*(_lookup(key) for key in keys))
    return [row for part in parts for row in part]


class _BadRequest(ValueError):
    """A request the API refuses (HTTP 400); the message is the reason."""


def _prefix_request(body: bytes) -> list[bytes]:
    if len(body) > MAX_REQUEST_BYTES:
        raise _BadRequest(f"request body of {len(body)} bytes (limit {MAX_REQUEST_BYTES})")
    try:
        request = json.loads(body)
    except ValueError:
        raise _BadRequest("request body is not JSON") from None
    hashes = request.get("block_hashes") if isinstance(request, dict) else None
    if not isinstance(hashes, list) or not hashes or not all(isinstance(h, str) for h in hashes):
        raise _BadRequest('expected {"block_hashes": ["<hex>", ...]} with at least one hash')
    if len(hashes) > MAX_PREFIX_BLOCKS:
        raise _BadRequest(f"{len(hashes)} block hashes (limit {MAX_PREFIX_BLOCKS})")
    try:
        return [parse_hex_block_hash(h) for h in hashes]
    except InvalidBlockHash as exc:
        raise _BadRequest(str(exc)) from None


async def _read_body(request, limit: int) -> bytes:
    """The request body, or its first ``limit`` bytes if it is longer (``content.read(n)`` alone returns what
    has arrived so far, which under load is part of the body)."""
    body = bytearray()
    while len(body) < limit:
        chunk = await request.content.read(limit - len(body))
        if not chunk:
            break
        body += chunk
    return bytes(body)


@app.page("/prefix-match/")
class PrefixMatchView(faust.web.View):
    """``POST /prefix-match/`` with ``{"block_hashes": [hex, ...]}`` (prefix order): per (instance, dp rank)
    the longest consecutive prefix resident on each tier and a tier-weighted score, best first."""

    async def post(self, request):
        body = await _read_body(request, MAX_REQUEST_BYTES + 1)
        try:
            hashes = _prefix_request(body)
        except _BadRequest as exc:
            return self.json({"error": str(exc)}, status=400)
        try:
            rows = await asyncio.gather(*(_block_rows(h) for h in hashes))
        except (aiohttp.ClientError, OSError, KeyError) as exc:
            return self.json({"error": f"a worker did not answer ({type(exc).__name__}); the group is probably "
                                       "rebalancing: retry"}, status=503)
        return self.json({"block_count": len(hashes), "weights": TIER_WEIGHTS,
                          "matches": prefix_match(rows, TIER_WEIGHTS)})


async def _lookup(key: str) -> list[dict]:
    url = app.router.key_store(residency.name, key)
    if (url.host, url.port) == (app.conf.canonical_url.host, app.conf.canonical_url.port):
        return entry_json(key)
    async with app.http_client.get(url.with_path(f"/residency-key/{quote(key, safe='/')}/")) as response:
        response.raise_for_status()
        return (await response.json())["rows"]


@app.page("/occupancy/")
async def occupancy_view(web, request):
    """Resident blocks per (ownership, tier, instance): ``{"occupancy": [...]}``."""
    return web.json({"occupancy": occupancy_rows()})


@app.page("/sources/")
async def sources_view(web, request):
    """Per publisher: epoch, restarts, stale and the last lost seqs: ``{"sources": [...]}``."""
    return web.json({"sources": source_rows()})


@app.page("/stats/")
async def stats_view(web, request):
    """This worker's counters: events re-keyed and materialized, duplicates, unknown removals, dead letters."""
    return web.json({**all_counters(), "applied": stats.applied, "duplicates": stats.duplicates,
                     "cleared_late": stats.cleared_late, "retired_late": stats.retired_late,
                     "unknown_removals": stats.unknown_removals, "unknown_parents": stats.unknown_parents,
                     "became_resident": stats.became_resident, "stopped_resident": stats.stopped_resident,
                     "unknown_media": stats.unknown_media})


def declared_topics() -> dict[str, tuple[int, dict[str, str]]]:
    """Every topic this app reads or writes: name -> (partitions, topic configs).

    ``kvstream worker`` creates them before Faust starts: a topic that Faust
    creates while the consumer group forms is left out of the first assignment
    (seen with kv-events-by-ownership and the global table's changelog: their
    agents stayed idle until the next rebalance).
    """
    topics = {KV_EVENTS: (PARTITIONS, {}),
              kv_events_by_ownership.get_topic_name(): (PARTITIONS, {"max.message.bytes": str(8 << 20)}),
              source_clears_topic(app.conf.id): (PARTITIONS, {"cleanup.policy": "compact"}),
              KV_EVENTS_DEAD_LETTER: (1, {}),
              KV_RESIDENCY_CHANGES: (PARTITIONS, {}), KV_TIER_OCCUPANCY: (PARTITIONS, {"cleanup.policy": "compact"}),
              f"{app.conf.id}-__assignor-__leader": (1, {})}
    for table in app.tables.values():
        topics[table.changelog_topic.get_topic_name()] = (table.partitions or PARTITIONS,
                                                          {"cleanup.policy": "compact"})
    return topics


def main() -> None:
    """Run Faust's command line on this app (``python -m stream_apps.app worker``)."""
    app.main()


if __name__ == "__main__":
    main()

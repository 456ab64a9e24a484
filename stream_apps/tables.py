"""The stream app's tables: names, keys, Avro values, stores.

| table | key | value (schemas/) | store |
| --- | --- | --- | --- |
| ``residency`` | ``<ownership or primary>/<block hash hex>`` | ``residency`` | ``--store`` (RocksDB by default) |
| ``clear-watermarks`` | ``<partition>/<instance>/<dp rank>`` | ``clear_watermark`` | memory |
| ``publisher-epochs`` | ``<partition>/<instance>/<dp rank>/<worker rank or -1>`` | ``clear_watermark`` | memory |
| ``tier-occupancy`` (global) | ``<partition>/<ownership or primary>/<tier>/<instance>`` | ``tier_occupancy`` | memory |
| ``sources`` (global) | ``<partition>/<instance>/<dp rank>/<worker rank or -1>`` | ``source_status`` | memory |

Each has a compacted changelog topic ``<app id>-<table>-changelog``; the stores are
:mod:`stream_apps.store`'s. docs/residency.md says what the values mean.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import faust
from faust.serializers import codecs

from schemas import AvroCodec
from schemas.topics import TABLE_FAMILIES
from stream_apps.settings import WorkerSettings
from stream_apps.store import MemoryTableStore, RocksDBTableStore
from stream_apps.store_settings import residency_rocksdb_options


class AvroFaustCodec(codecs.Codec):
    """Faust codec over :class:`schemas.codec.AvroCodec`: how Faust reads a table's changelog values."""

    def __init__(self, family: str) -> None:
        super().__init__(family=family)
        self._avro = AvroCodec(family)

    def _dumps(self, obj) -> bytes:
        return self._avro.encode(obj)

    def _loads(self, data: bytes):
        return self._avro.decode(data)


def _codec_name(family: str) -> str:
    return f"kvstream_{family}"


for _family in set(TABLE_FAMILIES.values()):
    codecs.register(_codec_name(_family), AvroFaustCodec(_family))


class TableType:
    """Key or value type of a table, as Faust 0.15 wants it.

    Faust takes a table's serializers from its key and value types' ``_options.serializer`` and rebuilds values
    read from the changelog with ``type.from_data``. These types name our codecs and hand plain values through:
    string keys as raw UTF-8 (so Faust's router hashes the same bytes as
    :func:`stream_apps.residency.key_partition`), values as Avro records (dicts).

    Args:
        serializer: a Faust codec name.
        family: the schema family of the values (None for keys).
    """

    def __init__(self, serializer: str, family: str | None = None, decode=lambda data: data) -> None:
        self._options = types.SimpleNamespace(serializer=serializer)
        self.family = family
        self._decode = decode

    def from_data(self, data, preferred_type=None):
        return self._decode(data)


STRING_KEY = TableType("raw", decode=lambda data: data.decode() if isinstance(data, bytes) else data)

#: The store of the small tables. Faust picks a table's store with ``table._store or app.conf.store``, and
#: yarl's ``URL('kvstream-memory://')`` is falsy (no host, no path): hence a host.
SMALL_TABLE_STORE = "kvstream-memory://local"


@dataclass
class Tables:
    """The app's tables. Each one's ``data`` is a :mod:`stream_apps.store` store."""

    #: ``<ownership or primary>/<block hash hex>`` -> residency entry: where a block of an ownership is resident.
    residency: faust.Table
    #: ``<partition>/<instance>/<dp rank>`` -> the latest ``AllBlocksCleared`` applied on that partition.
    clear_watermarks: faust.Table
    #: ``<partition>/<instance>/<dp rank>/<worker rank or -1>`` -> the latest ``PublisherRestarted`` applied there.
    publisher_epochs: faust.Table
    #: ``<partition>/<ownership or primary>/<tier>/<instance>`` -> resident blocks (global: every worker reads all).
    tier_occupancy: faust.GlobalTable
    #: ``<partition>/<instance>/<dp rank>/<worker rank or -1>`` -> publisher status (global).
    sources: faust.GlobalTable

    @property
    def residency_store(self) -> RocksDBTableStore | MemoryTableStore:
        return self.residency.data

    def all(self) -> list:
        """Every table, residency first: the partitioned tables, then the global ones."""
        return self.partitioned_tables() + self.global_tables()

    def global_tables(self) -> list[faust.GlobalTable]:
        """The tables every worker reads whole (fleet views): their changelogs go out every
        ``--global-changelog-interval-s``, the others' every ``--changelog-interval-s``."""
        return [self.tier_occupancy, self.sources]

    def partitioned_tables(self) -> list[faust.Table]:
        """The tables whose partitions are shared out among the workers, residency first."""
        return [self.residency, self.clear_watermarks, self.publisher_epochs]


def define_tables(app: faust.App, settings: WorkerSettings) -> Tables:
    """Declare the tables on ``app`` (``settings.store`` for ``residency``, memory for the others)."""

    def table(name: str, help: str, factory=app.Table, store: str = SMALL_TABLE_STORE, options=None, **extra):
        family = TABLE_FAMILIES[name]
        return factory(name, key_type=STRING_KEY, value_type=TableType(_codec_name(family), family),
                       partitions=settings.partitions, help=help, store=store, options=options, **extra)

    return Tables(
        # store None: the app's store (STORE_SCHEMES[settings.store], set by stream_apps.app.create_app)
        residency=table("residency", "Where each block of each ownership is resident, one row per residency "
                                     "identity.", store=None,
                        options=residency_rocksdb_options(settings.rocksdb_write_buffer_mib,
                                                          settings.rocksdb_block_cache_mib)
                        if settings.store == "rocksdb://" else None),
        clear_watermarks=table("clear-watermarks", "Latest AllBlocksCleared applied per source and partition."),
        publisher_epochs=table("publisher-epochs", "Latest publisher epoch started per publisher and partition."),
        # recovery_buffer_size=1: Faust applies the other workers' records of a global table as they arrive, not
        # once 1,000 have piled up (its default), which left each worker's fleet-wide views a partial picture
        tier_occupancy=table("tier-occupancy", "Resident blocks per partition, ownership, tier, instance.",
                             factory=app.GlobalTable, recovery_buffer_size=1),
        sources=table("sources", "Epoch and staleness per publisher, from the bridge's events.",
                      factory=app.GlobalTable, recovery_buffer_size=1),
    )
